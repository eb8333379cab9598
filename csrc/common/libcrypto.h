// SPDX-License-Identifier: BSD-3-Clause
// OpenSSL's libcrypto, found at run time. The extension neither links it nor
// needs its headers: it dlopen()s the libcrypto the process already has
// (Python's _hashlib/_ssl load one), else libcrypto.so.3, libcrypto.so.1.1,
// libcrypto.so. Only crypto.cpp calls through it.
#pragma once

#include <cstddef>
#include <string>

// OpenSSL's own opaque name (EVP_MD), so the pointer types below are the
// ones its headers declare; libcrypto.cpp checks that where they exist.
struct evp_md_st;
struct evp_cipher_st;
struct evp_cipher_ctx_st;
struct engine_st;
struct evp_pkey_st;
struct evp_pkey_ctx_st;

namespace torch_rpc_ext {

struct Libcrypto {
  // HMAC(3), one-shot, as in OpenSSL 1.1 and 3.x.
  using HmacFn = unsigned char* (*)(
      const evp_md_st* md,
      const void* key,
      int keyLen,
      const unsigned char* data,
      size_t dataLen,
      unsigned char* out,
      unsigned int* outLen);

  HmacFn hmac = nullptr;
  const evp_md_st* sha256 = nullptr; // EVP_sha256()

  // AES-128-GCM through EVP (crypto.h, Aead): the lanes' records
  // (channel/lanes). All null if this libcrypto lacks any of them.
  using CipherCtxNewFn = evp_cipher_ctx_st* (*)();
  using CipherCtxFreeFn = void (*)(evp_cipher_ctx_st*);
  using CipherInitFn = int (*)(
      evp_cipher_ctx_st*,
      const evp_cipher_st*,
      engine_st*,
      const unsigned char* key,
      const unsigned char* iv);
  using CipherUpdateFn = int (*)(
      evp_cipher_ctx_st*,
      unsigned char* out,
      int* outLen,
      const unsigned char* in,
      int inLen);
  using CipherFinalFn =
      int (*)(evp_cipher_ctx_st*, unsigned char* out, int* outLen);
  using CipherCtrlFn = int (*)(evp_cipher_ctx_st*, int type, int arg, void*);
  CipherCtxNewFn cipherCtxNew = nullptr;
  CipherCtxFreeFn cipherCtxFree = nullptr;
  const evp_cipher_st* aes128Gcm = nullptr; // EVP_aes_128_gcm()
  CipherInitFn encryptInit = nullptr;
  CipherUpdateFn encryptUpdate = nullptr;
  CipherFinalFn encryptFinal = nullptr;
  CipherInitFn decryptInit = nullptr;
  CipherUpdateFn decryptUpdate = nullptr;
  CipherFinalFn decryptFinal = nullptr;
  CipherCtrlFn cipherCtrl = nullptr;

  // X25519 through EVP_PKEY (crypto.h, X25519Key): the sealing of a
  // group's secret at rendezvous. All null if this libcrypto lacks any.
  using NewRawKeyFn = evp_pkey_st* (*)(
      int type,
      engine_st*,
      const unsigned char* key,
      size_t keyLen);
  using GetRawKeyFn =
      int (*)(const evp_pkey_st*, unsigned char* out, size_t* len);
  using PkeyCtxNewFn = evp_pkey_ctx_st* (*)(evp_pkey_st*, engine_st*);
  using PkeyCtxFn = int (*)(evp_pkey_ctx_st*);
  using DeriveSetPeerFn = int (*)(evp_pkey_ctx_st*, evp_pkey_st*);
  using DeriveFn = int (*)(evp_pkey_ctx_st*, unsigned char*, size_t*);
  NewRawKeyFn newRawPrivateKey = nullptr;
  NewRawKeyFn newRawPublicKey = nullptr;
  GetRawKeyFn getRawPublicKey = nullptr;
  PkeyCtxNewFn pkeyCtxNew = nullptr;
  PkeyCtxFn deriveInit = nullptr;
  DeriveSetPeerFn deriveSetPeer = nullptr;
  DeriveFn derive = nullptr;
  void (*pkeyFree)(evp_pkey_st*) = nullptr;
  void (*pkeyCtxFree)(evp_pkey_ctx_st*) = nullptr;
  // "<OpenSSL_version text> (<file it was loaded from>)".
  std::string description;
  // Where that file is mapped (dladdr's dli_fbase): libssl must use this
  // one (libssl.cpp), so that one OpenSSL serves the process.
  const void* base = nullptr;
};

// The process's libcrypto, resolved on the first call only (thread-safe;
// never unloaded). Throws std::runtime_error naming libcrypto, every place
// tried and how to fix it, on this and every later call, if none is usable
// (absent, older than 1.1, LibreSSL, or missing HMAC/EVP_sha256). Only
// versioned names are tried (libcrypto.so.3, then .so.1.1), never the
// development symlink libcrypto.so, which may name any OpenSSL.
//
// TORCH_RPC_EXT_TEST_LIBCRYPTO=<path or name>, for tests only: try that
// instead (not the already-loaded one, not the usual names).
const Libcrypto& libcrypto();

} // namespace torch_rpc_ext
