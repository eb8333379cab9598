// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/shm/listener.h"

#include <unistd.h>

#include "csrc/common/crypto.h"
#include "csrc/transport/shm/transport.h"

namespace torch_rpc_ext::transport::shm {

namespace {

std::string freshName() {
  static const char* digits = "0123456789abcdef";
  std::string name = "@torch_rpc_ext-" + std::to_string(::getpid()) + "-";
  for (unsigned char c : randomBytes(8)) {
    name += digits[c >> 4];
    name += digits[c & 15];
  }
  return name;
}

} // namespace

ShmListener::ShmListener(ShmTransport& transport)
    : ShmListener(transport, freshName()) {}

ShmListener::ShmListener(ShmTransport& transport, const std::string& name)
    : StreamListener(transport, stream::SocketAddress::parse(name), name, "") {}

} // namespace torch_rpc_ext::transport::shm
