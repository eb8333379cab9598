// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <string>

#include "csrc/transport/stream/listener.h"

namespace torch_rpc_ext::transport::shm {

class ShmTransport;

// An abstract Unix socket with a fresh random name ("@torch_rpc_ext-<pid>-
// <hex>"): nothing on disk to clean up, gone with the process.
class ShmListener final : public stream::StreamListener {
 public:
  explicit ShmListener(ShmTransport& transport);

 private:
  ShmListener(ShmTransport& transport, const std::string& name);
};

} // namespace torch_rpc_ext::transport::shm
