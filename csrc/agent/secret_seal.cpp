// SPDX-License-Identifier: BSD-3-Clause
// The seals of a group's secret (secret_seal.h).
#include "csrc/agent/secret_seal.h"

#include <stdexcept>

namespace torch_rpc_ext::secret_seal {

namespace {

constexpr const char* kSealLabel = "torch_rpc_ext/seal/v1";
// What the passphrase exchange's key is drawn for (HMAC-SHA256 of these,
// and the request's epoch and number, under the key cpace::Exchange
// finishes with): no other use of that key shares one.
constexpr const char* kConfirmLabel = "torch_rpc_ext/dyn_secret/confirm/1";
constexpr const char* kAnswerLabel = "torch_rpc_ext/dyn_secret/answer/1";
constexpr const char* kExchangeLabel = "torch_rpc_ext/dyn_secret/cpace/1";

std::string slotText(int64_t epoch, int64_t n) {
  return std::to_string(epoch) + "/" + std::to_string(n);
}

std::string derive(
    const std::string& key,
    const char* label,
    int64_t epoch,
    int64_t n) {
  Digest d = hmacSha256(key, std::string(label) + slotText(epoch, n));
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

// AES-128-GCM under a key used once (nonce all zero), bound to `ad`.
std::string sealUnder(
    const std::string& key,
    const std::string& ad,
    const std::string& secret) {
  Aead aead(key.substr(0, Aead::kKeyBytes));
  const uint8_t nonce[Aead::kNonceBytes] = {};
  std::string out(secret.size() + Aead::kTagBytes, '\0');
  aead.seal(
      nonce,
      ad,
      secret.data(),
      out.data(),
      secret.size(),
      reinterpret_cast<uint8_t*>(out.data() + secret.size()));
  return out;
}

std::optional<std::string> openUnder(
    const std::string& key,
    const std::string& ad,
    std::string_view sealed) {
  if (sealed.size() != kAnswerBytes) {
    return std::nullopt;
  }
  Aead aead(key.substr(0, Aead::kKeyBytes));
  const uint8_t nonce[Aead::kNonceBytes] = {};
  std::string out(kSecretBytes, '\0');
  if (!aead.open(
          nonce,
          ad,
          sealed.data(),
          out.data(),
          kSecretBytes,
          reinterpret_cast<const uint8_t*>(sealed.data() + kSecretBytes))) {
    return std::nullopt;
  }
  return out;
}

} // namespace

std::string sealKey(
    const X25519Key& mine,
    const std::string& peerPublic,
    const std::string& pubMaker,
    const std::string& pubTaker,
    int64_t slot) {
  std::string shared = mine.agree(peerPublic);
  Digest d = hmacSha256(
      shared,
      std::string(kSealLabel) + pubMaker + pubTaker + std::to_string(slot));
  return std::string(reinterpret_cast<const char*>(d.data()), Aead::kKeyBytes);
}

std::string sealFor(
    const std::string& key,
    const std::string& secret,
    int64_t slot) {
  return sealUnder(key, std::string(kSealLabel) + std::to_string(slot), secret);
}

std::optional<std::string> openFor(
    const std::string& key,
    const std::string& sealed,
    int64_t slot) {
  return openUnder(key, std::string(kSealLabel) + std::to_string(slot), sealed);
}

std::string exchangeKey(std::string_view passphrase) {
  Digest d = hmacSha256(passphrase, kExchangeLabel);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

JoinerProof::JoinerProof(std::string_view passphrase, int64_t epoch, int64_t n)
    : epoch_(epoch),
      n_(n),
      exchange_(exchangeKey(passphrase), randomBytes(cpace::kSessionIdBytes)) {
  // (The session id is the nonce; Exchange keeps its own copy.)
  request_ = exchange_.sessionId() + exchange_.share();
}

std::optional<std::string> JoinerProof::confirm(std::string_view memberShare) {
  if (memberShare.size() != cpace::kShareBytes) {
    return std::nullopt;
  }
  try {
    key_ = exchange_.finish(memberShare, /*client=*/true);
  } catch (const std::runtime_error&) {
    return std::nullopt; // a small-order point: no member's
  }
  return derive(key_, kConfirmLabel, epoch_, n_);
}

std::optional<std::string> JoinerProof::open(std::string_view answer) const {
  if (key_.empty()) {
    return std::nullopt;
  }
  return openUnder(
      derive(key_, kAnswerLabel, epoch_, n_),
      std::string(kAnswerLabel) + slotText(epoch_, n_),
      answer);
}

MemberProof::MemberProof(
    std::string_view passphrase,
    int64_t epoch,
    int64_t n,
    std::string_view request)
    : epoch_(epoch),
      n_(n),
      joinerShare_(
          request.size() == kRequestBytes
              ? request.substr(cpace::kSessionIdBytes)
              : throw std::invalid_argument(
                    "a request of " + std::to_string(request.size()) +
                    " bytes where one of " + std::to_string(kRequestBytes) +
                    " was expected")),
      exchange_(
          exchangeKey(passphrase),
          std::string(request.substr(0, cpace::kSessionIdBytes))) {}

std::optional<std::string> MemberProof::answer(
    std::string_view confirmation,
    const std::string& secret) const {
  if (confirmation.size() != kConfirmBytes) {
    return std::nullopt;
  }
  std::string key;
  try {
    key = exchange_.finish(joinerShare_, /*client=*/false);
  } catch (const std::runtime_error&) {
    return std::nullopt; // the joiner's share was a small-order point
  }
  const std::string want = derive(key, kConfirmLabel, epoch_, n_);
  if (!constantTimeEqual(want.data(), confirmation.data(), kConfirmBytes)) {
    return std::nullopt;
  }
  return sealUnder(
      derive(key, kAnswerLabel, epoch_, n_),
      std::string(kAnswerLabel) + slotText(epoch_, n_),
      secret);
}

} // namespace torch_rpc_ext::secret_seal
