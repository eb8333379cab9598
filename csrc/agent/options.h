// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/agent/faults.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext {

// Everything the agent takes from RpcExtBackendOptions, already validated by
// torch_rpc_ext/options.py.
struct AgentOptions {
  float rpcTimeoutSeconds = 60;
  int numWorkerThreads = 16;
  // Transports by preference; the first one both peers have is used.
  std::vector<std::string> transports = transport::transportNames();
  // Address to bind and advertise; empty means defaultAdvertisedAddress().
  std::string address;
  // Shared secret; empty means "create one at rendezvous, share via store".
  std::string secret;
  uint64_t maxFrameBytes = uint64_t(1) << 34;
  std::chrono::milliseconds handshakeTimeout{10000};
  // See TransportOptions::heartbeatTimeout.
  std::chrono::milliseconds heartbeatTimeout{10000};
  // See TransportOptions::busyPoll.
  std::chrono::microseconds busyPoll{0};
  // Idle receive buffers kept for reuse (released after 2 s unused).
  uint64_t maxCachedReceiveBytes = uint64_t(1) << 31;
  // Test-only fault injection (torch_rpc_ext.testing); empty in production.
  FaultInjection faults;
  // Limit on how long init waits for all peers to publish their address.
  std::chrono::milliseconds rendezvousTimeout{300000};
};

} // namespace torch_rpc_ext
