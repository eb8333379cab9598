// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/libssl.h"

#include <dlfcn.h>

#include <cstdlib>
#include <stdexcept>
#include <type_traits>

#if __has_include(<openssl/ssl.h>)
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
// Where the headers exist, our declarations must be theirs.
#define TORCH_RPC_EXT_SAME_TYPE(field, fn) \
  static_assert(                           \
      std::is_same_v<decltype(torch_rpc_ext::Libssl::field), decltype(&::fn)>)
TORCH_RPC_EXT_SAME_TYPE(TLS_method, TLS_method);
TORCH_RPC_EXT_SAME_TYPE(SSL_CTX_new, SSL_CTX_new);
TORCH_RPC_EXT_SAME_TYPE(SSL_CTX_ctrl, SSL_CTX_ctrl);
TORCH_RPC_EXT_SAME_TYPE(SSL_CTX_set_ciphersuites, SSL_CTX_set_ciphersuites);
TORCH_RPC_EXT_SAME_TYPE(SSL_CTX_set_num_tickets, SSL_CTX_set_num_tickets);
TORCH_RPC_EXT_SAME_TYPE(
    SSL_CTX_set_psk_use_session_callback,
    SSL_CTX_set_psk_use_session_callback);
TORCH_RPC_EXT_SAME_TYPE(
    SSL_CTX_set_psk_find_session_callback,
    SSL_CTX_set_psk_find_session_callback);
TORCH_RPC_EXT_SAME_TYPE(SSL_CTX_set_verify, SSL_CTX_set_verify);
TORCH_RPC_EXT_SAME_TYPE(SSL_set_verify, SSL_set_verify);
TORCH_RPC_EXT_SAME_TYPE(SSL_read_ex, SSL_read_ex);
TORCH_RPC_EXT_SAME_TYPE(SSL_write_ex, SSL_write_ex);
TORCH_RPC_EXT_SAME_TYPE(SSL_CIPHER_find, SSL_CIPHER_find);
TORCH_RPC_EXT_SAME_TYPE(SSL_key_update, SSL_key_update);
TORCH_RPC_EXT_SAME_TYPE(
    SSL_SESSION_set1_master_key,
    SSL_SESSION_set1_master_key);
TORCH_RPC_EXT_SAME_TYPE(X509_NAME_oneline, X509_NAME_oneline);
TORCH_RPC_EXT_SAME_TYPE(X509_get_ext_d2i, X509_get_ext_d2i);
TORCH_RPC_EXT_SAME_TYPE(OPENSSL_sk_num, OPENSSL_sk_num);
TORCH_RPC_EXT_SAME_TYPE(OPENSSL_sk_value, OPENSSL_sk_value);
TORCH_RPC_EXT_SAME_TYPE(GENERAL_NAMES_free, GENERAL_NAMES_free);
TORCH_RPC_EXT_SAME_TYPE(ASN1_STRING_get0_data, ASN1_STRING_get0_data);
TORCH_RPC_EXT_SAME_TYPE(ASN1_STRING_length, ASN1_STRING_length);
TORCH_RPC_EXT_SAME_TYPE(ERR_error_string_n, ERR_error_string_n);
TORCH_RPC_EXT_SAME_TYPE(SSL_set_bio, SSL_set_bio);
TORCH_RPC_EXT_SAME_TYPE(BIO_meth_new, BIO_meth_new);
TORCH_RPC_EXT_SAME_TYPE(BIO_meth_set_write_ex, BIO_meth_set_write_ex);
TORCH_RPC_EXT_SAME_TYPE(BIO_meth_set_ctrl, BIO_meth_set_ctrl);
TORCH_RPC_EXT_SAME_TYPE(BIO_meth_set_create, BIO_meth_set_create);
TORCH_RPC_EXT_SAME_TYPE(BIO_new, BIO_new);
TORCH_RPC_EXT_SAME_TYPE(BIO_new_socket, BIO_new_socket);
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
TORCH_RPC_EXT_SAME_TYPE(SSL_CTX_set_options, SSL_CTX_set_options);
TORCH_RPC_EXT_SAME_TYPE(SSL_get1_peer_certificate, SSL_get1_peer_certificate);
#endif
#undef TORCH_RPC_EXT_SAME_TYPE
#endif

#include "csrc/common/dl_error.h"
#include "csrc/common/libcrypto.h"

namespace torch_rpc_ext {

namespace {

constexpr const char* kLibsslTestEnv = "TORCH_RPC_EXT_TEST_LIBSSL";
// Never the unversioned development symlink (see libcrypto.cpp). The one
// of our libcrypto's version first, so that the other (which would load a
// second libcrypto, to be refused) is tried only if that one is absent.
constexpr const char* kLibsslNames[] = {"libssl.so.3", "libssl.so.1.1"};
constexpr const char* kLibsslNames11[] = {"libssl.so.1.1", "libssl.so.3"};
// OpenSSL_version_num() of 1.1.1: TLS 1.3 and its PSK callbacks.
constexpr unsigned long kLibsslMinVersion = 0x10101000UL;

// Resolves `name` into `fn`; false (adding the name to `missing`) if absent.
template <typename Fn>
bool resolveSsl(void* handle, const char* name, Fn& fn, std::string& missing) {
  fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (fn == nullptr) {
    missing += std::string(missing.empty() ? "" : ", ") + name;
    return false;
  }
  return true;
}

// Fills `out` from `handle`, a libssl that must use `ours`; "" on success,
// else why this one is unusable.
std::string bindSsl(void* handle, const Libcrypto& ours, Libssl& out) {
  using VersionFn = unsigned long (*)();
  using VersionTextFn = const char* (*)(int);
  auto version =
      reinterpret_cast<VersionFn>(dlsym(handle, "OpenSSL_version_num"));
  if (version == nullptr) {
    return "no OpenSSL_version_num (OpenSSL older than 1.1, or not libssl)";
  }
  if (version() < kLibsslMinVersion) {
    return "OpenSSL older than 1.1.1 (no TLS 1.3)";
  }
  // Its libcrypto (where its OpenSSL_version_num comes from) must be the
  // one the handshake's HMAC and the lanes' AES-GCM use: two OpenSSLs in
  // one process each keep their own state (their error queues, their
  // providers), and a structure of one passed to the other breaks.
  Dl_info mine;
  if (dladdr(reinterpret_cast<void*>(version), &mine) == 0 ||
      mine.dli_fbase != ours.base) {
    return std::string("its libcrypto is ") +
        (mine.dli_fname != nullptr ? mine.dli_fname : "unknown") +
        ", not the one this process uses (" + ours.description +
        "): two OpenSSLs in one process are refused";
  }
  std::string missing;
#define TORCH_RPC_EXT_RESOLVE(fn) resolveSsl(handle, #fn, out.fn, missing)
  TORCH_RPC_EXT_RESOLVE(TLS_method);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_new);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_free);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_ctrl);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_options);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_ciphersuites);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_num_tickets);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_psk_use_session_callback);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_psk_find_session_callback);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_use_certificate_chain_file);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_use_PrivateKey_file);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_check_private_key);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_load_verify_locations);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_verify);
  TORCH_RPC_EXT_RESOLVE(SSL_set_verify);
  TORCH_RPC_EXT_RESOLVE(SSL_new);
  TORCH_RPC_EXT_RESOLVE(SSL_free);
  TORCH_RPC_EXT_RESOLVE(SSL_set_bio);
  TORCH_RPC_EXT_RESOLVE(SSL_CTX_set_default_read_buffer_len);
  TORCH_RPC_EXT_RESOLVE(BIO_get_new_index);
  TORCH_RPC_EXT_RESOLVE(BIO_meth_new);
  TORCH_RPC_EXT_RESOLVE(BIO_meth_set_write_ex);
  TORCH_RPC_EXT_RESOLVE(BIO_meth_set_ctrl);
  TORCH_RPC_EXT_RESOLVE(BIO_meth_set_create);
  TORCH_RPC_EXT_RESOLVE(BIO_new);
  TORCH_RPC_EXT_RESOLVE(BIO_free);
  TORCH_RPC_EXT_RESOLVE(BIO_set_data);
  TORCH_RPC_EXT_RESOLVE(BIO_get_data);
  TORCH_RPC_EXT_RESOLVE(BIO_set_init);
  TORCH_RPC_EXT_RESOLVE(BIO_new_socket);
  TORCH_RPC_EXT_RESOLVE(SSL_set_connect_state);
  TORCH_RPC_EXT_RESOLVE(SSL_set_accept_state);
  TORCH_RPC_EXT_RESOLVE(SSL_set_ex_data);
  TORCH_RPC_EXT_RESOLVE(SSL_get_ex_data);
  TORCH_RPC_EXT_RESOLVE(SSL_do_handshake);
  TORCH_RPC_EXT_RESOLVE(SSL_read_ex);
  TORCH_RPC_EXT_RESOLVE(SSL_write_ex);
  TORCH_RPC_EXT_RESOLVE(SSL_get_error);
  TORCH_RPC_EXT_RESOLVE(SSL_get_version);
  TORCH_RPC_EXT_RESOLVE(SSL_get_current_cipher);
  TORCH_RPC_EXT_RESOLVE(SSL_CIPHER_get_name);
  TORCH_RPC_EXT_RESOLVE(SSL_CIPHER_find);
  TORCH_RPC_EXT_RESOLVE(SSL_session_reused);
  TORCH_RPC_EXT_RESOLVE(SSL_export_keying_material);
  TORCH_RPC_EXT_RESOLVE(SSL_key_update);
  TORCH_RPC_EXT_RESOLVE(SSL_get_verify_result);
  TORCH_RPC_EXT_RESOLVE(SSL_SESSION_new);
  TORCH_RPC_EXT_RESOLVE(SSL_SESSION_free);
  TORCH_RPC_EXT_RESOLVE(SSL_SESSION_set1_master_key);
  TORCH_RPC_EXT_RESOLVE(SSL_SESSION_set_cipher);
  TORCH_RPC_EXT_RESOLVE(SSL_SESSION_set_protocol_version);
  TORCH_RPC_EXT_RESOLVE(X509_get_subject_name);
  TORCH_RPC_EXT_RESOLVE(X509_NAME_oneline);
  TORCH_RPC_EXT_RESOLVE(X509_free);
  TORCH_RPC_EXT_RESOLVE(X509_get_ext_d2i);
  TORCH_RPC_EXT_RESOLVE(OPENSSL_sk_num);
  TORCH_RPC_EXT_RESOLVE(OPENSSL_sk_value);
  TORCH_RPC_EXT_RESOLVE(GENERAL_NAMES_free);
  TORCH_RPC_EXT_RESOLVE(ASN1_STRING_get0_data);
  TORCH_RPC_EXT_RESOLVE(ASN1_STRING_length);
  TORCH_RPC_EXT_RESOLVE(X509_NAME_get_text_by_NID);
  TORCH_RPC_EXT_RESOLVE(X509_verify_cert_error_string);
  TORCH_RPC_EXT_RESOLVE(ERR_get_error);
  TORCH_RPC_EXT_RESOLVE(ERR_error_string_n);
  TORCH_RPC_EXT_RESOLVE(ERR_clear_error);
#undef TORCH_RPC_EXT_RESOLVE
  // 3.x renamed it (the old name is a macro there); 1.1.1 has the old one.
  std::string oldName;
  if (!resolveSsl(
          handle,
          "SSL_get1_peer_certificate",
          out.SSL_get1_peer_certificate,
          oldName) &&
      !resolveSsl(
          handle,
          "SSL_get_peer_certificate",
          out.SSL_get1_peer_certificate,
          oldName)) {
    missing += (missing.empty() ? "" : ", ") + oldName;
  }
  if (!missing.empty()) {
    return "missing " + missing;
  }
  auto text = reinterpret_cast<VersionTextFn>(dlsym(handle, "OpenSSL_version"));
  out.description = text != nullptr ? text(0) : "OpenSSL";
  if (out.description.rfind("LibreSSL", 0) == 0) {
    return out.description + ": LibreSSL is not supported";
  }
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(out.SSL_new), &info) != 0 &&
      info.dli_fname != nullptr) {
    out.description += std::string(" (") + info.dli_fname + ")";
  }
  return "";
}

Libssl loadSsl(std::string& error) {
  Libssl out;
  std::string tried;
  const Libcrypto* ours = nullptr;
  try {
    ours = &libcrypto();
  } catch (const std::exception& e) {
    error = e.what();
    return Libssl{};
  }
  auto bind = [&](void* handle) {
    std::string why = bindSsl(handle, *ours, out);
    if (!why.empty()) {
      out = Libssl{};
    }
    return why;
  };
  // The one Python's ssl module loaded, if any, first.
  const bool ours11 =
      ours->description.find("libcrypto.so.1.1") != std::string::npos;
  if (loadFirstUsable(
          std::getenv(kLibsslTestEnv),
          kLibsslTestEnv,
          ours11 ? kLibsslNames11 : kLibsslNames,
          bind,
          tried)) {
    return out;
  }
  error =
      "torch_rpc_ext needs OpenSSL's libssl (1.1.1 or 3.x) to encrypt "
      "connections with TLS 1.3, from the same OpenSSL as the libcrypto "
      "this process uses (" +
      ours->description + "), and could not load it. Tried:" + tried +
      "\nFix: install that OpenSSL's libssl (Debian/Ubuntu: libssl3; "
      "Fedora/RHEL: openssl-libs; conda: openssl), or put the directory "
      "holding its libssl.so.3 on LD_LIBRARY_PATH; or, where every link is "
      "private, RpcExtBackendOptions(encryption=\"off\").";
  return Libssl{};
}

struct LoadedLibssl {
  LoadedLibssl() : lib(loadSsl(error)) {}
  std::string error;
  Libssl lib;
};

} // namespace

const Libssl& libssl() {
  static const LoadedLibssl loaded; // Once, thread-safe.
  if (loaded.lib.SSL_new == nullptr) {
    throw std::runtime_error(loaded.error);
  }
  return loaded.lib;
}

} // namespace torch_rpc_ext
