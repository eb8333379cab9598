// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Who is in the group (docs/elastic.md): the peers an agent knows, the view
// of the current members that its threads read without locks, and the
// membership log of a dynamic group, kept in the c10d store.
//
// A static group (init_rpc with world_size) has one view for its whole life,
// built at rendezvous. A dynamic group (world_size=None) is a log of records
// appended to the store with compare-and-set, "log/1", "log/2", ...: joins,
// leaves and deaths. Every member applies the same records in the same order
// with the same rules (Roster), so all reach the same membership at the same
// epoch (the number of the last record applied) with no coordinator: no rank
// is special, and nothing is ever locked (a member that dies mid-join holds
// nothing; its lease runs out and it is declared dead like any other).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/peer_stats.h"

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

// How we reach a worker: the first transport of our preference order that it
// offers in the same domain (Transport::domainDescriptor()).
struct Route {
  std::string transport;
  std::string address;
  // The peer's channels: name -> domain descriptor.
  std::map<std::string, std::string> channels;
  // Why no transport of ours reaches it (then `transport` is empty): calls
  // to it fail with this.
  std::string unreachable;
  // Our responses' device map to it: the reverse of its map to us. A
  // dynamic group's from its join record (dynamic_devices.h), a static
  // group's from the options (exchanged before the agent existed).
  rpc::DeviceMap reverseDeviceMap;
};

// One holder of a name and rank, for as long as it holds them. A worker that
// leaves and one that later takes its name and rank are two Peers with
// different incarnations. Peers are never destroyed while the agent lives
// (the WorkerInfo references handed out stay valid, and raw pointers to
// them are held by calls in flight); what each keeps is small: its
// statistics are its name's.
struct Peer {
  Peer(
      rpc::WorkerInfo info,
      uint64_t incarnation,
      Route route,
      std::shared_ptr<PeerStats> nameStats)
      : info(std::move(info)),
        incarnation(incarnation),
        route(std::move(route)),
        statsOfName(std::move(nameStats)),
        stats(*statsOfName) {}

  const rpc::WorkerInfo info;
  // Random per join; 0 in static groups.
  const uint64_t incarnation;
  const Route route;
  // Statistics, counted wherever the peer is in hand (const or not): one
  // object per name, shared by every holder of it, as metrics report them
  // (rpc_ext.peer.<name>.*). Per holder, a long job with churn kept about
  // 8 KiB of call-cost histograms for every worker that ever joined.
  const std::shared_ptr<PeerStats> statsOfName;
  PeerStats& stats;
  // Whether we ever dialed this holder (a later dial is a reconnect).
  mutable std::atomic<bool> dialed{false};

  // Set once, when the membership log says it left or died (`dead`).
  void depart(std::string why, bool dead) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!gone_.load(std::memory_order_relaxed)) {
      departure_ = std::move(why);
      dead_.store(dead, std::memory_order_relaxed);
      gone_.store(true, std::memory_order_release);
    }
  }
  bool departed() const {
    return gone_.load(std::memory_order_acquire);
  }
  // Departed, declared dead: nothing sent to it arrives any more (one that
  // left may still be finishing the calls it serves, and read our answers).
  bool declaredDead() const {
    return departed() && dead_.load(std::memory_order_relaxed);
  }
  // "worker1 left the group at epoch 7", or "" while it is a member.
  std::string departure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return departure_;
  }

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> gone_{false};
  std::atomic<bool> dead_{false}; // written before gone_
  std::string departure_;
};

// The members at one epoch. Immutable once published: the agent swaps whole
// views (Group::view()), so a thread that loaded one reads it without locks.
struct View {
  int64_t epoch = 0;
  std::vector<std::shared_ptr<Peer>> byId; // nullptr: no member holds the id
  std::unordered_map<std::string, std::shared_ptr<Peer>> byName;

  Peer* find(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < byId.size()
        ? byId[static_cast<size_t>(id)].get()
        : nullptr;
  }
  std::vector<rpc::WorkerInfo> infos() const;
};

// ---- The membership log of a dynamic group --------------------------------

// What a log of proven records says it is (MembershipLog::claimFormat). 2:
// since session 110 a group given a passphrase keeps its log under its
// epoch, as every dynamic group does (1 kept it at the root).
constexpr const char* kLogFormat = "torch_rpc_ext proven records 2";

// Epochs between snapshots of the roster (MembershipLog::writeSnapshot).
constexpr int64_t kSnapshotEvery = 64;

// How many leases a member that still answers may go without renewing its
// own before it is declared dead all the same (by a member that reaches it
// on the transport, or a joiner whose listener probe it answers).
constexpr int kMaxLeaseProbing = 3;

// A member as the log knows it.
struct Member {
  int32_t rank = -1;
  std::string name;
  uint64_t incarnation = 0;
  // How long its lease may go unrenewed before it is declared dead: its own
  // heartbeat timeout, so each member is judged by the period it renews at.
  int64_t leaseMs = 0;
  // Its rendezvous entry after the name line: one line per transport it
  // listens on and per channel it offers (Connections::open()).
  std::string offers;
};

// What one record did to the membership.
struct MembershipEvent {
  enum class Kind { kJoin, kLeave, kDead, kIgnored };
  Kind kind = Kind::kIgnored;
  int64_t epoch = 0;
  Member member;
  // kDead: why it was declared dead; kIgnored: why the record changed
  // nothing (a join for a name or rank already held, a second leave, a
  // record no version of us wrote).
  std::string reason;
};

const char* eventKindName(MembershipEvent::Kind kind);

// Records, as written to the store. Text, one header line then the body:
//   join <incarnation> <rank> <name> <lease ms>\n<offers>
//   leave <incarnation>
//   dead <incarnation> <reporter incarnation> <reason>
std::string joinRecord(const Member& m);
std::string leaveRecord(uint64_t incarnation);
std::string deadRecord(
    uint64_t incarnation,
    uint64_t reporter,
    const std::string& reason);

// The membership at an epoch: a pure function of log records 1..epoch.
class Roster {
 public:
  // Apply the record at epoch() + 1. Garbage is ignored with a reason (the
  // store is shared with whoever knows it; no record can make us crash).
  MembershipEvent apply(const std::string& record);
  // Pass over the record at epoch() + 1, ignored for `why` (one that does
  // not carry the group's proof: MembershipLog).
  MembershipEvent skip(std::string why);

  int64_t epoch() const {
    return epoch_;
  }
  const std::map<int32_t, Member>& members() const {
    return members_;
  }
  const Member* byRank(int32_t rank) const;
  const Member* byName(const std::string& name) const;
  const Member* byIncarnation(uint64_t incarnation) const;
  // Why a joiner `name` publishing `offer` conflicts with a member's device
  // maps ("" if it does not): checked against the members its maps name and
  // those whose maps name it, each offer parsed once (before session 93
  // every member's offers were parsed again for every join: O(N^2) parses
  // to restore a snapshot of N).
  std::string mapConflict(const std::string& name, const DeviceOffer& offer)
      const;

  // The members as one text (their join records, in rank order), and back:
  // a joiner starts from the newest snapshot, not from epoch 1.
  std::string snapshot() const;
  // This roster becomes `text`'s at `epoch`; false (nothing changed) if
  // `text` is not a snapshot.
  bool restore(int64_t epoch, const std::string& text);

 private:
  void add(const Member& m, DeviceOffer offer);
  void remove(int32_t rank);

  int64_t epoch_ = 0;
  std::map<int32_t, Member> members_; // by rank
  std::unordered_map<std::string, int32_t> rankByName_;
  std::unordered_map<uint64_t, int32_t> rankByIncarnation_;
  std::map<int32_t, DeviceOffer> offers_; // members that publish devices
  std::unordered_map<std::string, std::set<int32_t>> mappedBy_;
};

// A record as the log holds it: what Roster::apply reads, and whether it
// carries the group's proof.
struct LogRecord {
  std::string body;
  bool proven = false;
  // Over the bound (kMaxRecordBytes, or a snapshot's): its size, and no
  // body (not ours, and not worth hashing).
  size_t oversized = 0;
};

// The most a record's body holds. Names are WorkerInfo's (at most 128
// characters of [A-Za-z0-9_:-]); the offers a short line per device-map
// target. Anything longer is not ours.
constexpr size_t kMaxRecordBytes = 64 * 1024;

// The log's keys in the group's store (a PrefixStore the backend makes:
// torch_rpc_ext/elastic/<group>/): "log/<epoch>", each member's lease
// "beat/<incarnation>" (a counter it bumps) and acknowledgement
// "ack/<incarnation>" (the last epoch it applied).
//
// Records and snapshots carry the group's proof: a first line
// "proof <HMAC-SHA256, hex>" over their key ("log/7") and body, under a key
// drawn from the group's secret. Anyone can write the store; without the
// secret, nobody can write a record the members apply, and a member's
// record copied to another epoch proves nothing there (docs/security.md).
class MembershipLog {
 public:
  // `secret`: the group's. Empty: records are written bare and read
  // unproven (SecretExchange reads the log before it holds the secret, to
  // see who is alive; tests write forged records so). `prefix`: before
  // every key but the generations' ("e3/": a group that made its own
  // secret keeps one log per secret, SecretExchange::logPrefix()).
  explicit MembershipLog(
      c10::intrusive_ptr<::c10d::Store> store,
      const std::string& secret = "",
      std::string prefix = "");

  // The record at `epoch`, if it has been written: proven if its proof is
  // the group's for that epoch (never, without a secret).
  std::optional<LogRecord> read(int64_t epoch) const;
  // Append `record` at the first free epoch after `after`; returns that
  // epoch. Records that others appended in between are left for the caller
  // to read and apply.
  int64_t append(const std::string& record, int64_t after) const;

  // The log's format, claimed for ours (kLogFormat) if the log is new: what
  // it holds, or "" for a log an earlier version wrote (bare records, no
  // format). A joiner refuses a log of another format.
  std::string claimFormat() const;
  // How many times `rank` has been taken in this group, counting this one.
  int64_t nextGeneration(int32_t rank) const;
  // Renew our lease: our counter, one up, with its proof (only our
  // incarnation beats through this log).
  void beat(uint64_t incarnation) const;
  // A member's lease counter (0 before its first beat, and where it is not
  // proven, with a secret: a writer's bump renews nothing). A lease is
  // renewed when this grows: a writer can replay an older count, not a
  // higher one.
  int64_t beats(uint64_t incarnation) const;
  // Acknowledge that we applied `epoch` (with its proof).
  void ack(uint64_t incarnation, int64_t epoch) const;
  // The last epoch `incarnation` acknowledged (0: none, or not proven).
  int64_t acked(uint64_t incarnation) const;
  // Remove a departed member's lease and acknowledgement keys.
  void forget(uint64_t incarnation) const;
  // Snapshots of the roster ("snap/<epoch>", the newest epoch in
  // "snap/latest"), written every `snapshotEvery()` epochs by the members
  // that reach one (the same text for an epoch: whoever writes first wins).
  void writeSnapshot(int64_t epoch, const std::string& text) const;
  // The newest snapshot's epoch and text, or epoch 0 (also where it is not
  // proven, with a secret: the log is then read from its first record).
  std::pair<int64_t, std::string> latestSnapshot() const;
  // kSnapshotEvery, or TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY.
  static int64_t snapshotEvery();

 private:
  // A key's value without waiting for it: nullopt if there is no such key.
  std::optional<std::string> peek(const std::string& key) const;
  // A counter stored as decimal text with its proof (as beat() and ack()
  // write them); 0 if absent, not a number, or, read with a secret, not
  // proven.
  int64_t readNumber(const std::string& key) const;
  // `body` as stored at `key`: with its proof, given a secret.
  std::string seal(const std::string& key, const std::string& body) const;
  // What is stored at `key`: its body (without a proof line) and whether
  // the proof is ours; nothing, unproven, past `maxBody` bytes.
  LogRecord open(
      const std::string& key,
      const std::string& stored,
      size_t maxBody) const;

  c10::intrusive_ptr<::c10d::Store> store_;
  const std::string prefix_;
  std::string proofKey_; // drawn from the secret; empty without one
  mutable std::atomic<int64_t> beatsSent_{0}; // beat(): our lease counter
};

std::string incarnationText(uint64_t incarnation);
// "1.5 s", for errors and records.
std::string secondsText(std::chrono::milliseconds ms);

} // namespace torch_rpc_ext
