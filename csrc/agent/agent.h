// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The torch_rpc_ext RpcAgent: the facade torch sees (docs/architecture.md).
// It sends, serves and settles calls, and assembles join, shutdown, metrics
// and debug info from its parts, each of which owns its own state and locks:
//  - Group (group.h): who the members are and how that changes;
//  - Connections (connections.h): transports, channels, a connection per
//    peer, what arrives on them;
//  - RRefGuard (rref_guard.h): what departed members leave in torch's RRef
//    and autograd state;
//  - AgentDevices (devices.h): devices, maps, streams, CUDA landings;
//  - CallTable (call_table.h): client calls in flight and their timeouts.
// Files: agent.cpp (life cycle, join, the parts' glue, metrics),
// agent_calls.cpp (the client side: send, responses, settling),
// serving.cpp (the server side: requests served, responses written).
//
// Threads:
//  - the transport's loop thread reads frames and decodes them into
//    Messages (no Python, no GIL); after each read pass, the same thread
//    serves the requests (ServeCallback, which may take the GIL) and
//    completes the futures of lone calls (whose callbacks may take the GIL);
//    other calls' futures are completed on the completion thread. Work that
//    stalls makes the loop hand itself to a new thread (stream/loop.h), so the
//    reads never wait on user code for more than a few milliseconds;
//  - the pool settles failures (timeouts, lost connections) and runs what
//    fault injection delays;
//  - the CallTable thread expires timed-out calls;
//  - the Group's watcher thread applies a dynamic group's log;
//  - send() runs on the caller's thread (often with the GIL held) and never
//    blocks on anything that needs the GIL.
// The agent's own lock is callCountMutex_ (clientActiveCalls_, for join);
// the rest of its state is atomic or set before start.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include "csrc/agent/call_table.h"
#include "csrc/agent/connections.h"
#include "csrc/agent/devices.h"
#include "csrc/agent/group.h"
#include "csrc/agent/options.h"
#include "csrc/agent/remote_profiling.h"
#include "csrc/agent/rref_guard.h"
#include "csrc/common/buffer_pool.h"
#include "csrc/common/thread_pool.h"

namespace torch_rpc_ext {

class Agent final : public rpc::RpcAgent,
                    public std::enable_shared_from_this<Agent>,
                    private GroupListener,
                    private FrameSink {
 public:
  // Rendezvous through `store` (Group::join): blocks until the group knows
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
  // ---- Membership, as the program sees it (docs/elastic.md) ----
  bool isDynamic() const {
    return group_.isDynamic();
  }
  uint64_t incarnation() const {
    return group_.incarnation();
  }
  std::shared_ptr<const View> currentView() const {
    return group_.view();
  }
  // Before torch tears down its RRef state at shutdown.
  void stopMembership();
  std::optional<std::vector<MembershipEvent>> takeMembershipEvents(
      std::chrono::milliseconds timeout) {
    return group_.takeEvents(timeout);
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

  // GroupListener (group.h): the watcher thread, joining and leaving.
  Route routeFor(const std::string& name, const std::string& offers) override;
  Probe probe(const Peer& peer) override;
  std::vector<std::string> whyUnreachable(
      const std::vector<const Peer*>& peers,
      std::chrono::milliseconds within) override;
  bool listenerAnswers(
      const std::string& name,
      const std::string& offers,
      std::chrono::milliseconds within) override;
  void onDeparted(const Peer& peer, bool dead) override;
  void onFenced(const std::string& reason) override;
  void reserveIds(int32_t rank, int64_t generation) override;
  int64_t callsBeingServed() override;

  // FrameSink (connections.h): loop threads (agent_calls.cpp).
  frame::InboundBuffers onFrameHead(
      transport::Connection& conn,
      const std::string& head,
      const std::vector<uint64_t>& segmentSizes,
      const std::vector<bool>& provided) override;
  void onFrame(
      const std::shared_ptr<transport::Connection>& conn,
      std::string head,
      frame::InboundBuffers buffers) override;
  void onConnectionClosed(transport::Connection& conn, const std::string& reason)
      override;

  // ---- The client side (agent_calls.cpp) ----
  // Write a registered call's frame; fail the call if the connection is gone.
  void writeRequest(
      const std::shared_ptr<transport::Connection>& conn,
      frame::OutboundFrame frame,
      int64_t id,
      Peer& peer);
  // Complete a client call on `conn`'s loop thread, after its read pass.
  // `lastInFlight`: no other call of ours is waiting for a response.
  void settle(
      transport::Connection& conn,
      CallTable::Call call,
      c10::intrusive_ptr<rpc::Message> response,
      bool lastInFlight);
  void settleWithError(CallTable::Call call, std::string error);
  // Complete a client call's future with its response (or its error).
  void complete(
      CallTable::Call& call,
      c10::intrusive_ptr<rpc::Message> response);
  void callFinished();
  // callFinished() at the end of a scope, however it ends.
  struct CallFinished {
    explicit CallFinished(Agent& agent) : agent(agent) {}
    ~CallFinished() {
      agent.callFinished();
    }
    Agent& agent;
  };

  // ---- The server side (serving.cpp) ----
  // Pool thread: run the request (its CUDA tensors ready on `streams`, one
  // per device of ours) and arrange for its response.
  void serveRequest(
      std::shared_ptr<transport::Connection> conn,
      c10::intrusive_ptr<rpc::Message> request,
      std::vector<c10::Stream> streams);
  void sendResponse(transport::Connection& conn, int64_t id, JitFuture& result);

  const int worldSize_; // 0: a dynamic group
  const AgentOptions options_;
  ThreadPool pool_;
  // Completes the futures of calls that were not alone in flight, in order,
  // on one thread; a completion that blocks (a callback waiting on another
  // call) gets another thread after 20 ms, as in pool_.
  ThreadPool completions_;
  std::unique_ptr<FaultInjector> faults_; // tests only
  // Remote work in the caller's torch.profiler trace.
  RemoteProfiling profiling_;
  // Receive buffers for large tensors; storages keep it alive past us.
  std::shared_ptr<BufferPool> buffers_;
  CallTable calls_;
  AgentDevices devices_;
  RRefGuard rrefs_;
  Group group_;
  Connections connections_;

  std::atomic<int64_t> nextId_{0};
  std::atomic<uint64_t> lateResponses_{0};
  // Join bookkeeping (as TensorPipe: only client calls are counted, since
  // every server call is some worker's client call).
  std::mutex callCountMutex_;
  std::condition_variable callCountCv_;
  int64_t clientActiveCalls_ = 0;
  std::atomic<int64_t> serverActiveCalls_{0};
  std::atomic<int64_t> serverActiveAsyncCalls_{0};
  std::atomic<bool> shuttingDown_{false};
  std::atomic<bool> shutdownDone_{false};
  std::atomic<int64_t> gilWaitTotalUs_{0};
  std::atomic<int64_t> gilWaitCount_{0};
};

} // namespace torch_rpc_ext
