// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

struct evp_cipher_ctx_st; // OpenSSL's EVP_CIPHER_CTX (libcrypto.h)
struct evp_pkey_st; // OpenSSL's EVP_PKEY (libcrypto.h)

namespace torch_rpc_ext {

using Digest = std::array<uint8_t, 32>;

// HMAC-SHA256 (RFC 2104) of `message` under `key`, computed by OpenSSL's
// libcrypto (found at run time: csrc/common/libcrypto.h). Thread-safe.
// Throws std::runtime_error if libcrypto is unusable (see requireLibcrypto).
Digest hmacSha256(std::string_view key, std::string_view message);

// Throws std::runtime_error naming libcrypto, what was tried and how to fix
// it, unless hmacSha256 can work. Agent::create calls it first, so an absent
// libcrypto is an error at agent creation, never in a handshake.
void requireLibcrypto();

// Which libcrypto computes hmacSha256: "<OpenSSL version> (<file>)".
// Throws as requireLibcrypto does.
std::string libcryptoDescription();

// Compares two digests (or `n` bytes) in time independent of where they
// differ.
bool constantTimeEqual(const Digest& a, const Digest& b);
bool constantTimeEqual(const void* a, const void* b, size_t n);

// HKDF-Expand (RFC 5869, section 2.3) with HMAC-SHA256: `length` bytes (at
// most 255 * 32) of key material from the pseudorandom key `prk` (a key
// that is already uniformly random, such as one from randomBytes, needs no
// Extract step) for the purpose `info`. Throws as hmacSha256 does.
std::string hkdfExpand(
    std::string_view prk,
    std::string_view info,
    size_t length);

// AES-128-GCM under one key (RFC 5116 AEAD_AES_128_GCM): the records of
// the lanes channel (channel/lanes). Computed by our own VAES code
// (aes_gcm_vaes.h) where the CPU has it, else by libcrypto's EVP;
// TORCH_RPC_EXT_AES_GCM=libcrypto or =vaes picks one (see Engine). One
// object per thread (it keeps its cipher state between records); a nonce
// must never repeat under a key, which the caller's counters see to.
class Aead {
 public:
  static constexpr size_t kKeyBytes = 16;
  static constexpr size_t kNonceBytes = 12;
  static constexpr size_t kTagBytes = 16;
  // Which code computes the cipher. Both give the same bytes and tags
  // (tests/unit/test_crypto_and_frames.py), so the two ends of a lane need
  // not agree on it.
  enum class Engine {
    kAuto, // defaultEngine()
    kLibcrypto,
    kVaes, // aes_gcm_vaes.h; std::runtime_error where the CPU lacks it
  };
  // Throws std::invalid_argument for a key of the wrong size, and
  // std::runtime_error if the engine cannot run here (libcrypto without
  // AES-GCM, a CPU without VAES).
  explicit Aead(std::string_view key, Engine engine = Engine::kAuto);
  ~Aead();
  Aead(const Aead&) = delete;
  Aead& operator=(const Aead&) = delete;

  // What kAuto is in this process: TORCH_RPC_EXT_AES_GCM ("auto", the
  // default: kVaes where aes_gcm_vaes::supported(), else kLibcrypto;
  // "libcrypto"; "vaes"). Throws std::invalid_argument naming any other
  // value. Read on each call (a new Aead per lane key).
  static Engine defaultEngine();
  static const char* engineName(Engine engine); // "vaes", "libcrypto"
  Engine engine() const {
    return engine_;
  }

  // Encrypts `size` bytes of `in` into `out` (may be `in`), authenticating
  // `aad` with them, and writes the tag. Throws std::runtime_error, and
  // std::invalid_argument past GCM's 64 GiB - 32 bytes.
  void seal(
      const uint8_t* nonce,
      std::string_view aad,
      const void* in,
      void* out,
      size_t size,
      uint8_t* tag);
  // The reverse: false if the tag does not match (altered bytes, header or
  // nonce, or another key); then `out` holds garbage.
  bool open(
      const uint8_t* nonce,
      std::string_view aad,
      const void* in,
      void* out,
      size_t size,
      const uint8_t* tag);

 private:
  struct VaesKey; // aes_gcm_vaes::Schedule, wiped on destruction
  Engine engine_;
  evp_cipher_ctx_st* encrypt_ = nullptr; // kLibcrypto
  evp_cipher_ctx_st* decrypt_ = nullptr;
  std::unique_ptr<VaesKey> vaes_; // kVaes
};

// What X25519Key::agree throws for a peer's public key it refuses, as
// opposed to a failure of libcrypto's own.
class X25519PeerRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An X25519 key pair (RFC 7748) through libcrypto: the sealing of a
// group's secret at rendezvous (agent/group.cpp), and the scalar of a key
// exchange before TLS (cpace.h). Throws std::runtime_error if libcrypto has
// no X25519. Copies share the key; agree() may run on several threads.
class X25519Key {
 public:
  static constexpr size_t kBytes = 32;
  // A fresh key pair from the kernel CSPRNG.
  X25519Key();
  // The 32-byte public key.
  const std::string& publicKey() const {
    return public_;
  }
  // The shared secret with the holder of `peerPublic` (32 bytes). Throws
  // X25519PeerRefused for a key that is not 32 bytes, or one that gives an
  // all-zero secret (a point of small order): the peer's doing; a
  // std::runtime_error if libcrypto fails otherwise.
  std::string agree(const std::string& peerPublic) const;

 private:
  std::shared_ptr<evp_pkey_st> key_; // the private key, as libcrypto holds it
  std::string public_;
};

// `n` bytes from the kernel CSPRNG (getrandom(2)); throws std::runtime_error
// if the kernel cannot provide them.
std::string randomBytes(size_t n);

} // namespace torch_rpc_ext
