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
  if (!store_->check({dynKey(epoch_, "request/" + std::to_string(n))})) {
    // Ours landed after the joiner had given the request up and deleted
    // its keys: nobody will read it.
    deleteUnneeded(*store_, sealedKey);
    return true;
  }
  ++proofsInFlight_;
  w.proof = std::move(proof);
  w.counted = now; // from now on: since we answered
  w.nextLook = now;
  return false;
}

bool SecretExchange::answerProof(
    int64_t n,
    Waiting& w,
    Clock::time_point now,
    const std::string& secret) {
  if (now < heldUntil_) {
    // Held off since we answered it: not judged (a joiner's proof judged
    // now would be one guess more than the hold-off allows). The joiner
    // asks again after kUnwrittenGrace.
    return true;
  }
  const std::optional<std::string> confirmation =
      peekKey(*store_, dynKey(epoch_, "confirm/" + std::to_string(n)));
  if (!confirmation) {
    // The joiner has not confirmed yet, or went: it does within a poll of
    // our share (kSealPoll) or asks again after kUnwrittenGrace.
    return now - w.counted >= kUnwrittenGrace;
  }
  const std::string answerKey = dynKey(epoch_, "answer/" + std::to_string(n));
  std::optional<std::string> sealed = w.proof->answer(*confirmation, secret);
  if (!sealed) {
    refused(now); // (counted before the joiner can read its refusal)
  }
  if (!store_->check({dynKey(epoch_, "request/" + std::to_string(n))})) {
    return true; // the joiner gave it up: nobody will read an answer
  }
  store_->set(
      answerKey, toBytes(sealed ? *sealed : std::string(kRefusedProof)));
  return true;
}

void SecretExchange::refused(Clock::time_point now) {
  proofsRefused_.fetch_add(1, std::memory_order_relaxed);
  strikes_.push_back(now);
  while (now - strikes_.front() > kStrikeWindow) {
    strikes_.pop_front();
  }
  if (static_cast<int>(strikes_.size()) >= kProofStrikes) {
    strikes_.clear();
    heldUntil_ = now + kProofHoldOff;
    holdOffs_.fetch_add(1, std::memory_order_relaxed);
    logWarning(
        "torch_rpc_ext: " + selfName_ + " refused " +
        std::to_string(kProofStrikes) +
        " joiners' proofs of the group's passphrase within " +
        std::to_string(kStrikeWindow.count()) +
        " s: it answers no joiner "
        "for " +
        std::to_string(kProofHoldOff.count()) +
        " s (someone who can write the rendezvous store is guessing the "
        "passphrase, or workers were given another)");
  } else {
    logWarningLimited(
        "refused_secret_proof",
        "torch_rpc_ext: " + selfName_ +
            " refused a joiner's proof of the group's passphrase (a worker "
            "given another, or a guess written into the rendezvous store)");
  }
}

} // namespace torch_rpc_ext
