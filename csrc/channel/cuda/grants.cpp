// SPDX-License-Identifier: BSD-3-Clause
// The process's grant source and idle time (channel/grants.h).
#include "csrc/channel/grants.h"

#include <atomic>
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

std::atomic<int64_t> g_grantIdleMs{kDefaultGrantIdleMs};

} // namespace

void setGrantSource(std::shared_ptr<GrantSource> s) {
  std::lock_guard<std::mutex> lock(sourceMu());
  source() = std::move(s);
}

std::shared_ptr<GrantSource> grantSource() {
  std::lock_guard<std::mutex> lock(sourceMu());
  return source();
}

void setGrantIdleMs(int64_t ms) {
  g_grantIdleMs.store(ms, std::memory_order_relaxed);
}

int64_t grantIdleMs() {
  return g_grantIdleMs.load(std::memory_order_relaxed);
}

} // namespace torch_rpc_ext::channel
