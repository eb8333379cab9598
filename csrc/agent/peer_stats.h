// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <cstdint>

#include "csrc/agent/latency.h"

namespace torch_rpc_ext {

// Per-peer counters reported by get_metrics() as
// "rpc_ext.peer.<name>.<counter>". Relaxed atomics: these are statistics.
struct PeerStats {
  std::atomic<uint64_t> callsSent{0};
  std::atomic<uint64_t> callsServed{0};
  std::atomic<uint64_t> bytesSent{0};
  std::atomic<uint64_t> bytesReceived{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> timeouts{0};
  std::atomic<uint64_t> rejectedFrames{0};
  // Connection events (connections.cpp): dials made to the peer, of which
  // reconnects (one was open before), and those that closed before their
  // handshake ended; connections from the peer admitted; and ready
  // connections either way that closed for a reason (lost: reset, a
  // heartbeat timeout, a protocol error, a departure), not at shutdown.
  std::atomic<uint64_t> dials{0};
  std::atomic<uint64_t> reconnects{0};
  std::atomic<uint64_t> dialFailures{0};
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> connectionsLost{0};
  // Distributions by call kind (latency.h): torch_rpc_ext.metrics.
  CallCosts costs;
};

} // namespace torch_rpc_ext
