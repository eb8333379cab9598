// SPDX-License-Identifier: BSD-3-Clause
// SecretExchange (group_secret.h).
//
// A dynamic group's exchange, under torch_rpc_ext/dyn_secret/ in the store:
//   epoch                 the group's current secret epoch (a counter)
//   <e>/maker             the public key of the epoch's maker (compareSet:
//                         the first joiner to set it makes the secret)
//   <e>/requests          joiners' requests so far (a counter)
//   <e>/request/<n>       request n: the joiner's public key
//   <e>/sealed/<n>        a member's public key, then the secret sealed to
//                         request n (compareSet: the first member's stands)
//   <e>/joined            set once a member of epoch e is in the group
// In a group given a passphrase by the user, request n is an exchange that
// proves it (secret_seal.h): request/<n> the joiner's nonce and share,
// sealed/<n> the answering member's share, confirm/<n> the joiner's
// confirmation, answer/<n> the secret sealed under the exchange's key (or
// a refusal). The secret itself is made as without one: the passphrase
// admits joiners, and nothing in the store is keyed by it.
// The joiner deletes request n, then its answer, once it has joined (after
// every member acknowledged its join: each has seen the answer by then),
// so a long-lived group's store keeps nothing per join of these. A member
// that finds neither (its joiner was answered and cleaned up, or has not
// written its key yet, or died first) lets the request go after
// kUnwrittenGrace; a joiner whose key took half that to write asks again.
// A joiner that finds nobody alive to seal the epoch's secret (its members
// all left, or died: their leases lapsed; or its maker never joined) ends
// the epoch (compareSet on the counter: one step, one joiner moves it) and
// starts the next: a new secret for a new group. A member that finds, once
// joined, that its epoch ended meanwhile leaves and fails its init_rpc
// (Group::joinLog), so that no two secrets serve one group.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "csrc/agent/group_secret.h"
#include "csrc/agent/membership.h"
#include "csrc/agent/secret_seal.h"
#include "csrc/agent/store_bytes.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

using Clock = std::chrono::steady_clock;
using namespace secret_seal;

// A static group without a secret of its own: each worker's X25519 public
// key, and rank 0's secret sealed to each other rank (sealFor).
constexpr const char* kSecretPubPrefix = "torch_rpc_ext/secret_pub/";
constexpr const char* kSecretSealedPrefix = "torch_rpc_ext/secret_sealed/";

// A dynamic group's exchange (above).
constexpr const char* kDynEpochKey = "torch_rpc_ext/dyn_secret/epoch";
// How often a joiner looks for its sealed secret, and for an empty group;
// the requests a member keeps looking at whose key is not written yet.
constexpr auto kSealPoll = std::chrono::milliseconds(20);
constexpr auto kEmptyCheck = std::chrono::milliseconds(500);
constexpr size_t kMaxWaitingRequests = 256;
// Meanwhile it looks again after 0.25 s, then twice as long each time: a
// member that joins a busy group finds up to kMaxWaitingRequests requests
// already answered and deleted, and looks for each a handful of times.
constexpr auto kFirstLookAgain = std::chrono::milliseconds(250);

} // namespace

std::string SecretExchange::dynKey(int64_t epoch, const std::string& what) {
  return "torch_rpc_ext/dyn_secret/" + std::to_string(epoch) + "/" + what;
}

SecretExchange::SecretExchange(
    c10::intrusive_ptr<::c10d::Store> store,
    std::string selfName,
    int64_t rank,
    std::string passphrase)
    : store_(std::move(store)),
      selfName_(std::move(selfName)),
      rank_(rank),
      passphrase_(std::move(passphrase)) {}

std::string SecretExchange::forStaticGroup(int worldSize) {
  // Rank 0 makes the secret and seals it to each other rank's public key
  // (X25519, then AES-GCM): the store, and a wire reader of its traffic,
  // see public keys and sealed bytes only. Someone who can write the store
  // can still put their key in place of a rank's before rank 0 reads it
  // (docs/security.md): a secret given out of band closes that.
  const int64_t rank = rank_;
  X25519Key key;
  store_->set(
      kSecretPubPrefix + std::to_string(rank), toBytes(key.publicKey()));
  if (rank == 0) {
    std::string secret = randomBytes(kSecretBytes);
    for (int r = 1; r < worldSize; ++r) {
      std::string pubR =
          fromBytes(store_->get(kSecretPubPrefix + std::to_string(r)));
      std::string sealed;
      try {
        sealed =
            sealFor(sealKey(key, pubR, key.publicKey(), pubR, r), secret, r);
      } catch (const std::exception& e) {
        TORCH_CHECK(
            false,
            "init_rpc: rank ",
            r,
            "'s public key in the rendezvous store is unusable (",
            e.what(),
            "): something other than a torch_rpc_ext worker wrote it");
      }
      store_->set(kSecretSealedPrefix + std::to_string(r), toBytes(sealed));
    }
    return secret;
  }
  std::string pub0 =
      fromBytes(store_->get(kSecretPubPrefix + std::string("0")));
  std::string sealed =
      fromBytes(store_->get(kSecretSealedPrefix + std::to_string(rank)));
  std::optional<std::string> secret;
  try {
    secret =
        openFor(sealKey(key, pub0, pub0, key.publicKey(), rank), sealed, rank);
  } catch (const std::exception&) {
  }
  TORCH_CHECK(
      secret.has_value(),
      "init_rpc of rank ",
      rank,
      ": the group secret rank 0 sealed for us in the rendezvous store does "
      "not open with our key: the store's contents were altered, or another "
      "group shares this store and prefix");
  return *secret;
}

std::string SecretExchange::forDynamicGroup(
    std::chrono::milliseconds timeout,
    std::chrono::milliseconds lease,
    const ListenerAnswers& answers) {
  const auto deadline = Clock::now() + timeout;
  X25519Key key;
  const std::string pub = key.publicKey();
  // Exchanges we confirmed that never gave us the secret: each told
  // whoever answered it whether one guess at the passphrase was right.
  int unanswered = 0;
  while (true) {
    const int64_t epoch = readCounter(*store_, kDynEpochKey);
    if (fromBytes(store_->compareSet(
            dynKey(epoch, "maker"), {}, toBytes(pub))) == pub) {
      epoch_ = epoch; // ours to make: it never leaves this process
      return randomBytes(kSecretBytes);
    }
    const auto counting = Clock::now();
    const int64_t n = store_->add(dynKey(epoch, "requests"), 1);
    const auto counted = Clock::now();
    Asking asking{epoch, n, key};
    if (!passphrase_.empty()) {
      asking.proof.emplace(passphrase_, epoch, n);
    }
    store_->set(
        dynKey(epoch, "request/" + std::to_string(n)),
        toBytes(asking.proof ? asking.proof->request() : pub));
    const auto asked = Clock::now();
    if (asked - counting >= kUnwrittenGrace / 2 && asked < deadline) {
      // Written too late: the members may have let request n go. Again.
      forgetRequest(epoch, n);
      continue;
    }
    auto nextCheck = asked + kEmptyCheck;
    std::map<uint64_t, Beat> beats; // the listed members' leases, as seen
    while (true) {
      std::optional<std::string> secret;
      try {
        secret = takeAnswer(asking);
      } catch (const c10::Error&) {
        // Refused, or an answer that does not open: this request's keys
        // go with us (a worker restarted in a loop with a wrong passphrase
        // leaves none behind), where the store still answers.
        try {
          forgetRequest(epoch, n);
        } catch (const std::exception&) {
        }
        throw;
      }
      if (secret) {
        epoch_ = epoch;
        mine_ = n; // its keys deleted once we joined (noteJoined)
        mineCounted_ = counted;
        return *secret;
      }
      const auto now = Clock::now();
      if (asking.unanswered(now)) {
        // The member that took our confirmation went (died, or left)
        // before it answered: another may answer a new request.
        forgetRequest(epoch, n);
        break;
      }
      if (now >= deadline) {
        forgetRequest(epoch, n); // (nobody is to answer it now)
      }
      TORCH_CHECK(
          now < deadline,
          "init_rpc of ",
          selfName_,
          " timed out after ",
          std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
          " s waiting for a member of the dynamic group to seal the group's "
          "secret for us (members do it from their watcher thread, reading "
          "the rendezvous store; are they alive and reading it? A member "
          "that has refused, or seen left unconfirmed, ",
          kProofStrikes,
          " exchanges proving the group's passphrase within ",
          kStrikeWindow.count(),
          " s answers no joiner for ",
          kProofHoldOff.count(),
          " s: rpc_ext.membership.secret_held_off)");
      if (now >= nextCheck) {
        nextCheck = now + kEmptyCheck;
        if (readCounter(*store_, kDynEpochKey) != epoch) {
          forgetRequest(epoch, n);
          break; // a new group began: ask there
        }
        // The epoch's group has nobody alive to seal it: its members all
        // left or died (leases lapsed), or its maker never joined. A new
        // group, with a new secret; whoever moves the counter from this
        // epoch (one step: before session 93 a joiner claimed "ended",
        // then raised the counter, and one that died or lost the store in
        // between left every later joiner waiting on an epoch nobody could
        // end) starts it, and the others ask there.
        const bool joined = store_->check({dynKey(epoch, "joined")});
        if ((joined || now - asked > 3 * lease) &&
            liveMembers(epoch, lease, now, beats, answers) == 0) {
          endEpoch(epoch);
          forgetRequest(epoch, n);
          break;
        }
      }
      std::this_thread::sleep_for(kSealPoll);
    }
    if (!asking.confirmed) {
      continue; // given up before we confirmed: it told nobody anything
    }
    ++unanswered;
    logWarning(
        "torch_rpc_ext: " + selfName_ +
        " confirmed its proof of the group's passphrase to an answer in the "
        "rendezvous store that never sealed the secret (" +
        std::to_string(unanswered) + " of " +
        std::to_string(kMaxUnansweredProofs) +
        "): a member that left, died or stalled mid-exchange, or someone who "
        "can write the store posing as one");
    TORCH_CHECK(
        unanswered < kMaxUnansweredProofs,
        "init_rpc of ",
        selfName_,
        ": ",
        unanswered,
        " answers in the rendezvous store took our proof of the group's "
        "passphrase and never sealed the secret: someone who can write the "
        "store may be posing as a member, each exchange a guess at the "
        "passphrase (members that go mid-exchange are rare); check who can "
        "reach the store");
  }
}

std::optional<std::string> SecretExchange::takeAnswer(Asking& a) {
  const std::string slot = std::to_string(a.n);
  if (!a.confirmed) {
    const std::optional<std::string> value =
        peekKey(*store_, dynKey(a.epoch, "sealed/" + slot));
    if (!value) {
      return std::nullopt;
    }
    TORCH_CHECK(
        *value != kRefusedNoPassphrase,
        "init_rpc of ",
        selfName_,
        ": the dynamic group's members were given a passphrase "
        "(RpcExtBackendOptions(secret=...) or TORCH_RPC_EXT_SECRET) and this "
        "worker none: give every worker of a group the same (or someone else "
        "wrote the rendezvous store)");
    TORCH_CHECK(
        *value != kRefusedPassphrase,
        "init_rpc of ",
        selfName_,
        ": this worker was given a passphrase (RpcExtBackendOptions(secret="
        "...) or TORCH_RPC_EXT_SECRET) and the dynamic group's members none: "
        "give every worker of a group the same (or someone else wrote the "
        "rendezvous store)");
    std::optional<std::string> secret;
    if (a.proof) {
      // Our confirmation of the exchange's key: the member answers it.
      if (std::optional<std::string> confirmation = a.proof->confirm(*value)) {
        store_->set(dynKey(a.epoch, "confirm/" + slot), toBytes(*confirmation));
        a.confirmed = true;
        a.confirmedAt = Clock::now();
        return std::nullopt;
      }
    } else if (value->size() > X25519Key::kBytes) {
      const std::string member = value->substr(0, X25519Key::kBytes);
      try {
        secret = openFor(
            sealKey(a.key, member, member, a.key.publicKey(), -a.n),
            value->substr(X25519Key::kBytes),
            -a.n);
      } catch (const std::exception&) {
      }
    }
    TORCH_CHECK(
        secret.has_value(),
        "init_rpc of ",
        selfName_,
        ": the group secret a member sealed for us in the rendezvous "
        "store does not open with our key: the store's contents were "
        "altered, or another group shares this store and prefix");
    return secret;
  }
  const std::optional<std::string> answer =
      peekKey(*store_, dynKey(a.epoch, "answer/" + slot));
  if (!answer) {
    return std::nullopt;
  }
  TORCH_CHECK(
      *answer != kRefusedProof,
      "init_rpc of ",
      selfName_,
      ": a member of the dynamic group refused our proof of the group's "
      "passphrase: this worker's (RpcExtBackendOptions(secret=...) or "
      "TORCH_RPC_EXT_SECRET) is not the one the members were given (or "
      "someone else wrote the rendezvous store)");
  std::optional<std::string> secret = a.proof->open(*answer);
  TORCH_CHECK(
      secret.has_value(),
      "init_rpc of ",
      selfName_,
      ": the group secret a member sealed for us in the rendezvous store "
      "does not open with the key our exchange with it gave: the store's "
      "contents were altered, or another group shares this store and prefix");
  return secret;
}

bool SecretExchange::noteJoined() {
  if (epoch_ < 0) {
    return true;
  }
  if (mine_ > 0) {
    forgetRequest(epoch_, mine_);
  }
  store_->set(dynKey(epoch_, "joined"), toBytes(std::string("1")));
  // A group that started over while we joined holds another secret.
  return !epochEnded();
}

bool SecretExchange::epochEnded() const {
  return epoch_ >= 0 && readCounter(*store_, kDynEpochKey) != epoch_;
}

void SecretExchange::endEpoch(int64_t epoch) const {
  // The counter's text as the store holds it (add() writes decimal text),
  // or none at epoch 0: a counter nobody raised yet.
  const std::optional<std::string> now = peekKey(*store_, kDynEpochKey);
  if (now ? decimal(*now) != epoch : epoch != 0) {
    return; // moved on meanwhile
  }
  store_->compareSet(
      kDynEpochKey,
      now ? toBytes(*now) : std::vector<uint8_t>{},
      toBytes(std::to_string(epoch + 1)));
}

bool SecretExchange::sealTo(
    int64_t n,
    Waiting& w,
    Clock::time_point now,
    const std::string& secret) {
  if (w.proof) {
    return answerProof(n, w, now, secret);
  }
  if (now < w.nextLook) {
    return false;
  }
  if (!passphrase_.empty() && !mayOffer(now)) {
    // Held off (refused proofs: no joiner is answered), or as many
    // exchanges under way as may still be refused: look again later.
    w.nextLook = std::max(heldUntil_, now + kSealPoll);
    return false;
  }
  const std::string sealedKey = dynKey(epoch_, "sealed/" + std::to_string(n));
  if (store_->check({sealedKey})) {
    return true; // another member answered
  }
  const std::string requestKey = dynKey(epoch_, "request/" + std::to_string(n));
  // Read at once, not check() then get(): its joiner, answered by another
  // member, may delete it in between (get() would wait out the store's
  // timeout here, our lease with it).
  const std::optional<std::string> joiner = peekKey(*store_, requestKey);
  if (!joiner) {
    // Not written yet, or answered and deleted, or its joiner died. One
    // counted before ours is not coming once kUnwrittenGrace has passed
    // since our own count (its joiner counted earlier, and writes within
    // half that or asks again), so a new member of a busy group does not
    // look for each of the last kMaxWaitingRequests joiners' requests a
    // handful of times. Not before: a joiner that counted just before us
    // and stalled a second before writing is still to be answered.
    if (n < mine_ && now - mineCounted_ >= kUnwrittenGrace) {
      return true;
    }
    const auto since = now - w.counted;
    w.nextLook = now +
        std::max<Clock::duration>(
                     kFirstLookAgain,
                     std::min<Clock::duration>(since, kUnwrittenGrace - since));
    return since >= kUnwrittenGrace;
  }
  // A joiner that asked in the other mode is told so: a request with a
  // passphrase is kRequestBytes, one without an X25519 key.
  const size_t otherMode =
      passphrase_.empty() ? kRequestBytes : X25519Key::kBytes;
  if (joiner->size() == otherMode) {
    const std::string_view why =
        passphrase_.empty() ? kRefusedPassphrase : kRefusedNoPassphrase;
    store_->compareSet(sealedKey, {}, toBytes(std::string(why)));
    return true;
  }
  if (!passphrase_.empty()) {
    return offerProof(n, w, now, *joiner);
  }
  X25519Key mine; // fresh per request: each pair seals once
  bool landed = false;
  try {
    std::string value =
        mine.publicKey() +
        sealFor(
            sealKey(mine, *joiner, mine.publicKey(), *joiner, -n), secret, -n);
    const auto bytes = toBytes(value);
    landed = store_->compareSet(sealedKey, {}, bytes) == bytes;
  } catch (const std::exception& e) {
    logWarningLimited(
        "unusable_secret_request",
        "torch_rpc_ext: " + selfName_ +
            " skipped a request for the group secret whose public key is "
            "unusable (" +
            e.what() + "): something other than a joiner wrote it");
  }
  if (landed && !store_->check({requestKey})) {
    // Ours landed after the joiner had opened another member's answer,
    // joined and deleted both keys: nobody will read it.
    deleteUnneeded(*store_, sealedKey);
  }
  return true;
}

void SecretExchange::forgetRequest(int64_t epoch, int64_t n) const {
  // The request first: a member that then finds neither key lets it go.
  // (Every member of a group runs one version, docs/elastic.md. One from
  // before session 89 read a request with check() then get(), and a
  // request deleted between the two would hold it in that get() for the
  // store's timeout.)
  deleteUnneeded(*store_, dynKey(epoch, "request/" + std::to_string(n)));
  deleteUnneeded(*store_, dynKey(epoch, "sealed/" + std::to_string(n)));
  if (!passphrase_.empty()) {
    deleteUnneeded(*store_, dynKey(epoch, "confirm/" + std::to_string(n)));
    deleteUnneeded(*store_, dynKey(epoch, "answer/" + std::to_string(n)));
  }
}

bool SecretExchange::serve(const std::string& secret) {
  if (epoch_ < 0) {
    return false; // no dynamic group's secret: nothing of ours to seal
  }
  const int64_t asked = readCounter(*store_, dynKey(epoch_, "requests"));
  // (After the count: a request counted while we asked is timed from
  // here, no earlier than its joiner times it.)
  const auto now = Clock::now();
  if (asked > served_) {
    // The newest kMaxWaitingRequests at most: the count proves nothing
    // (anyone who can write the store can add to it), and one raised by
    // 10^12 once had every member list them all, out of memory.
    const int64_t from = std::max(
        served_ + 1, asked - static_cast<int64_t>(kMaxWaitingRequests) + 1);
    for (int64_t n = from;; ++n) {
      if (n != mine_) {
        waiting_.try_emplace(n, Waiting{now, now});
      }
      if (n == asked) {
        break; // (not n <= asked: asked may be the largest int64_t)
      }
    }
    served_ = asked;
  }
  // A request counted but not written (its joiner died between the two, or
  // has not written it yet) waits here without holding up those after it;
  // the oldest are let go, and any after kUnwrittenGrace.
  // (Not an exchange under way: at most kProofStrikes, which its joiner
  // would count as unanswered.)
  for (auto it = waiting_.begin();
       waiting_.size() > kMaxWaitingRequests && it != waiting_.end();) {
    it = it->second.proof ? std::next(it) : waiting_.erase(it);
  }
  bool exchanging = false;
  proofsInFlight_ = 0;
  for (const auto& [n, w] : waiting_) {
    proofsInFlight_ += w.proof != nullptr;
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (sealTo(it->first, it->second, now, secret)) {
      it = waiting_.erase(it);
    } else {
      exchanging = exchanging || it->second.proof != nullptr;
      ++it;
    }
  }
  waitingNow_.store(
      static_cast<int64_t>(waiting_.size()), std::memory_order_relaxed);
  heldOffNow_.store(
      !passphrase_.empty() && now < heldUntil_, std::memory_order_relaxed);
  return exchanging;
}

std::string SecretExchange::logPrefix() const {
  return epoch_ < 0 ? std::string() : "e" + std::to_string(epoch_) + "/";
}

size_t SecretExchange::liveMembers(
    int64_t secretEpoch,
    std::chrono::milliseconds lease,
    Clock::time_point now,
    std::map<uint64_t, Beat>& beats,
    const ListenerAnswers& answers) const {
  // A roster of our own, read from the epoch's log: nothing applied to the
  // view.
  MembershipLog log(store_, "", "e" + std::to_string(secretEpoch) + "/");
  Roster roster;
  auto [epoch, text] = log.latestSnapshot();
  if (epoch > 0) {
    roster.restore(epoch, text);
  }
  while (auto record = log.read(roster.epoch() + 1)) {
    roster.apply(record->body); // unproven: we hold no secret yet
  }
  // Listed, and its lease renewed within its own lease of our watching it
  // (a member that died without leaving stays listed until a member
  // declares it dead: there may be none left to). Its own, as the members
  // judge each other: judged by a joiner's shorter one, a live member that
  // renews every 2 s of a 10 s lease once looked dead to a joiner of 0.3 s,
  // which ended the epoch and made a second secret for the same group.
  size_t live = 0;
  std::vector<std::pair<const Member*, std::chrono::milliseconds>> lapsed;
  for (const auto& [rank, member] : roster.members()) {
    const int64_t count = log.beats(member.incarnation);
    auto [it, added] = beats.try_emplace(member.incarnation, Beat{count, now});
    if (!added && it->second.count != count) {
      it->second = Beat{count, now};
    }
    const auto its =
        member.leaseMs > 0 ? std::chrono::milliseconds(member.leaseMs) : lease;
    const auto quiet = now - it->second.since;
    if (quiet <= its) {
      ++live;
    } else if (quiet <= (1 + kMaxLeaseProbing) * its) {
      lapsed.emplace_back(&member, its);
    }
  }
  // Lapsed. A member whose listener still answers (a live process, perhaps
  // stopped: its kernel accepts for it) is kept for kMaxLeaseProbing more
  // leases, as the members keep each other (Group::checkLeases) and as a
  // joiner keeps the holder of its rank: judged by the lease alone, a
  // member stopped for two leases found the group started over without it.
  // Knocked on only while nobody else is alive, one answer enough.
  for (const auto& [member, its] : lapsed) {
    if (live > 0 || !answers) {
      break;
    }
    if (answers(
            member->name,
            member->offers,
            std::min<std::chrono::milliseconds>(
                its, std::chrono::milliseconds(500)))) {
      ++live;
    }
  }
  return live;
}

} // namespace torch_rpc_ext
