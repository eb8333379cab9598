// SPDX-License-Identifier: BSD-3-Clause
// What Agent reports: upstream's agent.* keys, GIL wait, and our per-peer
// counters (get_metrics / get_debug_info).
#include "csrc/agent/agent.h"
#include "csrc/agent/serve_callback.h"
#include "csrc/channel/registry.h"

namespace torch_rpc_ext {

void Agent::addGilWaitTime(std::chrono::microseconds gilWaitTime) {
  gilWaitTotalUs_.fetch_add(gilWaitTime.count(), std::memory_order_relaxed);
  gilWaitCount_.fetch_add(1, std::memory_order_relaxed);
}

std::unordered_map<std::string, std::string> Agent::getMetrics() {
  std::unordered_map<std::string, std::string> m;
  m["agent.thread_pool_size"] = std::to_string(pool_.size());
  m["agent.num_idle_threads"] = std::to_string(pool_.idle());
  {
    std::lock_guard<std::mutex> lock(callCountMutex_);
    m["agent.client_active_calls"] = std::to_string(clientActiveCalls_);
  }
  m["agent.server_active_calls"] = std::to_string(serverActiveCalls_.load());
  m["agent.server_active_async_calls"] =
      std::to_string(serverActiveAsyncCalls_.load());
  if (isGILProfilingEnabled()) {
    auto n = gilWaitCount_.load();
    m["agent.gil_average_wait_time_us"] =
        std::to_string(n == 0 ? 0 : gilWaitTotalUs_.load() / n);
  }
  m["rpc_ext.rejected_connections"] =
      std::to_string(rejectedConnections_.load());
  m["rpc_ext.late_responses"] = std::to_string(lateResponses_.load());
  m["rpc_ext.cached_operators"] =
      std::to_string(static_cast<const ServeCallback&>(*cb_).cachedOperators());
  m["rpc_ext.receive_pool_cached_bytes"] =
      std::to_string(buffers_->cachedBytes());
  m["rpc_ext.receive_pool_live_blocks"] =
      std::to_string(buffers_->liveBlocks());
  for (const auto& [name, t] : transports_) {
    for (const auto& [counter, value] : t->counters()) {
      m["rpc_ext." + name + "." + counter] = std::to_string(value);
    }
  }
  for (const auto& c : channels_) {
    for (const auto& [counter, value] : c->counters()) {
      m["rpc_ext.channel." + c->name() + "." + counter] = std::to_string(value);
    }
  }
  // Every peer is listed from the start, idle or not: the key set must not
  // change with traffic (upstream's test_debug_info compares the keys of two
  // snapshots taken while other workers may already be calling us).
  for (int r = 0; r < worldSize_; ++r) {
    const auto& s = stats_[r];
    std::string p = "rpc_ext.peer." + workers_[r].name_ + ".";
    m[p + "calls_sent"] = std::to_string(s.callsSent.load());
    m[p + "calls_served"] = std::to_string(s.callsServed.load());
    m[p + "bytes_sent"] = std::to_string(s.bytesSent.load());
    m[p + "bytes_received"] = std::to_string(s.bytesReceived.load());
    m[p + "errors"] = std::to_string(s.errors.load());
    m[p + "timeouts"] = std::to_string(s.timeouts.load());
    m[p + "rejected_frames"] = std::to_string(s.rejectedFrames.load());
  }
  return m;
}

std::unordered_map<std::string, std::string> Agent::getDebugInfo() {
  auto m = getMetrics();
  m["rpc_ext.address"] = address_;
  for (const auto& [name, address] : listenAddresses_) {
    m["rpc_ext.listen." + name] = address;
  }
  std::string ours;
  for (const auto& c : channels_) {
    ours += c->name() + ",";
  }
  m["rpc_ext.channels"] = ours + channel::kStreamChannelName;
  for (int r = 0; r < worldSize_; ++r) {
    std::string p = "rpc_ext.peer." + workers_[r].name_ + ".";
    m[p + "transport"] = routes_[r].transport;
    // What our connection to it uses, in order; the stream comes last.
    std::string used;
    auto t = transports_.find(routes_[r].transport);
    if (t != transports_.end()) {
      for (const auto& c : channelsFor(r, t->second->passesDescriptors())) {
        used += c.context->name() + ",";
      }
    }
    m[p + "channels"] = used + channel::kStreamChannelName;
  }
  m["rpc_ext.pending_calls"] = std::to_string(calls_.size());
  return m;
}

} // namespace torch_rpc_ext
