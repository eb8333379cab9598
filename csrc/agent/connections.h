// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The agent's connections: the transports and channels it opened, its
// listeners, a connection per peer it calls (outbound) and those peers
// opened to it (inbound), and what arrives on them, handed to a FrameSink.
//
// Connections is the transports' ConnectionObserver: it admits an inbound
// connection only from the current holder of its id (the Group says who
// that is), keeps the maps, and passes frames and closes up.
//
// Threads and locks:
//  - open(), start(): the thread running init_rpc, before any traffic.
//  - connectionTo(): senders' threads, the join barrier, lease probes.
//  - onReady(), onFrameHead(), onFrame(), onClosed(): the transports' loop
//    threads (ConnectionObserver).
//  - dropPeer(), closeOutbound(): the membership watcher (or the thread
//    joining or leaving), under the group's roster lock.
//  - stop(), dropAll(): shutdown.
//  - probeLoops(): the metrics endpoint's threads (a health probe), at any
//    time after open(), shutdown included.
// connMutex_ guards outbound_, inbound_ and readyOutbound_. A connection is
// never closed under it when closing may report onClosed on this thread (which
// takes it). transports_, channels_, listeners_ and the addresses are written
// by open() only, before any other call; read without a lock after.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "csrc/agent/group.h"
#include "csrc/agent/membership.h"
#include "csrc/agent/options.h"
#include "csrc/common/thread_pool.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext {

// Where what arrives goes (the Agent): the loop threads call it.
class FrameSink {
 public:
  virtual ~FrameSink() = default;
  // ConnectionObserver's, as the transports call them (transport.h).
  virtual frame::InboundBuffers onFrameHead(
      transport::Connection& conn,
      const std::string& head,
      const std::vector<uint64_t>& segmentSizes,
      const std::vector<bool>& provided) = 0;
  virtual void onFrame(
      const std::shared_ptr<transport::Connection>& conn,
      std::string head,
      frame::InboundBuffers buffers) = 0;
  // `conn` closed (and is out of the maps): fail the calls it carried.
  virtual void onConnectionClosed(
      transport::Connection& conn,
      const std::string& reason) = 0;
};

// One line of a worker's offers (its rendezvous entry after the name
// line): "<transport> <domain descriptor> <address>", or
// "channel <name> <domain descriptor>" (name, domain, address: the three
// fields, whatever the line).
struct OfferLine {
  std::string name, domain, address;
};
std::vector<OfferLine> offerLines(const std::string& offers);

class Connections final : private transport::ConnectionObserver {
 public:
  // worldSize 0: a dynamic group. `group` says who the members are; `sink`
  // takes what arrives; `pool` drops what sent messages held, off the loop
  // threads. All outlive us.
  Connections(
      const AgentOptions& options,
      rpc::WorkerInfo self,
      int worldSize,
      const Group& group,
      FrameSink& sink,
      ThreadPool& pool);

  // Create the transports and channels the options list and listen on each
  // transport that is viable here (one that is not is left out with a
  // warning; one that cannot listen throws). Returns our rendezvous offers:
  // a line per transport ("\n<transport> <domain> <address>") and per
  // channel ("\nchannel <name> <domain>").
  std::string open(const std::string& secret, uint64_t incarnation);
  // Accept connections (torch has made us its agent).
  void start();
  // A graceful shutdown, the group idle: every connection's channels give
  // back what their peers hold of ours (cuda_ipc's blocks, which a peer must
  // close before we free them), waiting at most `within`.
  void settleChannels(std::chrono::milliseconds within);
  // Stop the transports: every connection closes (onClosed runs for each).
  void stop();
  // Forget the outbound connections (the end of shutdown).
  void dropAll();

  // The address peers on other hosts connect to, e.g. "10.0.0.5:41231"
  // (the first transport's address when none crosses hosts).
  const std::string& address() const {
    return address_;
  }
  // How we reach a worker offering `offers` (its rendezvous entry after the
  // name line): the first transport of our order it offers in our domain;
  // throws if none.
  Route routeFor(const std::string& name, const std::string& offers) const;
  // Our connection to `peer`, opened if there is none; throws if it departed
  // or no transport reaches it.
  std::shared_ptr<transport::Connection> connectionTo(const Peer& peer);
  // The channels a connection to `peerId` uses: ours (in our order of
  // preference) that the peer offers in the same domain and the connection
  // can host. Both ends compute the same set.
  std::vector<channel::Offer> channelsFor(
      int32_t peerId,
      bool hostPassesDescriptors) const;

  // ---- For the group (GroupListener) ----
  GroupListener::Probe probe(const Peer& peer);
  std::vector<std::string> whyUnreachable(
      const std::vector<const Peer*>& peers,
      std::chrono::milliseconds within,
      bool dial);
  // Also before open() (knockBeforeOpen).
  bool listenerAnswers(
      const std::string& name,
      const std::string& offers,
      std::chrono::milliseconds within);
  // `peer` departed: its connections leave the maps, closed now if it was
  // declared dead (a member that left closes its own once its last
  // responses are out).
  void dropPeer(const Peer& peer, bool closeNow);
  // We were declared dead: close every connection we opened.
  void closeOutbound(const std::string& reason);

  // ---- Health (Agent::health) ----
  // Each transport's loop asked, all at once, to run a task: how long each
  // took to (microseconds), or -1 where it did not within `within` (a
  // handler that blocks the loop: its peers' pings go unanswered too, and
  // they close its connections after heartbeat_timeout). By transport name;
  // a transport stopped (before the probe, or during it) is left out.
  std::vector<std::pair<std::string, int64_t>> probeLoops(
      std::chrono::milliseconds within) const;
  // Tests: a handler that blocks `transport`'s loop for `duration`. False
  // if there is no such transport, or it has stopped.
  bool stallLoopForTesting(
      const std::string& transport,
      std::chrono::milliseconds duration) const;

  // rpc_ext.<transport>.*, rpc_ext.channel.*, rejected connections
  // (get_metrics); addresses, channels, each member's route (get_debug_info).
  void addMetrics(std::unordered_map<std::string, std::string>& m) const;
  void addDebugInfo(std::unordered_map<std::string, std::string>& m) const;
  // How the connection to `peer` protects its bytes (get_debug_info's
  // rpc_ext.peer.<name>.security): TLS's description, or why there is none.
  std::string securityOf(const Peer& peer) const;

 private:
  // listenerAnswers before open(), through a transport made for the knock.
  bool knockBeforeOpen(
      const std::string& offers,
      std::chrono::milliseconds within) const;
  // ConnectionObserver: loop threads.
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
  // The member holding the id `conn` is authenticated as, if any.
  Peer* memberOn(const transport::Connection& conn) const;

  const AgentOptions& options_;
  const rpc::WorkerInfo self_;
  const int worldSize_; // 0: a dynamic group
  const Group& group_;
  FrameSink& sink_;
  ThreadPool& pool_;

  std::string address_;
  std::map<std::string, std::shared_ptr<transport::Transport>> transports_;
  // Our viable channels, in order of preference.
  std::vector<std::shared_ptr<channel::Context>> channels_;
  std::vector<std::shared_ptr<transport::Listener>> listeners_;
  std::map<std::string, std::string> listenAddresses_; // by transport

  mutable std::mutex connMutex_;
  std::unordered_map<const Peer*, std::shared_ptr<transport::Connection>>
      outbound_;
  // Accepted connections by peer id, so a departing peer's connections are
  // closed as it departs.
  std::unordered_multimap<int32_t, std::weak_ptr<transport::Connection>>
      inbound_;
  // Outbound connections that became ready and have not closed (identity
  // only): a close then is a loss, before then a failed dial.
  std::unordered_set<const transport::Connection*> readyOutbound_;
  std::atomic<uint64_t> rejectedConnections_{0};
  // Accepted connections closed before their first byte (knockOnly()):
  // counted, not refused, not logged.
  std::atomic<uint64_t> knocks_{0};
};

} // namespace torch_rpc_ext
