// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include "csrc/agent/call_table.h"
#include "csrc/agent/membership.h"
#include "csrc/agent/options.h"
#include "csrc/agent/peer_stats.h"
#include "csrc/agent/remote_profiling.h"
#include "csrc/common/buffer_pool.h"
#include "csrc/common/thread_pool.h"
#include "csrc/transport/transport.h"
#include "csrc/wire/codec.h"

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

// A random nonzero incarnation (membership.h).
uint64_t drawIncarnation();

// The torch_rpc_ext RpcAgent.
//
// Threads (docs/architecture.md):
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
//  - send() runs on the caller's thread (often with the GIL held) and never
//    blocks on anything that needs the GIL.
class Agent final : public rpc::RpcAgent,
                    public std::enable_shared_from_this<Agent>,
                    private transport::ConnectionObserver {
 public:
  // Rendezvous through `store`: share the group secret, publish this
  // worker's name and address, learn everyone else's. Blocks until all
  // `worldSize` workers have published. Throws on duplicate names.
  // worldSize 0: join the dynamic group whose membership log is in `store`
  // (elastic.cpp); returns once every member knows us.
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
  const rpc::WorkerInfo& getWorkerInfo(
      const std::string& workerName) const override;
  const rpc::WorkerInfo& getWorkerInfo(rpc::worker_id_t id) const override;
  std::vector<rpc::WorkerInfo> getWorkerInfos() const override;

  void join(bool shutdown = false, float timeout = 0) override;
  void sync() override {}
  void startImpl() override;
  void shutdownImpl() override;

  const std::vector<c10::Device>& getDevices() const override {
    return options_.devices;
  }
  rpc::DeviceMap getDeviceMap(const rpc::WorkerInfo& dst) const override;

  std::unordered_map<std::string, std::string> getMetrics() override;
  std::unordered_map<std::string, std::string> getDebugInfo() override;

  // The address peers on other hosts connect to, e.g. "10.0.0.5:41231" (the
  // first transport's address when none crosses hosts).
  const std::string& address() const {
    return address_;
  }
  const AgentOptions& options() const {
    return options_;
  }

  // ---- Membership, as the program sees it (docs/elastic.md) ----
  bool isDynamic() const {
    return worldSize_ == 0;
  }
  // Ours: random per join; 0 in a static group.
  uint64_t incarnation() const {
    return incarnation_;
  }
  // The current members (with their incarnations) and the epoch.
  std::shared_ptr<const View> currentView() const {
    return view();
  }
  // Stop applying the membership log (recording our leave if not done):
  // before torch tears down its RRef state at shutdown.
  void stopMembership();
  // Membership changes applied since our join and not taken yet, in epoch
  // order, waiting up to `timeout` for one; nullopt once the agent is shut
  // down. (torch_rpc_ext/elastic.py turns them into callbacks.)
  std::optional<std::vector<MembershipEvent>> takeMembershipEvents(
      std::chrono::milliseconds timeout);

 private:
  Agent(
      const c10::intrusive_ptr<::c10d::Store>& store,
      std::string name,
      int rank,
      int worldSize,
      AgentOptions options);

  void rendezvous();
  void addGilWaitTime(std::chrono::microseconds gilWaitTime) override;

  // ConnectionObserver: loop thread.
  void onReady(const std::shared_ptr<transport::Connection>& conn) override;
  frame::InboundBuffers onFrameHead(
      transport::Connection& conn,
      const std::string& head,
      const std::vector<uint64_t>& segmentSizes,
      const std::vector<bool>& provided) override;
  void onFrame(
      const std::shared_ptr<transport::Connection>& conn,
      std::string head,
      frame::InboundBuffers buffers) override;
  void onClosed(transport::Connection& conn, const std::string& reason)
      override;

  std::shared_ptr<transport::Connection> connectionTo(const Peer& peer);
  // Pool thread: run the request (its CUDA tensors ready on `streams`, one
  // per device of ours) and arrange for its response.
  void serveRequest(
      std::shared_ptr<transport::Connection> conn,
      c10::intrusive_ptr<rpc::Message> request,
      std::vector<c10::Stream> streams);
  // A stream from the pool for each of our devices, for an arriving message
  // (empty without devices).
  std::vector<c10::Stream> arrivalStreams() const;
  // The CUDA channels' own device memory (channel/cuda/device_memory.h):
  // bounded by cuda_ipc_memory_limit, and out of memory once, torch's
  // caching allocator frees its cache before they try again.
  void useTorchForChannelMemory();
  // A message's CUDA segments of one device (the channel's memory), copied
  // on its arrival `stream` into memory of torch's CUDA allocator allocated
  // on that stream (wire::InboundMessage::DeviceLanding), so that received
  // tensors follow torch's stream rules: record_stream and a future's
  // wait() on another stream keep the memory from reuse until that
  // stream's work is done. Not used under cuda_zero_copy.
  std::vector<c10::DataPtr> landOnDevice(
      const c10::Stream& stream,
      const std::vector<std::pair<uintptr_t, size_t>>& spans);
  // Tell the caching allocator that `message`'s CUDA storages are read on
  // the current streams of their devices (by the channels' copies).
  static void recordCudaUse(const rpc::Message& message);
  // How CUDA tensors to `peer` travel under `map`.
  wire::DeviceRoute routeTo(const Peer& peer, const rpc::DeviceMap& map) const;
  void sendResponse(transport::Connection& conn, int64_t id, JitFuture& result);
  // The channels a connection to `peerId` uses: ours (in our order of
  // preference) that the peer offers in the same domain and the connection
  // can host. Both ends compute the same set.
  std::vector<channel::Offer> channelsFor(
      int32_t peerId,
      bool hostPassesDescriptors) const;
  // One barrier of join(): publish `value`, wait for every worker's (failing
  // with the names of the missing, or of an unreachable one, rather than
  // waiting forever), return the sum.
  int64_t joinRound(
      int64_t value,
      std::optional<std::chrono::steady_clock::time_point> deadline,
      float timeout);
  // The last barrier of a graceful shutdown, which nobody must outlive
  // while others still use the store: see rendezvous.cpp.
  void leaveRound(
      std::optional<std::chrono::steady_clock::time_point> deadline,
      float timeout);
  // Write a registered call's frame; fail the call if the connection is gone.
  void writeRequest(
      const std::shared_ptr<transport::Connection>& conn,
      frame::OutboundFrame frame,
      int64_t id,
      Peer& peer);
  Route chooseRoute(const std::string& peerName, const std::string& offers)
      const;
  // Complete a client call on `conn`'s loop thread, after its read pass.
  // `lastInFlight`: no other call of ours is waiting for a response.
  void settle(
      transport::Connection& conn,
      CallTable::Call call,
      c10::intrusive_ptr<rpc::Message> response,
      bool lastInFlight);
  void settleWithError(CallTable::Call call, std::string error);
  // Complete a client call's future with its response (or the error the
  // response carries).
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

  const c10::intrusive_ptr<::c10d::Store> store_;
  const int worldSize_; // 0: a dynamic group
  const AgentOptions options_;
  std::string secret_;
  std::string address_;

  // ---- Membership (membership.h) ----
  // The current members. Loaded per call (one shared_ptr copy);
  // replaced whole by the membership watcher of a dynamic group.
  std::shared_ptr<const View> view() const {
    std::lock_guard<std::mutex> lock(viewMutex_);
    return view_;
  }
  void publish(std::shared_ptr<const View> view);
  // The member holding the id `conn` is authenticated as, if any. (A dead
  // holder's connections are closed as it is declared dead; one that left
  // closes its own once its last responses are out.)
  Peer* memberOn(const transport::Connection& conn) const;
  // The current holder of `id` (no copy of the view: the per-call and
  // per-frame lookups), or null.
  Peer* peerById(int64_t id) const;
  // Every peer ever seen by name (the newest holder of each name), for
  // errors and metrics.
  std::shared_ptr<Peer> lastPeerNamed(const std::string& name) const;
  // Our rendezvous entry: the name line, then a line per transport we
  // listen on and per channel we offer. Starts the transports.
  std::string openTransports();
  std::shared_ptr<Peer> adopt(
      rpc::WorkerInfo info,
      uint64_t incarnation,
      Route route);
  // ---- Dynamic groups (elastic.cpp) ----
  void joinGroup(const std::string& entry);
  void watchMembership();
  // Apply what the log holds past our roster; true if anything changed.
  bool catchUp();
  void applyEvent(const MembershipEvent& ev);
  void checkLeases();
  // Acknowledge the epoch applied, if not yet (rosterMutex_ held).
  void ackApplied();
  // As the owner: drop the forks a departed peer held (torch_private.h).
  void releaseForksOf(const Peer& peer);
  void leaveGroup(
      std::optional<std::chrono::steady_clock::time_point> deadline);
  // Wait until every member of the current view other than us has
  // acknowledged `epoch` (or departed); false at `deadline`.
  bool awaitAcks(
      int64_t epoch,
      std::chrono::steady_clock::time_point deadline,
      std::vector<std::string>* missing);
  void stopWatcher();
  // How long a member's lease may go unrenewed before it is declared dead:
  // the heartbeat timeout (its default when heartbeats are off).
  std::chrono::milliseconds leaseTimeout() const;
  // Why a peer authenticated as `id` with `incarnation` may not stay ("" if
  // it may): it must be the current holder of the id.
  std::string admissionError(int32_t id, uint64_t incarnation) const;

  // (A mutex, not std::atomic<std::shared_ptr>: libstdc++ 12's has had
  // races; an uncontended lock costs about as much.)
  mutable std::mutex viewMutex_;
  std::shared_ptr<const View> view_;
  mutable std::mutex peersMutex_;
  std::vector<std::shared_ptr<Peer>> peers_; // every peer ever seen
  uint64_t incarnation_ = 0; // ours; 0 in a static group
  std::unique_ptr<MembershipLog> log_;
  std::mutex rosterMutex_; // roster_, the watcher's state
  Roster roster_;
  int64_t ackedEpoch_ = 0;
  // The snapshot we started from (0: epoch 1), and the last one we wrote.
  std::atomic<int64_t> startEpoch_{0};
  int64_t snapshotWritten_ = 0;
  struct Lease {
    int64_t beats = -1;
    std::chrono::steady_clock::time_point changed;
    bool probing = false; // a connection was opened to see if it lives
    // When it was first found stale (and kept only because it answered a
    // probe): a member reachable but renewing nothing for kMaxLeaseProbing
    // leases (its watcher lost the store, say) is declared dead anyway.
    std::optional<std::chrono::steady_clock::time_point> staleSince;
  };
  // Whether a member whose lease lapsed answers on the transport.
  bool reachable(const Member& m);
  // Joining: wait until `held` (holding our rank or name) is gone: it
  // leaves, or its lease lapses and we declare it dead (leases.cpp);
  // throws if it is alive, or at `deadline` (which the wait may extend).
  void awaitHolderGone(
      Member held,
      const Member& me,
      std::chrono::steady_clock::time_point& deadline,
      std::unique_lock<std::mutex>& lock);
  // Whether `m`'s listener on a transport we share accepts a connection.
  bool listenerAnswers(const Member& m, std::chrono::milliseconds within);
  std::unordered_map<uint64_t, Lease> leases_; // by incarnation
  std::chrono::steady_clock::time_point nextBeat_, nextLeaseCheck_;
  std::thread watcher_;
  std::mutex watcherMutex_;
  std::condition_variable watcherCv_;
  bool watcherStop_ = false;
  // Set when the log says we were declared dead: every send fails.
  std::atomic<bool> fenced_{false};
  std::string fencedReason_;
  std::atomic<bool> left_{false};
  std::string joinRefusal_; // why the log ignored our join record
  std::mutex eventsMutex_;
  std::condition_variable eventsCv_;
  std::deque<MembershipEvent> events_;
  bool reportEvents_ = false; // from our join to our leave or death
  // Whether torch's RRef state may be touched (started, not torn down).
  std::atomic<bool> rrefsLive_{false};
  // The holders of forks of our RRefs whose ids do not name them
  // (fork_holders.cpp): those registered by a fork request, by the worker
  // that sent it, and those we forked ourselves, by the peer the message
  // that carried them went to. Dynamic groups only.
  std::mutex forkHoldersMutex_;
  std::unordered_map<rpc::ForkId, rpc::worker_id_t, rpc::ForkId::Hash>
      forkHolders_;
  void trackForks(const rpc::Message& request, int32_t from);
  void trackOwnForks(const rpc::Message& message, int32_t to);
  // Requests naming an RRef a departed member owned (a fetch, fork or
  // deletion, sent to a later holder of its id): a completed future (an
  // error; a deletion succeeds), or null for any other message.
  c10::intrusive_ptr<JitFuture> refuseStaleRRefUse(
      const rpc::WorkerInfo& to,
      const rpc::Message& message);
  std::mutex staleRRefsMutex_;
  std::unordered_map<rpc::RRefId, std::string, rpc::RRefId::Hash> staleRRefs_;
  std::atomic<bool> hasStaleRRefs_{false};
  std::atomic<uint64_t> droppedForks_{0};
  std::atomic<uint64_t> droppedAutogradContexts_{0};
  bool eventsClosed_ = false;
  // Accepted connections by peer id (outbound_ holds ours), so a departing
  // peer's connections are closed as it departs.
  std::unordered_multimap<int32_t, std::weak_ptr<transport::Connection>>
      inbound_;

  std::map<std::string, std::shared_ptr<transport::Transport>> transports_;
  // Our viable channels, in order of preference (rendezvous()).
  std::vector<std::shared_ptr<channel::Context>> channels_;
  std::vector<std::shared_ptr<transport::Listener>> listeners_;
  std::map<std::string, std::string> listenAddresses_; // by transport
  std::mutex connMutex_;
  std::unordered_map<const Peer*, std::shared_ptr<transport::Connection>>
      outbound_;

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
  std::atomic<int64_t> nextId_{0};
  std::atomic<uint64_t> rejectedConnections_{0};
  std::atomic<uint64_t> lateResponses_{0};
  // CUDA segments copied into torch's allocator on arrival, and their bytes.
  std::atomic<uint64_t> cudaLandings_{0}; // launches (one per device)
  std::atomic<uint64_t> cudaLanded_{0};
  std::atomic<uint64_t> cudaLandedBytes_{0};

  // Join bookkeeping (as TensorPipe: only client calls are counted, since
  // every server call is some worker's client call).
  std::mutex callCountMutex_;
  std::condition_variable callCountCv_;
  int64_t clientActiveCalls_ = 0;
  int64_t joinRounds_ = 0; // join barriers passed (same on every worker)
  std::atomic<int64_t> serverActiveCalls_{0};
  std::atomic<int64_t> serverActiveAsyncCalls_{0};
  std::atomic<bool> shuttingDown_{false};
  std::atomic<bool> shutdownDone_{false};

  std::atomic<int64_t> gilWaitTotalUs_{0};
  std::atomic<int64_t> gilWaitCount_{0};
};

} // namespace torch_rpc_ext
