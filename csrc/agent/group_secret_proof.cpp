// SPDX-License-Identifier: BSD-3-Clause
// SecretExchange (group_secret.h): a passphrase of the user's proven to the
// member that answers a joiner (secret_seal.h), the member's part and its
// hold-off on refused proofs; group_secret.cpp has the rest.
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "csrc/agent/group_secret.h"
#include "csrc/agent/secret_seal.h"
#include "csrc/agent/store_bytes.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

using namespace secret_seal;

bool SecretExchange::Asking::unanswered(Clock::time_point now) const {
  return confirmed && now - confirmedAt >= kUnwrittenGrace;
}

bool SecretExchange::mayOffer(Clock::time_point now) {
  while (!strikes_.empty() && now - strikes_.front() > kStrikeWindow) {
    strikes_.pop_front();
  }
  // Exchanges under way count as strikes to come: a writer that posts many
  // requests at once, each a guess, has at most kProofStrikes judged before
  // the hold-off (it had every waiting request's, up to 256, judged).
  return now >= heldUntil_ &&
      proofsInFlight_ + strikes_.size() < static_cast<size_t>(kProofStrikes);
}

bool SecretExchange::offerProof(
    int64_t n,
    Waiting& w,
    Clock::time_point now,
    const std::string& request) {
  std::shared_ptr<MemberProof> proof;
  try {
    proof = std::make_shared<MemberProof>(passphrase_, epoch_, n, request);
  } catch (const std::exception& e) {
    logWarningLimited(
        "unusable_secret_request",
        "torch_rpc_ext: " + selfName_ +
            " skipped a request for the group secret it cannot answer (" +
            e.what() + "): something other than a joiner wrote it");
    return true;
  }
  // Our share alone: nothing keyed by the exchange until the joiner has
  // confirmed its key (secret_seal.h).
  const auto share = toBytes(proof->share());
  const std::string sealedKey = dynKey(epoch_, "sealed/" + std::to_string(n));
  if (store_->compareSet(sealedKey, {}, share) != share) {
    return true; // another member answered
  }
  ++proofsInFlight_;
  w.proof = std::move(proof); // (before the store can throw again)
  w.counted = now; // from now on: since we answered
  w.nextLook = now;
  if (!store_->check({dynKey(epoch_, "request/" + std::to_string(n))})) {
    // Ours landed after the joiner had given the request up and deleted
    // its keys: nobody will read it.
    deleteUnneeded(*store_, sealedKey);
    return true;
  }
  return false;
}

bool SecretExchange::answerProof(
    int64_t n,
    Waiting& w,
    Clock::time_point now,
    const std::string& secret) {
  const std::string answerKey = dynKey(epoch_, "answer/" + std::to_string(n));
  if (!w.answer) {
    if (now < heldUntil_) {
      // Held off since we answered it: not judged (a proof judged now
      // would be one guess more than the hold-off allows). Its joiner asks
      // again after kUnwrittenGrace.
      return true;
    }
    const std::optional<std::string> confirmation =
        peekKey(*store_, dynKey(epoch_, "confirm/" + std::to_string(n)));
    if (!confirmation) {
      // A joiner confirms within a poll of our share (kSealPoll). One that
      // has not within kConfirmWithin went, or was never a joiner: a
      // request written only to hold one of our kProofStrikes places
      // costs a strike, so that a flood of them shows as a hold-off rather
      // than keeping every joiner waiting unseen.
      if (now - w.counted < kConfirmWithin) {
        return false;
      }
      strike(Clock::now(), "left unconfirmed");
      return true;
    }
    std::optional<std::string> sealed = w.proof->answer(*confirmation, secret);
    if (!sealed) {
      proofsRefused_.fetch_add(1, std::memory_order_relaxed);
      strike(Clock::now(), "refused"); // (before the joiner reads it)
    }
    // Judged once: a store that fails below has us write it again.
    w.answer = sealed ? *sealed : std::string(kRefusedProof);
  }
  store_->set(answerKey, toBytes(*w.answer));
  if (!store_->check({dynKey(epoch_, "request/" + std::to_string(n))})) {
    // The joiner gave it up meanwhile: nobody will read it.
    deleteUnneeded(*store_, answerKey);
  }
  return true;
}

void SecretExchange::strike(Clock::time_point now, const char* what) {
  strikes_.push_back(now);
  while (now - strikes_.front() > kStrikeWindow) {
    strikes_.pop_front();
  }
  if (static_cast<int>(strikes_.size()) >= kProofStrikes) {
    strikes_.clear();
    heldUntil_ = now + kProofHoldOff;
    holdOffs_.fetch_add(1, std::memory_order_relaxed);
    logWarning(
        "torch_rpc_ext: " + selfName_ + ": " + std::to_string(kProofStrikes) +
        " exchanges proving the group's passphrase were refused or left "
        "unconfirmed within " +
        std::to_string(kStrikeWindow.count()) +
        " s: it answers no joiner for " +
        std::to_string(kProofHoldOff.count()) +
        " s (someone who can write the rendezvous store is guessing the "
        "passphrase or flooding requests, or workers were given another)");
  } else {
    logWarningLimited(
        "refused_secret_proof",
        "torch_rpc_ext: " + selfName_ + " " + what +
            " an exchange proving the group's passphrase (a worker given "
            "another, a joiner that died, or a guess written into the "
            "rendezvous store)");
  }
}

} // namespace torch_rpc_ext
