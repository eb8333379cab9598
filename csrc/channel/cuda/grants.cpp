// SPDX-License-Identifier: BSD-3-Clause
// The process's grant source (channel/grants.h).
#include "csrc/channel/grants.h"

#include <mutex>

namespace torch_rpc_ext::channel {

namespace {

std::mutex& sourceMu() {
  static auto* mu = new std::mutex();
  return *mu;
}

std::shared_ptr<GrantSource>& source() {
  static auto* s = new std::shared_ptr<GrantSource>();
  return *s;
}

} // namespace

void setGrantSource(std::shared_ptr<GrantSource> s) {
  std::lock_guard<std::mutex> lock(sourceMu());
  source() = std::move(s);
}

std::shared_ptr<GrantSource> grantSource() {
  std::lock_guard<std::mutex> lock(sourceMu());
  return source();
}

} // namespace torch_rpc_ext::channel
