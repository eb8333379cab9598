// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/libcrypto.h"

#include <dlfcn.h>

#include <cstdlib>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if __has_include(<openssl/hmac.h>)
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
// Where the headers exist, our declarations must be theirs.
static_assert(
    std::is_same_v<torch_rpc_ext::Libcrypto::HmacFn, decltype(&::HMAC)>);
static_assert(std::is_same_v<const evp_md_st* (*)(), decltype(&::EVP_sha256)>);
static_assert(
    std::is_same_v<unsigned long (*)(), decltype(&::OpenSSL_version_num)>);
static_assert(std::is_same_v<
              torch_rpc_ext::Libcrypto::CipherInitFn,
              decltype(&::EVP_EncryptInit_ex)>);
static_assert(std::is_same_v<
              torch_rpc_ext::Libcrypto::CipherUpdateFn,
              decltype(&::EVP_DecryptUpdate)>);
static_assert(std::is_same_v<
              torch_rpc_ext::Libcrypto::CipherFinalFn,
              decltype(&::EVP_EncryptFinal_ex)>);
static_assert(std::is_same_v<
              torch_rpc_ext::Libcrypto::CipherCtrlFn,
              decltype(&::EVP_CIPHER_CTX_ctrl)>);
#endif

#include "csrc/common/dl_error.h"

namespace torch_rpc_ext {

namespace {

constexpr const char* kTestOverrideEnv = "TORCH_RPC_EXT_TEST_LIBCRYPTO";
// Newest first; never the unversioned development symlink (any OpenSSL,
// or another library altogether, may sit behind it).
constexpr const char* kNames[] = {"libcrypto.so.3", "libcrypto.so.1.1"};
// OpenSSL_version_num() of 1.1.0: HMAC() and EVP_sha256() as declared.
constexpr unsigned long kMinVersion = 0x10100000UL;
constexpr int kOpensslVersionText = 0; // OPENSSL_VERSION

// The AEAD entry points, all or none (OpenSSL 1.1 and 3.x have them all).
void bindAead(void* handle, Libcrypto& out) {
  using CipherFn = const evp_cipher_st* (*)();
  Libcrypto l;
  auto sym = [&](const char* name) { return dlsym(handle, name); };
  l.cipherCtxNew =
      reinterpret_cast<Libcrypto::CipherCtxNewFn>(sym("EVP_CIPHER_CTX_new"));
  l.cipherCtxFree =
      reinterpret_cast<Libcrypto::CipherCtxFreeFn>(sym("EVP_CIPHER_CTX_free"));
  auto gcm = reinterpret_cast<CipherFn>(sym("EVP_aes_128_gcm"));
  l.encryptInit =
      reinterpret_cast<Libcrypto::CipherInitFn>(sym("EVP_EncryptInit_ex"));
  l.encryptUpdate =
      reinterpret_cast<Libcrypto::CipherUpdateFn>(sym("EVP_EncryptUpdate"));
  l.encryptFinal =
      reinterpret_cast<Libcrypto::CipherFinalFn>(sym("EVP_EncryptFinal_ex"));
  l.decryptInit =
      reinterpret_cast<Libcrypto::CipherInitFn>(sym("EVP_DecryptInit_ex"));
  l.decryptUpdate =
      reinterpret_cast<Libcrypto::CipherUpdateFn>(sym("EVP_DecryptUpdate"));
  l.decryptFinal =
      reinterpret_cast<Libcrypto::CipherFinalFn>(sym("EVP_DecryptFinal_ex"));
  l.cipherCtrl =
      reinterpret_cast<Libcrypto::CipherCtrlFn>(sym("EVP_CIPHER_CTX_ctrl"));
  if (!l.cipherCtxNew || !l.cipherCtxFree || !gcm || !l.encryptInit ||
      !l.encryptUpdate || !l.encryptFinal || !l.decryptInit ||
      !l.decryptUpdate || !l.decryptFinal || !l.cipherCtrl) {
    return;
  }
  l.aes128Gcm = gcm();
  if (l.aes128Gcm == nullptr) {
    return;
  }
  out.cipherCtxNew = l.cipherCtxNew;
  out.cipherCtxFree = l.cipherCtxFree;
  out.aes128Gcm = l.aes128Gcm;
  out.encryptInit = l.encryptInit;
  out.encryptUpdate = l.encryptUpdate;
  out.encryptFinal = l.encryptFinal;
  out.decryptInit = l.decryptInit;
  out.decryptUpdate = l.decryptUpdate;
  out.decryptFinal = l.decryptFinal;
  out.cipherCtrl = l.cipherCtrl;
}

// The X25519 entry points, all or none (OpenSSL 1.1.1 and 3.x).
void bindX25519(void* handle, Libcrypto& out) {
  Libcrypto l;
  auto sym = [&](const char* name) { return dlsym(handle, name); };
  l.newRawPrivateKey = reinterpret_cast<Libcrypto::NewRawKeyFn>(
      sym("EVP_PKEY_new_raw_private_key"));
  l.newRawPublicKey = reinterpret_cast<Libcrypto::NewRawKeyFn>(
      sym("EVP_PKEY_new_raw_public_key"));
  l.getRawPublicKey = reinterpret_cast<Libcrypto::GetRawKeyFn>(
      sym("EVP_PKEY_get_raw_public_key"));
  l.pkeyCtxNew =
      reinterpret_cast<Libcrypto::PkeyCtxNewFn>(sym("EVP_PKEY_CTX_new"));
  l.deriveInit =
      reinterpret_cast<Libcrypto::PkeyCtxFn>(sym("EVP_PKEY_derive_init"));
  l.deriveSetPeer = reinterpret_cast<Libcrypto::DeriveSetPeerFn>(
      sym("EVP_PKEY_derive_set_peer"));
  l.derive = reinterpret_cast<Libcrypto::DeriveFn>(sym("EVP_PKEY_derive"));
  l.pkeyFree = reinterpret_cast<void (*)(evp_pkey_st*)>(sym("EVP_PKEY_free"));
  l.pkeyCtxFree =
      reinterpret_cast<void (*)(evp_pkey_ctx_st*)>(sym("EVP_PKEY_CTX_free"));
  if (!l.newRawPrivateKey || !l.newRawPublicKey || !l.getRawPublicKey ||
      !l.pkeyCtxNew || !l.deriveInit || !l.deriveSetPeer || !l.derive ||
      !l.pkeyFree || !l.pkeyCtxFree) {
    return;
  }
  out.newRawPrivateKey = l.newRawPrivateKey;
  out.newRawPublicKey = l.newRawPublicKey;
  out.getRawPublicKey = l.getRawPublicKey;
  out.pkeyCtxNew = l.pkeyCtxNew;
  out.deriveInit = l.deriveInit;
  out.deriveSetPeer = l.deriveSetPeer;
  out.derive = l.derive;
  out.pkeyFree = l.pkeyFree;
  out.pkeyCtxFree = l.pkeyCtxFree;
}

// Fills `out` from `handle`; "" on success, else why this one is unusable.
std::string bind(void* handle, Libcrypto& out) {
  using VersionFn = unsigned long (*)();
  using VersionTextFn = const char* (*)(int);
  using MdFn = const evp_md_st* (*)();
  auto version =
      reinterpret_cast<VersionFn>(dlsym(handle, "OpenSSL_version_num"));
  if (version == nullptr) {
    return "no OpenSSL_version_num (OpenSSL older than 1.1, or not libcrypto)";
  }
  if (version() < kMinVersion) {
    return "OpenSSL older than 1.1";
  }
  auto text = reinterpret_cast<VersionTextFn>(dlsym(handle, "OpenSSL_version"));
  std::string versionText = text != nullptr ? text(kOpensslVersionText) : "";
  if (versionText.rfind("LibreSSL", 0) == 0) {
    return versionText +
        ": LibreSSL is not supported (OpenSSL 1.1 or 3.x is; its TLS 1.3 "
        "pre-shared keys and exporter are what our handshake is tested on)";
  }
  auto hmac = reinterpret_cast<Libcrypto::HmacFn>(dlsym(handle, "HMAC"));
  auto md = reinterpret_cast<MdFn>(dlsym(handle, "EVP_sha256"));
  if (hmac == nullptr || md == nullptr) {
    return "no HMAC or EVP_sha256";
  }
  const evp_md_st* sha256 = md();
  if (sha256 == nullptr) {
    return "EVP_sha256() returned null";
  }
  out.hmac = hmac;
  out.sha256 = sha256;
  bindAead(handle, out);
  bindX25519(handle, out);
  out.description = versionText.empty() ? "OpenSSL" : versionText;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(hmac), &info) != 0 &&
      info.dli_fname != nullptr) {
    out.description += std::string(" (") + info.dli_fname + ")";
    out.base = info.dli_fbase;
  }
  return "";
}

// The Libcrypto to use, or one whose description is empty and whose
// `hmac` is null, with `error` saying why.
Libcrypto load(std::string& error) {
  Libcrypto out;
  std::string tried;
  auto usable = [&](void* handle) {
    std::string why = bind(handle, out);
    if (!why.empty()) {
      out = Libcrypto{};
    }
    return why;
  };
  if (loadFirstUsable(
          std::getenv(kTestOverrideEnv),
          kTestOverrideEnv,
          kNames,
          usable,
          tried)) {
    return out;
  }
  error =
      "torch_rpc_ext needs OpenSSL's libcrypto (1.1 or 3.x) for the "
      "HMAC-SHA256 of its connection handshake, and could not load it. "
      "Tried:" +
      tried +
      "\nFix: install OpenSSL's libcrypto (Debian/Ubuntu: libssl3; "
      "Fedora/RHEL: openssl-libs; conda: openssl), or put the directory "
      "holding libcrypto.so.3 on LD_LIBRARY_PATH.";
  return Libcrypto{};
}

struct LoadedLibcrypto {
  LoadedLibcrypto() : lib(load(error)) {}
  std::string error;
  Libcrypto lib;
};

} // namespace

const Libcrypto& libcrypto() {
  static const LoadedLibcrypto
      loaded; // Once, thread-safe (C++11 magic static).
  if (loaded.lib.hmac == nullptr) {
    throw std::runtime_error(loaded.error);
  }
  return loaded.lib;
}

} // namespace torch_rpc_ext
