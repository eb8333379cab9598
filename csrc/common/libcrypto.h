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
  // "<OpenSSL_version text> (<file it was loaded from>)".
  std::string description;
};

// The process's libcrypto, resolved on the first call only (thread-safe;
// never unloaded). Throws std::runtime_error naming libcrypto, every place
// tried and how to fix it, on this and every later call, if none is usable
// (absent, older than 1.1, or missing HMAC/EVP_sha256).
//
// TORCH_RPC_EXT_TEST_LIBCRYPTO=<path or name>, for tests only: try that
// instead (not the already-loaded one, not the usual names).
const Libcrypto& libcrypto();

} // namespace torch_rpc_ext
