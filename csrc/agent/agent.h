// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The torch_rpc_ext RpcAgent: the facade torch sees (docs/architecture.md,
// "The agent"). It sends and dispatches what arrives, and assembles join,
// shutdown, metrics and debug info from its parts, each of which owns its
// state and locks and has a header saying which threads call it:
//   Group (group.h)              who the members are and how that changes
//   Connections (connections.h)  transports, channels, a connection per peer
//   Calls (calls.h)              client calls in flight, settled once each
//   Server (server.h)            requests served, responses written
//   RRefGuard (rref_guard.h)     what departed members leave in torch's state
//   AgentDevices (devices.h)     devices, maps, streams, CUDA landings
// agent.cpp: life cycle, join, the parts' glue, metrics; agent_send.cpp:
// send() and what arrives.
//
// Threads: send() runs on the caller's thread (often with the GIL held) and
// never blocks on anything that needs the GIL; onFrameHead(), onFrame() and
// onConnectionClosed() on the transports' loop threads; the GroupListener
// calls on the group's watcher thread (and the threads joining or
// leaving); join() and shutdown on the program's. The agent's own state is
// set at construction or atomic: no lock of its own.

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include "csrc/agent/calls.h"
#include "csrc/agent/connections.h"
#include "csrc/agent/devices.h"
#include "csrc/agent/faults.h"
#include "csrc/agent/group.h"
#include "csrc/agent/options.h"
#include "csrc/agent/rref_guard.h"
#include "csrc/agent/server.h"
#include "csrc/common/buffer_pool.h"
#include "csrc/common/thread_pool.h"

namespace torch_rpc_ext {

class Agent final : public rpc::RpcAgent,
                    public std::enable_shared_from_this<Agent>,
                    private GroupListener,
                    private FrameSink {
 public:
  // Rendezvous through `store` (Group::join): returns once the group knows
  // us. worldSize 0: join the dynamic group whose log is in `store`.
  static std::shared_ptr<Agent> create(
      const c10::intrusive_ptr<::c10d::Store>& store,
      std::string name,
      int rank,
      int worldSize,
      AgentOptions options);
  ~Agent() override;

  c10::intrusive_ptr<JitFuture> send(
      const rpc::WorkerInfo& to,
      c10::intrusive_ptr<rpc::Message> message,
      const float rpcTimeoutSeconds = rpc::kUnsetRpcTimeout,
      const rpc::DeviceMap& deviceMap = {}) override;
  using rpc::RpcAgent::getWorkerInfo;
  const rpc::WorkerInfo& getWorkerInfo(const std::string& name) const override {
    return group_.worker(name);
  }
  const rpc::WorkerInfo& getWorkerInfo(rpc::worker_id_t id) const override {
    return group_.worker(id);
  }
  std::vector<rpc::WorkerInfo> getWorkerInfos() const override {
    return group_.view()->infos();
  }
  void join(bool shutdown = false, float timeout = 0) override;
  void sync() override {}
  void startImpl() override;
  void shutdownImpl() override;
  const std::vector<c10::Device>& getDevices() const override {
    return devices_.devices();
  }
  rpc::DeviceMap getDeviceMap(const rpc::WorkerInfo& dst) const override {
    return devices_.mapTo(dst.name_);
  }
  std::unordered_map<std::string, std::string> getMetrics() override;
  std::unordered_map<std::string, std::string> getDebugInfo() override;

  const std::string& address() const {
    return connections_.address();
  }
  const AgentOptions& options() const {
    return options_;
  }
  // Membership, as the program sees it (docs/elastic.md).
  const Group& group() const {
    return group_;
  }
  Group& group() {
    return group_;
  }
  // Before torch tears down its RRef state at shutdown.
  void stopMembership();

  // What the health endpoints report (torch_rpc_ext.metrics.health): why
  // this agent does not serve calls now ("" if it does), and each
  // transport's loop probed (Connections::probeLoops: microseconds, -1 for
  // one that did not run a task within `within`).
  struct Health {
    std::string notServing;
    std::vector<std::pair<std::string, int64_t>> loops;
  };
  Health health(std::chrono::milliseconds within) const;
  // The `limit` calls in flight sent first, oldest first, and how many are
  // in flight in all (torch_rpc_ext.metrics.calls_in_flight).
  std::pair<std::vector<CallTable::Pending>, size_t> oldestCalls(
      size_t limit) const {
    return calls_.oldest(limit);
  }
  // The `limit` requests served longest, oldest first, and how many are
  // being served in all (torch_rpc_ext.metrics.requests_being_served).
  std::pair<std::vector<ServingTable::Serving>, size_t> oldestServed(
      size_t limit) const {
    return server_.oldest(limit);
  }
  // Tests: a handler that blocks `transport`'s loop for `duration`.
  bool stallLoopForTesting(
      const std::string& transport,
      std::chrono::milliseconds duration) const {
    return connections_.stallLoopForTesting(transport, duration);
  }
  // Tests: the group's secret, what every handshake proves.
  const std::string& groupSecretForTesting() const {
    return group_.secret();
  }

 private:
  Agent(
      const c10::intrusive_ptr<::c10d::Store>& store,
      std::string name,
      int rank,
      int worldSize,
      AgentOptions options);
  void rendezvous();
  void addGilWaitTime(std::chrono::microseconds gilWaitTime) override;

  // GroupListener (group.h), FrameSink (connections.h).
  Route routeFor(const std::string& name, const std::string& offers) override;
  Probe probe(const Peer& peer) override;
  std::vector<std::string> whyUnreachable(
      const std::vector<const Peer*>& peers,
      std::chrono::milliseconds within,
      bool dial) override;
  bool listenerAnswers(
      const std::string& name,
      const std::string& offers,
      std::chrono::milliseconds within) override;
  void onDeparted(const Peer& peer, bool dead) override;
  void onFenced(const std::string& reason) override;
  void reserveIds(int32_t rank, int64_t generation) override;
  int64_t callsBeingServed() override;
  frame::InboundBuffers onFrameHead(
      transport::Connection& conn,
      const std::string& head,
      const std::vector<uint64_t>& segmentSizes,
      const std::vector<bool>& provided) override;
  void onFrame(
      const std::shared_ptr<transport::Connection>& conn,
      std::string head,
      frame::InboundBuffers buffers) override;
  void onConnectionClosed(
      transport::Connection& conn,
      const std::string& reason) override;
  // A request from `peer` (null: not in the group), which must be a
  // member: else closes `conn` and returns true.
  bool refuseFromNonMember(transport::Connection& conn, Peer* peer);
  // A message that arrived well formed but could not land here
  // (ReceiveFailure: devices.h): its call fails with `cause`, on both ends,
  // and the connection stays.
  void failReceive(
      const std::shared_ptr<transport::Connection>& conn,
      const wire::InboundMessage& in,
      Peer* peer,
      const std::string& cause);

  const AgentOptions options_;
  ThreadPool pool_;
  std::unique_ptr<FaultInjector> faults_; // tests only
  // Receive buffers for large tensors; storages keep it alive past us.
  std::shared_ptr<BufferPool> buffers_;
  Calls calls_;
  AgentDevices devices_;
  RRefGuard rrefs_;
  Group group_;
  Connections connections_;
  Server server_;
  std::atomic<bool> shuttingDown_{false};
  std::atomic<bool> shutdownDone_{false};
  std::atomic<int64_t> gilWaitTotalUs_{0};
  std::atomic<int64_t> gilWaitCount_{0};
};

} // namespace torch_rpc_ext
