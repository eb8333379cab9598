// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/crypto.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "csrc/common/aes_gcm_vaes.h"
#include "csrc/common/libcrypto.h"

namespace torch_rpc_ext {

Digest hmacSha256(std::string_view key, std::string_view message) {
  const Libcrypto& lib = libcrypto();
  if (key.size() > static_cast<size_t>(INT_MAX)) {
    throw std::invalid_argument("HMAC key longer than INT_MAX bytes");
  }
  // Never hand OpenSSL a null pointer, even for empty input.
  static const unsigned char kEmpty = 0;
  const void* k = key.empty() ? &kEmpty : static_cast<const void*>(key.data());
  const auto* m = message.empty()
      ? &kEmpty
      : reinterpret_cast<const unsigned char*>(message.data());
  Digest out;
  unsigned int size = 0;
  if (lib.hmac(
          lib.sha256,
          k,
          static_cast<int>(key.size()),
          m,
          message.size(),
          out.data(),
          &size) == nullptr ||
      size != out.size()) {
    throw std::runtime_error("libcrypto's HMAC-SHA256 failed");
  }
  return out;
}

void requireLibcrypto() {
  (void)libcrypto();
}

std::string libcryptoDescription() {
  return libcrypto().description;
}

bool constantTimeEqual(const Digest& a, const Digest& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= a[i] ^ b[i];
  }
  return diff == 0;
}

bool constantTimeEqual(const void* a, const void* b, size_t n) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) {
    diff |= x[i] ^ y[i];
  }
  return diff == 0;
}

std::string hkdfExpand(
    std::string_view prk,
    std::string_view info,
    size_t length) {
  if (length > 255 * sizeof(Digest)) {
    throw std::invalid_argument("hkdfExpand: more than 255 blocks asked for");
  }
  std::string out;
  std::string block; // T(i-1) || info || i
  for (uint8_t i = 1; out.size() < length; ++i) {
    block.append(info);
    block.push_back(static_cast<char>(i));
    Digest t = hmacSha256(prk, block);
    block.assign(reinterpret_cast<const char*>(t.data()), t.size());
    out.append(block);
  }
  out.resize(length);
  return out;
}

namespace {

// EVP_CIPHER_CTX_ctrl's GCM operations (openssl/evp.h).
constexpr int kCtrlGcmSetIvLen = 0x9;
constexpr int kCtrlGcmGetTag = 0x10;
constexpr int kCtrlGcmSetTag = 0x11;
// One EVP update at most this many bytes (its length is an int).
constexpr size_t kMaxUpdate = size_t(1) << 30;

const Libcrypto& aeadLibcrypto() {
  const Libcrypto& lib = libcrypto();
  if (lib.aes128Gcm == nullptr) {
    throw std::runtime_error(
        "libcrypto " + lib.description +
        " has no AES-128-GCM through EVP (EVP_aes_128_gcm and friends)");
  }
  return lib;
}

} // namespace

struct Aead::VaesKey {
  aes_gcm_vaes::Schedule schedule;
  ~VaesKey() {
    // Not memset: a store to memory about to be freed may be dropped.
    volatile uint8_t* p = reinterpret_cast<volatile uint8_t*>(&schedule);
    for (size_t i = 0; i < sizeof(schedule); ++i) {
      p[i] = 0;
    }
  }
};

namespace {

// The CPU runs our VAES code, unless a test says it does not
// (TORCH_RPC_EXT_TEST_NO_VAES=1: how a CPU without it behaves, on one with it).
bool vaesUsable() {
  const char* off = std::getenv("TORCH_RPC_EXT_TEST_NO_VAES");
  return aes_gcm_vaes::supported() && !(off != nullptr && off[0] == '1');
}

} // namespace

Aead::Engine Aead::defaultEngine() {
  const char* set = std::getenv("TORCH_RPC_EXT_AES_GCM");
  std::string value = set == nullptr ? "auto" : set;
  if (value == "auto" || value.empty()) {
    return vaesUsable() ? Engine::kVaes : Engine::kLibcrypto;
  }
  if (value == "libcrypto") {
    return Engine::kLibcrypto;
  }
  if (value == "vaes") {
    return Engine::kVaes;
  }
  throw std::invalid_argument(
      "TORCH_RPC_EXT_AES_GCM=" + value +
      ": expected auto (the default), libcrypto or vaes");
}

const char* Aead::engineName(Engine engine) {
  switch (engine) {
    case Engine::kVaes:
      return "vaes";
    case Engine::kLibcrypto:
      return "libcrypto";
    case Engine::kAuto:
      break;
  }
  return "auto";
}

Aead::Aead(std::string_view key, Engine engine)
    : engine_(engine == Engine::kAuto ? defaultEngine() : engine) {
  if (key.size() != kKeyBytes) {
    throw std::invalid_argument(
        "an AES-128-GCM key is 16 bytes, not " + std::to_string(key.size()));
  }
  const auto* k = reinterpret_cast<const unsigned char*>(key.data());
  if (engine_ == Engine::kVaes) {
    if (!vaesUsable()) {
      throw std::runtime_error(
          "AES-GCM on VAES (TORCH_RPC_EXT_AES_GCM=vaes) needs a CPU with "
          "AVX-512 F/BW/VL, VAES and VPCLMULQDQ, which this one lacks; "
          "leave TORCH_RPC_EXT_AES_GCM unset to use libcrypto's");
    }
    vaes_ = std::make_unique<VaesKey>();
    aes_gcm_vaes::expand(k, &vaes_->schedule);
    return;
  }
  const Libcrypto& lib = aeadLibcrypto();
  encrypt_ = lib.cipherCtxNew();
  decrypt_ = lib.cipherCtxNew();
  if (encrypt_ == nullptr || decrypt_ == nullptr ||
      lib.encryptInit(encrypt_, lib.aes128Gcm, nullptr, nullptr, nullptr) !=
          1 ||
      lib.cipherCtrl(encrypt_, kCtrlGcmSetIvLen, kNonceBytes, nullptr) != 1 ||
      lib.encryptInit(encrypt_, nullptr, nullptr, k, nullptr) != 1 ||
      lib.decryptInit(decrypt_, lib.aes128Gcm, nullptr, nullptr, nullptr) !=
          1 ||
      lib.cipherCtrl(decrypt_, kCtrlGcmSetIvLen, kNonceBytes, nullptr) != 1 ||
      lib.decryptInit(decrypt_, nullptr, nullptr, k, nullptr) != 1) {
    if (encrypt_ != nullptr) {
      lib.cipherCtxFree(encrypt_);
    }
    if (decrypt_ != nullptr) {
      lib.cipherCtxFree(decrypt_);
    }
    throw std::runtime_error("libcrypto could not set up AES-128-GCM");
  }
}

Aead::~Aead() {
  if (encrypt_ != nullptr || decrypt_ != nullptr) {
    const Libcrypto& lib = libcrypto();
    lib.cipherCtxFree(encrypt_);
    lib.cipherCtxFree(decrypt_);
  }
}

namespace {

// GCM's limit on one message (its 32-bit block counter).
void requireRecordSize(size_t size) {
  if (size > aes_gcm_vaes::kMaxBytes) {
    throw std::invalid_argument(
        "an AES-GCM record holds at most 64 GiB - 32 bytes, not " +
        std::to_string(size));
  }
}

// Starts a record under `nonce`, takes `aad`, then `size` bytes from `in`
// to `out` with `init`/`update` (the encrypting or the decrypting pair).
bool cryptRecord(
    evp_cipher_ctx_st* ctx,
    Libcrypto::CipherInitFn init,
    Libcrypto::CipherUpdateFn update,
    const uint8_t* nonce,
    std::string_view aad,
    const void* in,
    void* out,
    size_t size) {
  int n = 0;
  bool ok = init(ctx, nullptr, nullptr, nullptr, nonce) == 1;
  ok = ok &&
      (aad.empty() ||
       update(
           ctx,
           nullptr,
           &n,
           reinterpret_cast<const unsigned char*>(aad.data()),
           static_cast<int>(aad.size())) == 1);
  const auto* src = static_cast<const unsigned char*>(in);
  auto* dst = static_cast<unsigned char*>(out);
  for (size_t done = 0; ok && done < size;) {
    int len = static_cast<int>(std::min(size - done, kMaxUpdate));
    ok = update(ctx, dst + done, &n, src + done, len) == 1;
    done += static_cast<size_t>(len);
  }
  return ok;
}

} // namespace

void Aead::seal(
    const uint8_t* nonce,
    std::string_view aad,
    const void* in,
    void* out,
    size_t size,
    uint8_t* tag) {
  if (vaes_) {
    requireRecordSize(size);
    aes_gcm_vaes::seal(
        vaes_->schedule,
        nonce,
        reinterpret_cast<const uint8_t*>(aad.data()),
        aad.size(),
        static_cast<const uint8_t*>(in),
        static_cast<uint8_t*>(out),
        size,
        tag);
    return;
  }
  const Libcrypto& lib = libcrypto();
  int n = 0;
  unsigned char end[16];
  bool ok = cryptRecord(
                encrypt_,
                lib.encryptInit,
                lib.encryptUpdate,
                nonce,
                aad,
                in,
                out,
                size) &&
      lib.encryptFinal(encrypt_, end, &n) == 1 &&
      lib.cipherCtrl(encrypt_, kCtrlGcmGetTag, kTagBytes, tag) == 1;
  if (!ok) {
    throw std::runtime_error("libcrypto's AES-128-GCM encryption failed");
  }
}

bool Aead::open(
    const uint8_t* nonce,
    std::string_view aad,
    const void* in,
    void* out,
    size_t size,
    const uint8_t* tag) {
  if (vaes_) {
    if (size > aes_gcm_vaes::kMaxBytes) {
      return false; // no GCM record is this long
    }
    uint8_t expected[kTagBytes];
    aes_gcm_vaes::open(
        vaes_->schedule,
        nonce,
        reinterpret_cast<const uint8_t*>(aad.data()),
        aad.size(),
        static_cast<const uint8_t*>(in),
        static_cast<uint8_t*>(out),
        size,
        expected);
    return constantTimeEqual(expected, tag, kTagBytes);
  }
  const Libcrypto& lib = libcrypto();
  int n = 0;
  unsigned char end[16];
  return cryptRecord(
             decrypt_,
             lib.decryptInit,
             lib.decryptUpdate,
             nonce,
             aad,
             in,
             out,
             size) &&
      lib.cipherCtrl(
          decrypt_, kCtrlGcmSetTag, kTagBytes, const_cast<uint8_t*>(tag)) ==
      1 &&
      lib.decryptFinal(decrypt_, end, &n) == 1;
}

namespace {

constexpr int kNidX25519 = 1034; // NID_X25519, fixed in OpenSSL 1.1.1 and 3.x

const Libcrypto& x25519Crypto() {
  const Libcrypto& lib = libcrypto();
  if (lib.newRawPrivateKey == nullptr) {
    throw std::runtime_error(
        "the libcrypto in use (" + lib.description +
        ") has no X25519 (EVP_PKEY_new_raw_private_key and friends: OpenSSL "
        "1.1.1 or newer), which a group without a secret of its own needs "
        "to share one at rendezvous, and TLS under the group's key to key "
        "each connection");
  }
  return lib;
}

} // namespace

X25519Key::X25519Key() {
  const Libcrypto& lib = x25519Crypto();
  std::string scalar = randomBytes(kBytes);
  evp_pkey_st* key = lib.newRawPrivateKey(
      kNidX25519,
      nullptr,
      reinterpret_cast<const unsigned char*>(scalar.data()),
      scalar.size());
  std::fill(scalar.begin(), scalar.end(), '\0');
  if (key == nullptr) {
    throw std::runtime_error("X25519: EVP_PKEY_new_raw_private_key failed");
  }
  // Kept whole (libcrypto made its public key as it took it): each agree()
  // is one scalar multiplication, not two.
  key_.reset(key, [](evp_pkey_st* k) { libcrypto().pkeyFree(k); });
  public_.assign(kBytes, '\0');
  size_t len = public_.size();
  int ok = lib.getRawPublicKey(
      key, reinterpret_cast<unsigned char*>(public_.data()), &len);
  if (ok != 1 || len != kBytes) {
    throw std::runtime_error("X25519: EVP_PKEY_get_raw_public_key failed");
  }
}

std::string X25519Key::agree(const std::string& peerPublic) const {
  const Libcrypto& lib = x25519Crypto();
  if (peerPublic.size() != kBytes) {
    throw X25519PeerRefused(
        "X25519: a public key has " + std::to_string(peerPublic.size()) +
        " bytes, not 32");
  }
  evp_pkey_st* theirs = lib.newRawPublicKey(
      kNidX25519,
      nullptr,
      reinterpret_cast<const unsigned char*>(peerPublic.data()),
      peerPublic.size());
  evp_pkey_ctx_st* ctx = lib.pkeyCtxNew(key_.get(), nullptr);
  std::string out(kBytes, '\0');
  size_t len = out.size();
  // Ready to derive: libcrypto's part, whatever the peer's key.
  const bool ready = ctx && theirs && lib.deriveInit(ctx) == 1 &&
      lib.deriveSetPeer(ctx, theirs) == 1;
  const bool derived = ready &&
      lib.derive(ctx, reinterpret_cast<unsigned char*>(out.data()), &len) ==
          1 &&
      len == kBytes;
  if (ctx) {
    lib.pkeyCtxFree(ctx);
  }
  if (theirs) {
    lib.pkeyFree(theirs);
  }
  if (!ready) {
    throw std::runtime_error("X25519: libcrypto could not set up a derive");
  }
  // libcrypto refuses an all-zero result itself (RFC 7748, 6.1); checked
  // here too for any that does not.
  if (!derived || out == std::string(kBytes, '\0')) {
    throw X25519PeerRefused(
        "X25519: no shared secret with that public key (a point of small "
        "order)");
  }
  return out;
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw std::runtime_error(
          std::string("getrandom failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(got);
  }
  return out;
}

} // namespace torch_rpc_ext
