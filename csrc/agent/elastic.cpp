// SPDX-License-Identifier: BSD-3-Clause
// The agent in a dynamic group (init_rpc with world_size=None;
// docs/elastic.md): joining through the membership log, the watcher thread that
// applies the log and renews our lease (leases.cpp judges the others'), and
// leaving.
#include <algorithm>
#include <cstring>
#include <sstream>

#include <c10/util/StringUtil.h>

#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/distributed/rpc/rref_proto.h>
#include <torch/csrc/utils/pybind.h>

#include "csrc/agent/agent.h"
#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/torch_private.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

using Clock = std::chrono::steady_clock;

// The watcher looks at the log this often when it changes, backing off to
// kIdlePoll while it does not.
constexpr auto kBusyPoll = std::chrono::milliseconds(20);
constexpr auto kIdlePoll = std::chrono::milliseconds(200);

} // namespace

uint64_t drawIncarnation() {
  uint64_t inc = 0;
  while (inc == 0) {
    std::string bytes = randomBytes(sizeof(inc));
    std::memcpy(&inc, bytes.data(), sizeof(inc));
  }
  return inc;
}

std::string Agent::admissionError(int32_t id, uint64_t incarnation) const {
  auto v = view();
  Peer* p = v->find(id);
  if (!p || p->departed()) {
    return "worker id " + std::to_string(id) +
        " is not a member of the group at epoch " + std::to_string(v->epoch);
  }
  if (p->incarnation != incarnation) {
    return "worker id " + std::to_string(id) + " (incarnation " +
        incarnationText(incarnation) + ") is not its current holder " +
        p->info.name_ + " (incarnation " + incarnationText(p->incarnation) +
        ")";
  }
  return "";
}

void Agent::joinGroup(const std::string& entry) {
  const auto& self = getWorkerInfo();
  log_ = std::make_unique<MembershipLog>(store_);
  log_->beat(incarnation_);
  // A member that died meanwhile is declared dead by its lease, which ends
  // any wait for it; this bounds the rest (a store that stopped answering).
  const auto joinTimeout = std::max<std::chrono::milliseconds>(
      getRpcTimeout().count() > 0 ? getRpcTimeout()
                                  : options_.rendezvousTimeout,
      3 * leaseTimeout());
  auto deadline = Clock::now() + joinTimeout;
  Member me;
  me.rank = static_cast<int32_t>(self.id_);
  me.name = self.name_;
  me.incarnation = incarnation_;
  me.leaseMs = leaseTimeout().count();
  me.offers = entry.substr(std::min(entry.size(), entry.find('\n') + 1));

  int64_t epoch = 0;
  {
    std::unique_lock<std::mutex> lock(rosterMutex_);
    catchUp();
    // Our rank or name may still be held: by a worker that is alive (an
    // error), or by one that died and was not declared dead yet (a
    // replacement arriving before the heartbeat noticed): we declare it
    // dead once its lease has not been renewed for the lease timeout (for
    // up to kMaxLeaseProbing more while its listener answers).
    while (true) {
      const Member* holder = roster_.byRank(me.rank);
      if (!holder) {
        holder = roster_.byName(me.name);
      }
      if (!holder) {
        break;
      }
      awaitHolderGone(*holder, me, deadline, lock);
    }
    // Our device maps and the members' must land on devices their targets
    // publish, checked before we hold anything in the log.
    const DeviceOffer ours = parseDeviceOffer(me.offers);
    for (const auto& [rank, member] : roster_.members()) {
      const std::string conflict = deviceMapConflict(
          me.name, ours, member.name, parseDeviceOffer(member.offers));
      TORCH_CHECK(
          conflict.empty(),
          "init_rpc of ",
          me.name,
          " (rank ",
          me.rank,
          ") failed: ",
          conflict);
    }
    // Our RRef and autograd ids start past every earlier holder's of this
    // rank (torch derives them from the rank alone).
    torch_private::reserveIdRange(me.rank, log_->nextGeneration(me.rank));
    epoch = log_->append(joinRecord(me), roster_.epoch());
    while (roster_.epoch() < epoch) {
      catchUp();
    }
    Peer* mine = view()->find(me.rank);
    if (!mine || mine->incarnation != incarnation_) {
      TORCH_CHECK(
          false,
          "init_rpc of ",
          me.name,
          " (rank ",
          me.rank,
          ") failed: ",
          joinRefusal_.empty() ? "the group did not take our join"
                               : joinRefusal_);
    }
    ackApplied();
    std::lock_guard<std::mutex> events(eventsMutex_);
    reportEvents_ = true;
  }
  {
    std::lock_guard<std::mutex> lock(watcherMutex_);
    watcherStop_ = false;
  }
  watcher_ = std::thread([this] { watchMembership(); });
  // Return once every member knows us: a member may call us as soon as our
  // init_rpc returned (upstream's test_dynamic_rpc_existing_rank_...).
  std::vector<std::string> missing;
  if (!awaitAcks(epoch, deadline, &missing)) {
    try {
      std::lock_guard<std::mutex> lock(rosterMutex_);
      log_->append(leaveRecord(incarnation_), roster_.epoch());
    } catch (const std::exception&) {
    }
    stopWatcher();
    TORCH_CHECK(
        false,
        "init_rpc of ",
        me.name,
        " timed out after ",
        secondsText(joinTimeout),
        " waiting for ",
        c10::Join(", ", missing),
        " to acknowledge its join");
  }
}

bool Agent::catchUp() {
  bool changed = false;
  if (roster_.epoch() == 0) {
    // A joiner starts from the newest snapshot, if any, not from epoch 1.
    auto [epoch, text] = log_->latestSnapshot();
    Roster from;
    if (epoch > 0 && from.restore(epoch, text)) {
      roster_ = std::move(from);
      startEpoch_ = epoch;
      for (const auto& [rank, member] : roster_.members()) {
        MembershipEvent ev;
        ev.kind = MembershipEvent::Kind::kJoin;
        ev.epoch = epoch;
        ev.member = member;
        applyEvent(ev);
      }
      changed = true;
    }
  }
  while (auto record = log_->read(roster_.epoch() + 1)) {
    applyEvent(roster_.apply(*record));
    changed = true;
  }
  return changed;
}

void Agent::applyEvent(const MembershipEvent& ev) {
  auto old = view();
  auto next = std::make_shared<View>(*old);
  next->epoch = ev.epoch;
  const std::string epochText = " at epoch " + std::to_string(ev.epoch);
  switch (ev.kind) {
    case MembershipEvent::Kind::kIgnored:
      if (ev.member.incarnation == incarnation_) {
        joinRefusal_ = ev.reason;
      }
      break;
    case MembershipEvent::Kind::kJoin: {
      Route route;
      try {
        route = chooseRoute(ev.member.name, ev.member.offers);
      } catch (const std::exception& e) {
        route.unreachable = e.what(); // calls to it fail with this
      }
      auto peer = adopt(
          rpc::WorkerInfo(ev.member.name, static_cast<int64_t>(ev.member.rank)),
          ev.member.incarnation,
          std::move(route));
      if (next->byId.size() <= static_cast<size_t>(ev.member.rank)) {
        next->byId.resize(static_cast<size_t>(ev.member.rank) + 1);
      }
      next->byId[static_cast<size_t>(ev.member.rank)] = peer;
      next->byName[ev.member.name] = peer;
      break;
    }
    case MembershipEvent::Kind::kLeave:
    case MembershipEvent::Kind::kDead: {
      std::shared_ptr<Peer> peer;
      if (Peer* p = old->find(ev.member.rank);
          p && p->incarnation == ev.member.incarnation) {
        peer = old->byId[static_cast<size_t>(ev.member.rank)];
      }
      const std::string why = ev.kind == MembershipEvent::Kind::kLeave
          ? ev.member.name + " left the group" + epochText
          : ev.member.name + " was declared dead" + epochText + ": " +
              ev.reason;
      next->byId[static_cast<size_t>(ev.member.rank)].reset();
      next->byName.erase(ev.member.name);
      leases_.erase(ev.member.incarnation);
      if (ev.member.incarnation == incarnation_) {
        if (ev.kind == MembershipEvent::Kind::kDead && !left_.load()) {
          // Fenced: the others no longer talk to us, nor we to them.
          fencedReason_ = "this worker (" + ev.member.name +
              ") was declared dead by the group" + epochText + ": " + ev.reason;
          fenced_ = true;
          logWarning("torch_rpc_ext: " + fencedReason_);
          std::lock_guard<std::mutex> lock(connMutex_);
          for (auto& [p, conn] : outbound_) {
            conn->close(fencedReason_);
          }
        }
        break;
      }
      if (!peer) {
        break;
      }
      // Departed first, then its connections closed under connMutex_: no
      // connection to it is opened afterwards (connectionTo), and calls on
      // the closed ones fail naming why (onClosed).
      // A member that left drained its own calls first and still answers
      // ours in flight: its connections stay open until it closes them. A
      // dead one's are closed now, failing our calls to it.
      peer->depart(why);
      std::vector<std::shared_ptr<transport::Connection>> closing;
      {
        std::lock_guard<std::mutex> lock(connMutex_);
        auto out = outbound_.find(peer.get());
        if (out != outbound_.end()) {
          closing.push_back(out->second);
          outbound_.erase(out);
        }
        auto range = inbound_.equal_range(ev.member.rank);
        for (auto it = range.first; it != range.second; ++it) {
          if (auto conn = it->second.lock()) {
            closing.push_back(std::move(conn));
          }
        }
        inbound_.erase(ev.member.rank);
      }
      if (ev.kind == MembershipEvent::Kind::kDead) {
        for (auto& conn : closing) {
          conn->close(why);
        }
      }
      releaseForksOf(*peer);
      break;
    }
  }
  publish(std::move(next));
  if (ev.kind != MembershipEvent::Kind::kIgnored) {
    std::lock_guard<std::mutex> lock(eventsMutex_);
    if (reportEvents_) {
      events_.push_back(ev);
      // Our own leave (or death) is the last change we report: we are no
      // longer a member of what follows.
      if ((ev.kind == MembershipEvent::Kind::kLeave ||
           ev.kind == MembershipEvent::Kind::kDead) &&
          ev.member.incarnation == incarnation_) {
        reportEvents_ = false;
      }
      eventsCv_.notify_all();
    }
  }
}

void Agent::releaseForksOf(const Peer& peer) {
  // Only while we are torch's running agent (a departure applied while we
  // join concerns nothing of ours; RRefContext is torn down before our
  // shutdown), and before we acknowledge the departure, so no later holder
  // of its id can have created anything here yet.
  if (!rrefsLive_.load()) {
    return;
  }
  const auto departed = static_cast<rpc::worker_id_t>(peer.info.id_);
  try {
    size_t n = torch_private::dropForks(
        [&](const rpc::RRefId& /*rrefId*/, const rpc::ForkId& forkId) {
          // Who holds a fork: the worker that asked us to register it (a
          // fork request), else the one that minted it (its own remote()).
          std::lock_guard<std::mutex> lock(forkHoldersMutex_);
          auto it = forkHolders_.find(forkId);
          if (it != forkHolders_.end()) {
            if (it->second != departed) {
              return false;
            }
            forkHolders_.erase(it);
            return true;
          }
          return forkId.createdOn_ == departed;
        },
        [this](c10::intrusive_ptr<rpc::RRef> owner) {
          // A Python value is dropped with the GIL, off this thread.
          pool_.run([owner = std::move(owner)]() mutable {
            pybind11::gil_scoped_acquire gil;
            owner.reset();
          });
        });
    droppedForks_.fetch_add(n, std::memory_order_relaxed);
    // The distributed autograd contexts it created here (its forward
    // passes' RPCs to us): it will never release them. Autograd context ids
    // carry their creator's worker id in the top 16 bits.
    size_t contexts = torch_private::dropAutogradContexts([&](int64_t id) {
      return (id >> 48) == static_cast<int64_t>(departed);
    });
    droppedAutogradContexts_.fetch_add(contexts, std::memory_order_relaxed);
    // The RRefs we use that it owned: their values are gone with it. A
    // later holder of its id must never be asked for them (it would wait
    // for a value that cannot come); send() refuses such requests.
    auto owned = torch_private::userRRefsOwnedBy(departed);
    if (!owned.empty()) {
      std::string why = peer.departure();
      std::lock_guard<std::mutex> lock(staleRRefsMutex_);
      for (const auto& id : owned) {
        staleRRefs_[id] = why;
      }
      hasStaleRRefs_.store(true, std::memory_order_release);
    }
  } catch (const std::exception& e) {
    logWarning(
        "torch_rpc_ext: " + workerInfo_.name_ +
        " could not release the RRef forks and autograd contexts of " +
        peer.info.name_ + ": " + e.what());
  }
}

void Agent::watchMembership() {
  auto pause = kBusyPoll;
  std::string lastError;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(watcherMutex_);
      if (watcherCv_.wait_for(lock, pause, [this] { return watcherStop_; })) {
        return;
      }
    }
    try {
      auto now = Clock::now();
      if (now >= nextBeat_) {
        log_->beat(incarnation_);
        nextBeat_ = now + leaseTimeout() / 5;
      }
      bool changed;
      {
        std::lock_guard<std::mutex> lock(rosterMutex_);
        changed = catchUp();
        ackApplied();
        // Every snapshotEvery() epochs, the roster as a snapshot for joiners.
        const int64_t every = MembershipLog::snapshotEvery();
        if (roster_.epoch() / every > snapshotWritten_ / every) {
          log_->writeSnapshot(roster_.epoch(), roster_.snapshot());
          snapshotWritten_ = roster_.epoch();
        }
        if (now >= nextLeaseCheck_) {
          checkLeases();
          ackApplied(); // a death it recorded itself
          nextLeaseCheck_ = now +
              std::min<std::chrono::milliseconds>(
                                leaseTimeout() / 5, std::chrono::seconds(1));
        }
      }
      pause = changed ? kBusyPoll : std::min(pause * 2, kIdlePoll);
      lastError.clear();
    } catch (const std::exception& e) {
      // The store is unreachable (its host exited, say): say so once per
      // new error, keep trying.
      if (lastError != e.what()) {
        lastError = e.what();
        logWarning(
            "torch_rpc_ext: " + workerInfo_.name_ +
            " cannot read the group's membership from the store: " + lastError);
      }
      pause = kIdlePoll;
    }
  }
}

void Agent::ackApplied() {
  // Everything applied is acknowledged, however it was applied (by this
  // loop, by join or leave, by a lease check): a joiner waits for it.
  if (roster_.epoch() > ackedEpoch_) {
    log_->ack(incarnation_, roster_.epoch());
    ackedEpoch_ = roster_.epoch();
  }
}

bool Agent::awaitAcks(
    int64_t epoch,
    Clock::time_point deadline,
    std::vector<std::string>* missing) {
  auto pause = std::chrono::milliseconds(2);
  while (true) {
    missing->clear();
    auto v = view(); // held: a range-for does not keep a temporary alive
    for (const auto& peer : v->byId) {
      if (peer && peer->incarnation != incarnation_ &&
          log_->acked(peer->incarnation) < epoch) {
        missing->push_back(peer->info.name_);
      }
    }
    if (missing->empty()) {
      return true;
    }
    if (Clock::now() >= deadline) {
      return false;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kBusyPoll * 2);
  }
}

void Agent::leaveGroup(std::optional<Clock::time_point> deadline) {
  if (left_.exchange(true) || !log_) {
    return;
  }
  int64_t epoch;
  {
    std::lock_guard<std::mutex> lock(rosterMutex_);
    catchUp();
    epoch = log_->append(leaveRecord(incarnation_), roster_.epoch());
    while (roster_.epoch() < epoch) {
      catchUp();
    }
  }
  // Once every member has applied our leave, nobody starts a call to us;
  // then the calls we are serving finish (their responses still go out).
  auto until = Clock::now() + 2 * leaseTimeout();
  if (deadline && *deadline < until) {
    until = *deadline;
  }
  std::vector<std::string> missing;
  if (!awaitAcks(epoch, until, &missing)) {
    logWarning(
        "torch_rpc_ext: " + workerInfo_.name_ + " leaves before " +
        c10::Join(", ", missing) + " acknowledged it");
  }
  auto pause = std::chrono::milliseconds(1);
  while (serverActiveCalls_.load() > 0 && Clock::now() < until) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kBusyPoll);
  }
  stopWatcher();
  try {
    log_->forget(incarnation_);
  } catch (const std::exception&) {
    // The store may be gone already: nothing depends on these keys.
  }
}

void Agent::stopMembership() {
  rrefsLive_ = false;
  if (log_ && !left_.exchange(true)) {
    // Not a graceful leave (shutdown(graceful=False), or an error): tell the
    // group at once rather than let our lease run out.
    try {
      std::lock_guard<std::mutex> lock(rosterMutex_);
      log_->append(leaveRecord(incarnation_), roster_.epoch());
      log_->forget(incarnation_);
    } catch (const std::exception& e) {
      logWarning(
          "torch_rpc_ext: " + workerInfo_.name_ +
          " could not record leaving the group (its lease will run out): " +
          e.what());
    }
  }
  stopWatcher();
}

c10::intrusive_ptr<JitFuture> Agent::refuseStaleRRefUse(
    const rpc::WorkerInfo& to,
    const rpc::Message& message) {
  std::optional<rpc::RRefId> id;
  bool deletion = false;
  try {
    switch (message.type()) {
      case rpc::MessageType::SCRIPT_RREF_FETCH_CALL:
        id.emplace(rpc::ScriptRRefFetchCall::fromMessage(message)->rrefId());
        break;
      case rpc::MessageType::PYTHON_RREF_FETCH_CALL:
        id.emplace(rpc::PythonRRefFetchCall::fromMessage(message)->rrefId());
        break;
      case rpc::MessageType::RREF_FORK_REQUEST:
        id.emplace(rpc::RRefForkRequest::fromMessage(message)->rrefId());
        break;
      case rpc::MessageType::RREF_USER_DELETE:
        id.emplace(rpc::RRefUserDelete::fromMessage(message)->rrefId());
        deletion = true;
        break;
      default:
        return nullptr;
    }
  } catch (const std::exception&) {
    return nullptr; // not ours to judge: the callee refuses it
  }
  std::string why;
  {
    std::lock_guard<std::mutex> lock(staleRRefsMutex_);
    auto it = staleRRefs_.find(*id);
    if (it == staleRRefs_.end()) {
      return nullptr;
    }
    why = it->second;
    if (deletion) {
      staleRRefs_.erase(it); // its last use
    }
  }
  auto done =
      c10::make_intrusive<JitFuture>(at::AnyClassType::get(), getDevices());
  if (deletion) {
    // Nothing to delete: the owner and its value are gone.
    done->markCompleted(c10::IValue(rpc::RRefAck().toMessage()));
    return done;
  }
  std::ostringstream text;
  text << "RRef " << *id << " was owned by a previous holder of " << to.name_
       << ", and its value is gone with it (" << why << "); the current "
       << to.name_ << " does not have it";
  done->setError(std::make_exception_ptr(std::runtime_error(text.str())));
  return done;
}

void Agent::stopWatcher() {
  {
    std::lock_guard<std::mutex> lock(eventsMutex_);
    eventsClosed_ = true;
  }
  eventsCv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(watcherMutex_);
    watcherStop_ = true;
  }
  watcherCv_.notify_all();
  if (watcher_.joinable() && watcher_.get_id() != std::this_thread::get_id()) {
    watcher_.join();
  }
}

std::optional<std::vector<MembershipEvent>> Agent::takeMembershipEvents(
    std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(eventsMutex_);
  eventsCv_.wait_for(
      lock, timeout, [this] { return eventsClosed_ || !events_.empty(); });
  if (events_.empty() && eventsClosed_) {
    return std::nullopt;
  }
  std::vector<MembershipEvent> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

} // namespace torch_rpc_ext
