// SPDX-License-Identifier: BSD-3-Clause
// What Agent reports: upstream's agent.* keys, GIL wait, and our per-peer
// counters (get_metrics / get_debug_info).
#include <array>
#include <map>

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
  {
    const auto d = channel::cudaMemoryStats();
    m["rpc_ext.cuda.ipc_block_bytes"] = std::to_string(d.ipcBlockBytes);
    m["rpc_ext.cuda.staging_block_bytes"] = std::to_string(d.stagingBlockBytes);
    m["rpc_ext.cuda.oom_retries"] = std::to_string(d.oomRetries);
    m["rpc_ext.cuda.ipc_declined_memory"] = std::to_string(d.ipcDeclined);
  }
  m["rpc_ext.cuda.landing_launches"] = std::to_string(cudaLandings_.load());
  m["rpc_ext.cuda.landed_segments"] = std::to_string(cudaLanded_.load());
  m["rpc_ext.cuda.landed_bytes"] = std::to_string(cudaLandedBytes_.load());
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
  // snapshots taken while other workers may already be calling us). In a
  // dynamic group it changes only as members join: every name ever seen
  // stays, its counters summed over the workers that held it.
  std::map<std::string, std::array<uint64_t, 7>> byName;
  {
    std::lock_guard<std::mutex> lock(peersMutex_);
    for (const auto& peer : peers_) {
      const auto& s = peer->stats;
      auto& sum = byName[peer->info.name_];
      sum[0] += s.callsSent.load();
      sum[1] += s.callsServed.load();
      sum[2] += s.bytesSent.load();
      sum[3] += s.bytesReceived.load();
      sum[4] += s.errors.load();
      sum[5] += s.timeouts.load();
      sum[6] += s.rejectedFrames.load();
    }
  }
  static const char* const kCounters[] = {
      "calls_sent",
      "calls_served",
      "bytes_sent",
      "bytes_received",
      "errors",
      "timeouts",
      "rejected_frames"};
  for (const auto& [name, sum] : byName) {
    for (size_t i = 0; i < sum.size(); ++i) {
      m["rpc_ext.peer." + name + "." + kCounters[i]] = std::to_string(sum[i]);
    }
  }
  if (worldSize_ == 0) {
    auto v = view();
    m["rpc_ext.membership.epoch"] = std::to_string(v->epoch);
    m["rpc_ext.membership.size"] = std::to_string(v->byName.size());
    m["rpc_ext.membership.start_epoch"] = std::to_string(startEpoch_.load());
    m["rpc_ext.membership.dropped_forks"] =
        std::to_string(droppedForks_.load());
    m["rpc_ext.membership.dropped_autograd_contexts"] =
        std::to_string(droppedAutogradContexts_.load());
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
  auto v = view(); // held: a range-for does not keep a temporary alive
  for (const auto& peer : v->byId) {
    if (!peer) {
      continue;
    }
    std::string p = "rpc_ext.peer." + peer->info.name_ + ".";
    m[p + "transport"] = peer->route.transport;
    // What our connection to it uses, in order; the stream comes last.
    std::string used;
    auto t = transports_.find(peer->route.transport);
    if (t != transports_.end()) {
      for (const auto& c :
           channelsFor(peer->info.id_, t->second->passesDescriptors())) {
        used += c.context->name() + ",";
      }
    }
    m[p + "channels"] = used + channel::kStreamChannelName;
  }
  m["rpc_ext.pending_calls"] = std::to_string(calls_.size());
  return m;
}

} // namespace torch_rpc_ext
