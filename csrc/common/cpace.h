// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// A password-authenticated key exchange: CPace (draft-irtf-cfrg-cpace) over
// X25519, from which a TLS connection keyed by the group's secret takes its
// pre-shared key (docs/security.md, "The key exchange before TLS").
//
// Why: TLS 1.3's PSK mode is no password-authenticated exchange. A
// ClientHello carries its PSK binder in the clear, an HMAC under a key
// derived from the PSK alone, so with one PSK per group a tap that recorded
// one connection could test guesses at a user's passphrase offline. Here
// each connection's PSK comes from an exchange a recording gives nothing
// to test against:
//
//   g   = Elligator2(HMAC-SHA256(groupKey, kGeneratorLabel || sid))
//   Y_i = X25519(y_i, g)            y_i: a fresh random scalar per end
//   K   = X25519(y_a, Y_b) = X25519(y_b, Y_a)
//   psk = HMAC-SHA256(K, kKeyLabel || sid || Y_client || Y_server)
//
// The shares look alike under every key (a point made from a secret scalar
// times a generator nobody knows a logarithm of): a guess at the group's key
// gives a guesser a generator, and with it nothing to check a recorded
// share against. Whoever runs the exchange with one guessed key learns
// whether that one guess was right (the TLS handshake that follows fails or
// not): a client, one guess per connection, which the hold-off on refused
// sources paces (source_strikes.h); an impostor server a client was sent
// to, one per connection the client makes to it, which the client paces
// alike (StreamTransport's server strikes).
//
// Not the draft's byte encoding (HMAC-SHA256 where it hashes with SHA-512,
// our labels): its construction, on the same curve and map. X25519 itself is
// libcrypto's (crypto.h); the map is computed here in constant time (field
// arithmetic on 51-bit limbs; the only branch is on the public exponent).

#include <cstddef>
#include <string>
#include <string_view>

#include "csrc/common/crypto.h"

namespace torch_rpc_ext::cpace {

constexpr size_t kShareBytes = 32;
constexpr size_t kSessionIdBytes = 16;
constexpr const char* kGeneratorLabel = "torch_rpc_ext/cpace/1/generator";
constexpr const char* kKeyLabel = "torch_rpc_ext/cpace/1/key";

// Elligator 2 (RFC 9380, section 6.7.1, Curve25519: J = 486662, K = 1,
// Z = 2): the u-coordinate (32 bytes, little-endian, canonical) of the
// point the field element `r` maps to. `r` is 32 bytes, little-endian; its
// top bit is ignored and the rest reduced modulo 2^255 - 19. Throws
// std::invalid_argument for another size.
std::string mapToCurve25519(std::string_view r);

// The generator of a session: the map of HMAC-SHA256(key,
// kGeneratorLabel || sessionId).
std::string generator(std::string_view key, std::string_view sessionId);

// One end of one exchange: a fresh scalar, its share. Not thread-safe; used
// once. Throws std::runtime_error where libcrypto cannot do X25519.
class Exchange {
 public:
  Exchange(std::string_view key, std::string sessionId);
  // Y = X25519(y, g): what this end sends (kShareBytes).
  const std::string& share() const {
    return share_;
  }
  const std::string& sessionId() const {
    return sessionId_;
  }
  // The key both ends derive (32 bytes), from the peer's share; `client`:
  // whether this end began the exchange (its share goes first in the
  // transcript). Throws std::runtime_error for a share that is not 32
  // bytes or that libcrypto refuses (a small-order point: an all-zero
  // secret), which no honest peer sends.
  std::string finish(std::string_view peerShare, bool client) const;

 private:
  const std::string sessionId_;
  const X25519Key scalar_; // its own public key (y * 9) is not used
  std::string share_;
};

} // namespace torch_rpc_ext::cpace
