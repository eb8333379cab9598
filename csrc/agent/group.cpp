// SPDX-License-Identifier: BSD-3-Clause
// The group (group.h): start-up through the c10d store handed to init_rpc
// (the group secret, every worker's name and route), the lookups every call
// makes, and the static group's join barrier.
#include "csrc/agent/group.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include <c10/util/StringUtil.h>

#include "csrc/agent/store_bytes.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

constexpr const char* kWorkerKeyPrefix = "torch_rpc_ext/worker/";
constexpr const char* kJoinKeyPrefix = "torch_rpc_ext/join/";
// How often join looks at who is missing (and probes them), at most.
constexpr auto kJoinSlice = std::chrono::milliseconds(200);
// How long rank 0 waits, after the last barrier, for the others to say they
// are done with the store.
constexpr auto kLeaveWait = std::chrono::seconds(10);
} // namespace

uint64_t drawIncarnation() {
  uint64_t inc = 0;
  while (inc == 0) {
    std::string bytes = randomBytes(sizeof(inc));
    std::memcpy(&inc, bytes.data(), sizeof(inc));
  }
  return inc;
}

Group::Group(
    c10::intrusive_ptr<::c10d::Store> store,
    rpc::WorkerInfo self,
    int worldSize,
    const AgentOptions& options,
    GroupListener& listener)
    : store_(std::move(store)),
      self_(std::move(self)),
      worldSize_(worldSize),
      options_(options),
      listener_(listener),
      exchange_(
          store_,
          self_.name_,
          self_.id_,
          worldSize > 0 ? std::string() : options.secret),
      view_(std::make_shared<View>()) {}

Group::~Group() {
  stopWatcher();
}

const std::string& Group::establishSecret() {
  if (worldSize_ > 0) {
    // Every rank of a static group takes part in the sealed exchange, with
    // a secret of its own or not, so that none waits on another's choice:
    // a rank with a secret of its own keeps it (and never publishes it), so
    // ranks that disagree fail their calls' handshakes, not init.
    std::string sealed = exchange_.forStaticGroup(worldSize_);
    secret_ = options_.secret.empty() ? sealed : options_.secret;
  } else {
    // A dynamic group: whoever comes first makes it; a member seals it to
    // each joiner's key, or, where the user gave the group a passphrase, to
    // each joiner that proves it (group_secret.cpp). Nothing in the store
    // is keyed by the passphrase: a tap of it has nothing to test a guess
    // against (until session 110 the membership log's proofs were).
    secret_ = exchange_.forDynamicGroup(
        std::max<std::chrono::milliseconds>(
            options_.rendezvousTimeout, 3 * leaseTimeout()),
        leaseTimeout(),
        [this](
            const std::string& name,
            const std::string& offers,
            std::chrono::milliseconds within) {
          return listener_.listenerAnswers(name, offers, within);
        });
  }
  if (worldSize_ == 0) {
    incarnation_ = drawIncarnation(); // proven in every handshake
  }
  return secret_;
}

void Group::join(
    const std::string& entry,
    std::chrono::milliseconds rpcTimeout) {
  if (worldSize_ == 0) {
    joinLog(entry, rpcTimeout);
    return;
  }
  store_->set(kWorkerKeyPrefix + std::to_string(self_.id_), toBytes(entry));
  auto view = std::make_shared<View>();
  view->byId.resize(worldSize_);
  for (int r = 0; r < worldSize_; ++r) {
    std::string entry =
        fromBytes(store_->get(kWorkerKeyPrefix + std::to_string(r)));
    auto nl = entry.find('\n');
    TORCH_CHECK(nl != std::string::npos, "malformed rendezvous entry ", r);
    std::string name = entry.substr(0, nl);
    auto it = view->byName.find(name);
    TORCH_CHECK(
        it == view->byName.end(),
        "RPC worker name ",
        name,
        " is not unique: ranks ",
        it == view->byName.end() ? 0 : it->second->info.id_,
        " and ",
        r,
        " both use it");
    view->byId[r] = adopt(
        rpc::WorkerInfo(name, static_cast<int64_t>(r)),
        /*incarnation=*/0,
        listener_.routeFor(name, entry.substr(nl + 1)));
    view->byName[name] = view->byId[r];
  }
  publish(std::move(view));
}

// ---- Lookups ----------------------------------------------------------------

void Group::publish(std::shared_ptr<const View> view) {
  std::lock_guard<std::mutex> lock(viewMutex_);
  view_ = std::move(view);
}

Peer* Group::peerById(int64_t id) const {
  std::lock_guard<std::mutex> lock(viewMutex_);
  return view_->find(id);
}

Peer* Group::memberOn(int32_t id, uint64_t incarnation) const {
  Peer* p = peerById(id);
  return p && p->incarnation == incarnation ? p : nullptr;
}

std::shared_ptr<Peer> Group::lastPeerNamed(const std::string& name) const {
  std::lock_guard<std::mutex> lock(peersMutex_);
  for (auto it = peers_.rbegin(); it != peers_.rend(); ++it) {
    if ((*it)->info.name_ == name) {
      return *it;
    }
  }
  return nullptr;
}

std::vector<std::shared_ptr<Peer>> Group::everyPeer() const {
  std::lock_guard<std::mutex> lock(peersMutex_);
  return peers_;
}

std::shared_ptr<Peer> Group::adopt(
    rpc::WorkerInfo info,
    uint64_t incarnation,
    Route route) {
  std::lock_guard<std::mutex> lock(peersMutex_);
  auto& stats = statsByName_[info.name_];
  if (!stats) {
    stats = std::make_shared<PeerStats>();
  }
  auto peer = std::make_shared<Peer>(
      std::move(info), incarnation, std::move(route), stats);
  peers_.push_back(peer);
  return peer;
}

const rpc::WorkerInfo& Group::worker(const std::string& workerName) const {
  auto v = view();
  auto it = v->byName.find(workerName);
  if (it != v->byName.end()) {
    return it->second->info; // peers live as long as we do
  }
  std::string why;
  if (auto gone = lastPeerNamed(workerName)) {
    why = ": " + gone->departure();
  } else {
    std::vector<std::string> names;
    for (const auto& p : v->byId) {
      if (p) {
        names.push_back(p->info.name_);
      }
    }
    why = " (known workers: " + c10::Join(", ", names) + ")";
  }
  notFound("name " + workerName + why);
}

const rpc::WorkerInfo& Group::worker(rpc::worker_id_t id) const {
  auto v = view();
  if (Peer* p = v->find(id)) {
    return p->info;
  }
  std::string why = worldSize_ > 0
      ? " (world size " + std::to_string(worldSize_) + ")"
      : " (no member holds it at epoch " + std::to_string(v->epoch) + ")";
  {
    std::lock_guard<std::mutex> lock(peersMutex_);
    for (auto it = peers_.rbegin(); it != peers_.rend(); ++it) {
      if ((*it)->info.id_ == id && (*it)->departed()) {
        why = ": " + (*it)->departure();
        break;
      }
    }
  }
  notFound("id " + std::to_string(id) + why);
}

void Group::notFound(const std::string& what) const {
  // Upstream's text, which its tests match.
  TORCH_CHECK(
      false,
      "name:",
      self_.name_,
      ",rank:",
      self_.id_,
      " could not find destination ",
      what);
}

std::string Group::admissionError(int32_t id, uint64_t incarnation) const {
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

void Group::addMetrics(std::unordered_map<std::string, std::string>& m) const {
  if (worldSize_ != 0) {
    return;
  }
  auto v = view();
  m["rpc_ext.membership.epoch"] = std::to_string(v->epoch);
  m["rpc_ext.membership.size"] = std::to_string(v->byName.size());
  m["rpc_ext.membership.start_epoch"] = std::to_string(startEpoch_.load());
  m["rpc_ext.membership.joins"] = std::to_string(joins_.load());
  m["rpc_ext.membership.leaves"] = std::to_string(leaves_.load());
  m["rpc_ext.membership.deaths"] = std::to_string(deaths_.load());
  m["rpc_ext.membership.lease_lapses"] = std::to_string(leaseLapses_.load());
  m["rpc_ext.membership.unproven_records"] = std::to_string(unproven_.load());
  m["rpc_ext.membership.secret_requests_waiting"] =
      std::to_string(exchange_.waiting());
  m["rpc_ext.membership.secret_proofs_refused"] =
      std::to_string(exchange_.proofsRefused());
  m["rpc_ext.membership.secret_hold_offs"] =
      std::to_string(exchange_.holdOffs());
  m["rpc_ext.membership.secret_held_off"] = exchange_.heldOff() ? "1" : "0";
}

// ---- The static group's join barrier ----------------------------------------

void Group::leaveBarrier(
    std::optional<std::chrono::steady_clock::time_point> deadline,
    float timeout) {
  // After the last barrier of a graceful shutdown a worker may exit at
  // once, and the store's host (rank 0 under torch's rendezvous) takes the
  // store with it while another worker may still be reading that barrier's
  // keys: "Connection reset by peer" in a join that had in fact succeeded.
  // So every other worker's last store call is one set() of a "left" key,
  // and rank 0 returns only once all of them have landed (or after a
  // bounded wait, if a worker died in between: shutdown must finish).
  const std::string left =
      kJoinKeyPrefix + std::to_string(joinRounds_) + "/left/";
  barrier(0, deadline, timeout);
  if (self_.id_ != 0) {
    // Tests only: a worker slow to leave (tests/rpc/test_rendezvous.py).
    if (const char* delay = std::getenv("TORCH_RPC_EXT_TEST_LEAVE_DELAY_MS")) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
    }
    try {
      store_->set(left + std::to_string(self_.id_), toBytes("1"));
    } catch (const std::exception& e) {
      logWarning(
          "torch_rpc_ext: " + self_.name_ +
          " could not report leaving to the store: " + e.what());
    }
    return;
  }
  std::vector<std::string> keys;
  for (int r = 1; r < worldSize_; ++r) {
    keys.push_back(left + std::to_string(r));
  }
  auto until = std::chrono::steady_clock::now() + kLeaveWait;
  if (deadline && *deadline < until) {
    until = *deadline;
  }
  auto pause = std::chrono::milliseconds(1);
  while (!keys.empty() && !store_->check(keys)) {
    if (std::chrono::steady_clock::now() >= until) {
      logWarning(
          "torch_rpc_ext: " + self_.name_ +
          " leaves before every worker reported leaving");
      return;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kJoinSlice);
  }
}

std::vector<std::string> Group::whyUnreachable(
    const std::vector<std::string>& names,
    std::chrono::milliseconds within,
    bool dial) {
  auto v = view(); // holds the peers while they are probed
  std::vector<const Peer*> peers;
  std::vector<size_t> at;
  std::vector<std::string> why(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = v->byName.find(names[i]);
    if (it == v->byName.end() || !it->second) {
      why[i] = "not a member";
      continue;
    }
    peers.push_back(it->second.get());
    at.push_back(i);
  }
  auto found = listener_.whyUnreachable(peers, within, dial);
  for (size_t k = 0; k < at.size(); ++k) {
    why[at[k]] = std::move(found[k]);
  }
  return why;
}

int64_t Group::barrier(
    int64_t value,
    std::optional<std::chrono::steady_clock::time_point> deadline,
    float timeout) {
  // Every worker runs the same sequence of rounds, so the round number
  // names the same barrier everywhere.
  std::string prefix = kJoinKeyPrefix + std::to_string(joinRounds_++) + "/";
  store_->set(
      prefix + std::to_string(self_.id_), toBytes(std::to_string(value)));
  std::vector<std::string> keys;
  for (int r = 0; r < worldSize_; ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  // Poll rather than block in store->wait(): stores differ in what a wait
  // timeout throws. The poll interval grows to kJoinSlice, so a barrier that
  // everyone reaches together costs a millisecond or two.
  auto pause = std::chrono::milliseconds(1);
  auto nextProbe = std::chrono::steady_clock::now() + kJoinSlice;
  while (!store_->check(keys)) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kJoinSlice);
    if (std::chrono::steady_clock::now() < nextProbe) {
      continue;
    }
    nextProbe = std::chrono::steady_clock::now() + kJoinSlice;
    // Who is missing, and can we still reach them? A dead peer would make
    // us wait forever: its connection fails (refused, reset, or no
    // handshake within handshake_timeout) and we say so.
    std::vector<const Peer*> missingPeers;
    auto v = view();
    for (int r = 0; r < worldSize_; ++r) {
      if (!store_->check({keys[r]})) {
        missingPeers.push_back(v->find(r));
      }
    }
    auto why =
        listener_.whyUnreachable(missingPeers, kJoinSlice / 4, /*dial=*/true);
    std::vector<std::string> missing, unreachable;
    for (size_t i = 0; i < missingPeers.size(); ++i) {
      const std::string& name = missingPeers[i]->info.name_;
      missing.push_back(name);
      if (!why[i].empty()) {
        unreachable.push_back(name + " (" + why[i] + ")");
      }
    }
    TORCH_CHECK(
        unreachable.empty(),
        "RPC join on ",
        self_.name_,
        ": unreachable: ",
        c10::Join(", ", unreachable),
        "; a graceful shutdown cannot complete, use "
        "rpc.shutdown(graceful=False)");
    TORCH_CHECK(
        !deadline || std::chrono::steady_clock::now() < *deadline,
        "RPC join on ",
        self_.name_,
        " timed out after ",
        timeout,
        " s waiting for ",
        c10::Join(", ", missing));
  }
  // Each worker wrote a count of its own; anything else there came from
  // another writer of the store (before, std::stoll threw its own bare
  // "stoll" out of shutdown, and a sum past int64 was undefined).
  int64_t sum = 0;
  for (const auto& key : keys) {
    const std::string text = fromBytes(store_->get(key));
    const std::optional<int64_t> v = decimal(text);
    TORCH_CHECK(
        v && !__builtin_add_overflow(sum, *v, &sum),
        "RPC join on ",
        self_.name_,
        ": the rendezvous store's ",
        key,
        " holds something other than a worker's count (",
        text.size(),
        " bytes): another writer of the store, or another group under the "
        "same prefix");
  }
  return sum;
}

} // namespace torch_rpc_ext
