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
  // Distributions by call kind (latency.h): torch_rpc_ext.metrics.
  CallCosts costs;
};

} // namespace torch_rpc_ext
