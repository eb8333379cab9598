// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <string>

#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::shm {

// An shm connection: the stream core over an abstract Unix socket between
// two processes of one host. It passes descriptors, so it can host the
// channels that hand over shared memory that way (csrc/channel/shm/: slabs
// and rings), which carry its large segments.
class ShmConnection final : public stream::StreamConnection {
 public:
  static constexpr int kSendBufferBytes = 4 << 20;

  ShmConnection(
      stream::Loop& loop,
      const TransportOptions& options,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer);

 protected:
  void tuneSocket() override;
  bool passesDescriptors() const override {
    return true;
  }
};

} // namespace torch_rpc_ext::transport::shm
