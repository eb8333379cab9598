// SPDX-License-Identifier: BSD-3-Clause
// The agent (agent.h): its life cycle (rendezvous, start, shutdown, join),
// the glue between its parts, and what it reports.
#include "csrc/agent/agent.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <optional>
#include <unordered_set>

#include <torch/csrc/distributed/rpc/agent_utils.h>
#include <torch/csrc/distributed/rpc/request_callback_impl.h>
#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/utils/pybind.h>

#include "csrc/agent/held_gil.h"
#include "csrc/agent/serve_callback.h"
#include "csrc/agent/torch_private.h"
#include "csrc/common/crypto.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/log_route.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

// Pool threads added when all are blocked (nested RPCs) stop at this many.
constexpr size_t kMaxPoolThreads = 4096;

std::chrono::milliseconds toMs(float seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

} // namespace

std::shared_ptr<Agent> Agent::create(
    const c10::intrusive_ptr<::c10d::Store>& store,
    std::string name,
    int rank,
    int worldSize,
    AgentOptions options) {
  // Before anything starts: every handshake needs libcrypto's HMAC.
  requireLibcrypto();
  // And a TORCH_RPC_EXT_AES_GCM this process cannot honour is named now,
  // not later as a rendezvous failure (the group secret is sealed with
  // AES-GCM) or as lanes left out (common/crypto.h, Aead).
  (void)Aead(std::string(Aead::kKeyBytes, '\0'));
  // A log setting this process cannot honour is named now (logging.h).
  const std::string logError = logSettingsError();
  TORCH_CHECK(logError.empty(), logError);
  setLogWorker(name);
  // Destroy without the GIL: shutdown() asserts the GIL is not held. Once
  // the process exits with the agent alive (common/exit_gate.h), it is left
  // in place: its parked threads still point into it.
  auto agent = std::shared_ptr<Agent>(
      new Agent(store, std::move(name), rank, worldSize, std::move(options)),
      [](Agent* a) {
        if (!ExitGate::closed()) {
          torch::impl::destroy_without_gil(a);
        }
      });
  agent->calls_.setOwner(agent);
  agent->server_.setOwner(agent);
  agent->rendezvous();
  return agent;
}

Agent::Agent(
    const c10::intrusive_ptr<::c10d::Store>& store,
    std::string name,
    int rank,
    int worldSize,
    AgentOptions options)
    : rpc::RpcAgent(
          rpc::WorkerInfo(std::move(name), static_cast<int64_t>(rank)),
          std::make_unique<ServeCallback>(),
          toMs(options.rpcTimeoutSeconds)),
      options_(std::move(options)),
      pool_(
          static_cast<size_t>(std::max(1, options_.numWorkerThreads)),
          kMaxPoolThreads),
      buffers_(
          std::make_shared<BufferPool>(
              options_.maxCachedReceiveBytes,
              std::chrono::milliseconds(2000))),
      calls_(workerInfo_.name_, pool_, [this] { buffers_->trim(); }),
      devices_(options_, workerInfo_.name_),
      rrefs_(
          static_cast<rpc::worker_id_t>(rank),
          workerInfo_.name_,
          /*dynamicGroup=*/worldSize == 0,
          [this](std::function<void()> task) { pool_.run(std::move(task)); }),
      group_(store, workerInfo_, worldSize, options_, *this),
      connections_(options_, workerInfo_, worldSize, group_, *this, pool_),
      server_(*cb_, rpcAgentRunning_, options_, devices_, rrefs_, group_) {
  // worldSize 0 is a dynamic group: any rank that fits dist autograd's
  // 16-bit worker ids.
  TORCH_CHECK(
      worldSize >= 0 && worldSize <= 32767,
      "world_size must be in [1, 32767], got ",
      worldSize);
  TORCH_CHECK(
      rank >= 0 && rank < (worldSize > 0 ? worldSize : 32768),
      "rank ",
      rank,
      worldSize > 0 ? " is outside [0, world_size=" : " is outside [0, ",
      worldSize > 0 ? worldSize : 32768,
      ")");
  if (!options_.faults.empty()) {
    faults_ = std::make_unique<FaultInjector>(options_.faults);
  }
}

Agent::~Agent() {
  shutdown();
}

void Agent::startImpl() {
  // torch sets its resolver just before start() (_set_and_start_rpc_agent);
  // completions under a held GIL need it wrapped (held_gil.h).
  typeResolver_ = held_gil::resolverFreeingTheGil(typeResolver_);
  connections_.start();
  rrefs_.setLive(true); // torch has made us its agent
}

void Agent::shutdownImpl() {
  if (shutdownDone_.exchange(true)) {
    return;
  }
  shuttingDown_ = true;
  calls_.close(); // failures settle inline from now on
  stopMembership();
  // Fail pending calls first: a request running on a loop thread may wait on
  // one of them, and stopping a transport waits for that request. Then again
  // for calls registered meanwhile by sends already past their check.
  const std::string why = "RPC agent of " + workerInfo_.name_ +
      " shut down before a response arrived";
  calls_.failAll(why);
  connections_.stop();
  calls_.failAll(why);
  calls_.stop();
  // Finish what the pool holds: completions just posted, and responses of
  // requests that were running (they are dropped, the transport is down).
  pool_.stop();
  connections_.dropAll();
}

void Agent::rendezvous() {
  const std::string& secret = group_.establishSecret();
  if (!options_.devices.empty()) {
    devices_.useTorchForChannelMemory();
    devices_.prepare(); // before any peer can send us a CUDA tensor
  }
  // Our entry: the name, then a line per transport we listen on and per
  // channel we offer.
  group_.join(
      workerInfo_.name_ + connections_.open(secret, group_.incarnation()),
      getRpcTimeout());
}

void Agent::stopMembership() {
  rrefs_.setLive(false);
  group_.stop();
}

namespace {
// How long a graceful shutdown waits for peers to give back what they hold
// of ours (Connections::settleChannels()), within the join's deadline.
std::chrono::milliseconds settleWithin(
    std::optional<std::chrono::steady_clock::time_point> deadline) {
  constexpr std::chrono::milliseconds kSettleWithin{2000};
  if (!deadline) {
    return kSettleWithin;
  }
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      *deadline - std::chrono::steady_clock::now());
  return std::clamp(left, std::chrono::milliseconds(0), kSettleWithin);
}
} // namespace

void Agent::join(bool shutdown, float timeout) {
  // Exiting with the agent alive: its threads are parked, nothing would
  // ever complete (common/exit_gate.h).
  TORCH_CHECK(
      !ExitGate::closed(),
      "RPC join on ",
      workerInfo_.name_,
      ": the process is exiting; call rpc.shutdown() before the end of the "
      "program");
  std::optional<std::chrono::steady_clock::time_point> deadline;
  // (From 1e9 s on, infinity among them: none, as for a call's timeout;
  // the cast of infinity was undefined.)
  if (timeout > 0 && timeout < 1e9F) {
    deadline = std::chrono::steady_clock::now() +
        std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  }
  if (group_.isDynamic()) {
    // A dynamic group has no barrier: a member leaves alone, once its own
    // calls are answered (group_elastic.cpp).
    calls_.drain(deadline, timeout);
    if (shutdown) {
      // Once nobody calls us and our calls are served: the members that
      // stay keep reading our connections, so they answer the settle.
      group_.leave(deadline);
      connections_.settleChannels(settleWithin(deadline));
      shuttingDown_ = true;
    }
    return;
  }
  while (true) {
    calls_.drain(deadline, timeout);
    // Everyone arrives with no calls of their own in flight...
    group_.barrier(0, deadline, timeout);
    // ...then counts what started meanwhile (nested or follow-up calls). The
    // count is held so that it does not go stale while it is summed; another
    // round runs if anybody still has calls.
    const bool idle = calls_.withActiveCount([&](int64_t active) {
      if (group_.barrier(active, deadline, timeout) != 0) {
        return false;
      }
      if (shutdown) {
        shuttingDown_ = true;
        // Every worker is here, its loops still reading: what peers hold of
        // each one's goes back before the connections close.
        connections_.settleChannels(settleWithin(deadline));
        group_.leaveBarrier(deadline, timeout);
      }
      return true;
    });
    if (idle) {
      return;
    }
  }
}

// ---- GroupListener: the parts the group hears from -------------------------

Route Agent::routeFor(const std::string& name, const std::string& offers) {
  return connections_.routeFor(name, offers);
}

GroupListener::Probe Agent::probe(const Peer& peer) {
  return connections_.probe(peer);
}

std::vector<std::string> Agent::whyUnreachable(
    const std::vector<const Peer*>& peers,
    std::chrono::milliseconds within,
    bool dial) {
  return connections_.whyUnreachable(peers, within, dial);
}

bool Agent::listenerAnswers(
    const std::string& name,
    const std::string& offers,
    std::chrono::milliseconds within) {
  return connections_.listenerAnswers(name, offers, within);
}

void Agent::onDeparted(const Peer& peer, bool dead) {
  connections_.dropPeer(peer, dead);
  rrefs_.release(
      static_cast<rpc::worker_id_t>(peer.info.id_),
      peer.info.name_,
      peer.departure());
}

void Agent::onFenced(const std::string& reason) {
  connections_.closeOutbound(reason);
}

void Agent::reserveIds(int32_t rank, int64_t generation) {
  torch_private::reserveIdRange(rank, generation);
}

int64_t Agent::callsBeingServed() {
  return server_.active();
}

// ---- What it reports --------------------------------------------------------

Agent::Health Agent::health(std::chrono::milliseconds within) const {
  Health h;
  // (torch's shutdown() clears rpcAgentRunning_ before shutdownImpl(): a
  // shutdown is told by our own flags first; one not graceful reads as
  // "has not started" in between, for as long as torch joins its retry
  // thread.)
  if (shuttingDown_.load() || shutdownDone_.load()) {
    h.notServing = "the agent of " + workerInfo_.name_ +
        " is shutting down (rpc.shutdown())";
  } else if (!rpcAgentRunning_.load()) {
    h.notServing = "the agent of " + workerInfo_.name_ + " has not started";
  } else if (group_.fenced()) {
    // ("this worker (<name>) was declared dead by the group at epoch ...")
    h.notServing =
        group_.fencedReason() + "; it serves nothing until it joins again";
  }
  h.loops = connections_.probeLoops(within);
  return h;
}

void Agent::addGilWaitTime(std::chrono::microseconds gilWaitTime) {
  gilWaitTotalUs_.fetch_add(gilWaitTime.count(), std::memory_order_relaxed);
  gilWaitCount_.fetch_add(1, std::memory_order_relaxed);
}

std::unordered_map<std::string, std::string> Agent::getMetrics() {
  std::unordered_map<std::string, std::string> m;
  m["agent.thread_pool_size"] = std::to_string(pool_.size());
  m["agent.num_idle_threads"] = std::to_string(pool_.idle());
  calls_.addMetrics(m);
  server_.addMetrics(m);
  if (isGILProfilingEnabled()) {
    auto n = gilWaitCount_.load();
    m["agent.gil_average_wait_time_us"] =
        std::to_string(n == 0 ? 0 : gilWaitTotalUs_.load() / n);
  }
  const auto& serving = static_cast<const ServeCallback&>(*cb_);
  m["rpc_ext.cached_operators"] = std::to_string(serving.cachedOperators());
  m["rpc_ext.rref_deletions_before_creation"] =
      std::to_string(serving.deletionsBeforeCreation());
  m["rpc_ext.receive_pool_cached_bytes"] =
      std::to_string(buffers_->cachedBytes());
  m["rpc_ext.receive_pool_live_blocks"] =
      std::to_string(buffers_->liveBlocks());
  devices_.addMetrics(m);
  connections_.addMetrics(m);
  // Every peer is listed from the start, idle or not: the key set must not
  // change with traffic (upstream's test_debug_info compares the keys of two
  // snapshots taken while other workers may already be calling us). In a
  // dynamic group it changes only as members join: every name ever seen
  // stays, its counters summed over the workers that held it.
  static const char* const kCounters[] = {
      "calls_sent",
      "calls_served",
      "bytes_sent",
      "bytes_received",
      "errors",
      "timeouts",
      "rejected_frames",
      "dials",
      "reconnects",
      "dial_failures",
      "accepted",
      "connections_lost",
      "in_flight"};
  const auto inFlight = calls_.pendingByPeer();
  const auto now = std::chrono::steady_clock::now();
  std::map<std::string, std::array<uint64_t, std::size(kCounters)>> byName;
  // Per name: how long its oldest call in flight has waited, in ms (0:
  // none): what a worker that waits on a stuck peer shows first.
  std::map<std::string, int64_t> oldestMs;
  std::unordered_set<const PeerStats*> counted; // a name's, once
  for (const auto& peer : group_.everyPeer()) {
    const auto& s = peer->stats;
    auto& sum = byName[peer->info.name_];
    // The name's counters once (its holders share them), and each holder's
    // calls in flight.
    if (counted.insert(&s).second) {
      size_t i = 0;
      for (const auto* n :
           {&s.callsSent,
            &s.callsServed,
            &s.bytesSent,
            &s.bytesReceived,
            &s.errors,
            &s.timeouts,
            &s.rejectedFrames,
            &s.dials,
            &s.reconnects,
            &s.dialFailures,
            &s.accepted,
            &s.connectionsLost}) {
        sum[i++] += n->load(std::memory_order_relaxed);
      }
    }
    auto& oldest = oldestMs[peer->info.name_];
    auto it = inFlight.find(peer.get());
    if (it != inFlight.end()) {
      sum.back() += it->second.count;
      // (At least 1 ms while a call is in flight: 0 says none is.)
      oldest = std::max<int64_t>(
          {oldest,
           1,
           std::chrono::duration_cast<std::chrono::milliseconds>(
               now - it->second.oldest)
               .count()});
    }
  }
  for (const auto& [name, sum] : byName) {
    for (size_t i = 0; i < sum.size(); ++i) {
      m["rpc_ext.peer." + name + "." + kCounters[i]] = std::to_string(sum[i]);
    }
    m["rpc_ext.peer." + name + ".oldest_call_ms"] =
        std::to_string(oldestMs[name]);
  }
  group_.addMetrics(m);
  rrefs_.addMetrics(m);
  return m;
}

std::unordered_map<std::string, std::string> Agent::getDebugInfo() {
  auto m = getMetrics();
  connections_.addDebugInfo(m);
  m["rpc_ext.pending_calls"] = std::to_string(calls_.pending());
  return m;
}

} // namespace torch_rpc_ext
