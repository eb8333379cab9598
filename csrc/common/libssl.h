// SPDX-License-Identifier: BSD-3-Clause
// OpenSSL's libssl, found at run time as libcrypto is (libcrypto.h): the
// extension neither links it nor needs its headers. It is loaded only by a
// process that opens an encrypted connection (csrc/transport/tls.cpp is its
// only caller), from the libssl of the libcrypto already in use, so the two
// always agree. TLS 1.3 needs OpenSSL 1.1.1 or 3.x.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// OpenSSL's own opaque names, so the pointer types below are the ones its
// headers declare; libssl.cpp checks that where they exist.
struct ssl_st;
struct ssl_ctx_st;
struct ssl_method_st;
struct ssl_cipher_st;
struct ssl_session_st;
struct x509_st;
struct X509_name_st;
struct evp_md_st;
struct x509_store_ctx_st;
struct bio_st;
struct bio_method_st;
struct stack_st;
struct stack_st_GENERAL_NAME;
struct asn1_string_st;

namespace torch_rpc_ext {

// The subset of libssl (and of the libcrypto below it) that tls.cpp uses.
// Names and signatures are OpenSSL's, minus the prefix.
struct Libssl {
  using SSL = ssl_st;
  using CTX = ssl_ctx_st;
  using UseSessionCb = int (*)(
      SSL*,
      const evp_md_st*,
      const unsigned char**,
      size_t*,
      ssl_session_st**);
  using FindSessionCb =
      int (*)(SSL*, const unsigned char*, size_t, ssl_session_st**);
  using VerifyCb = int (*)(int, x509_store_ctx_st*);

  const ssl_method_st* (*TLS_method)() = nullptr;
  CTX* (*SSL_CTX_new)(const ssl_method_st*) = nullptr;
  void (*SSL_CTX_free)(CTX*) = nullptr;
  long (*SSL_CTX_ctrl)(CTX*, int, long, void*) = nullptr;
  uint64_t (*SSL_CTX_set_options)(CTX*, uint64_t) = nullptr;
  int (*SSL_CTX_set_ciphersuites)(CTX*, const char*) = nullptr;
  int (*SSL_CTX_set_num_tickets)(CTX*, size_t) = nullptr;
  void (*SSL_CTX_set_psk_use_session_callback)(CTX*, UseSessionCb) = nullptr;
  void (*SSL_CTX_set_psk_find_session_callback)(CTX*, FindSessionCb) = nullptr;
  int (*SSL_CTX_use_certificate_chain_file)(CTX*, const char*) = nullptr;
  int (*SSL_CTX_use_PrivateKey_file)(CTX*, const char*, int) = nullptr;
  int (*SSL_CTX_check_private_key)(const CTX*) = nullptr;
  int (*SSL_CTX_load_verify_locations)(CTX*, const char*, const char*) =
      nullptr;
  void (*SSL_CTX_set_verify)(CTX*, int, VerifyCb) = nullptr;
  void (*SSL_set_verify)(SSL*, int, VerifyCb) = nullptr;
  SSL* (*SSL_new)(CTX*) = nullptr;
  void (*SSL_free)(SSL*) = nullptr;
  void (*SSL_set_bio)(SSL*, bio_st*, bio_st*) = nullptr;
  void (*SSL_CTX_set_default_read_buffer_len)(CTX*, size_t) = nullptr;
  void (*SSL_set_connect_state)(SSL*) = nullptr;
  void (*SSL_set_accept_state)(SSL*) = nullptr;
  int (*SSL_set_ex_data)(SSL*, int, void*) = nullptr;
  void* (*SSL_get_ex_data)(const SSL*, int) = nullptr;
  int (*SSL_do_handshake)(SSL*) = nullptr;
  int (*SSL_read_ex)(SSL*, void*, size_t, size_t*) = nullptr;
  int (*SSL_write_ex)(SSL*, const void*, size_t, size_t*) = nullptr;
  int (*SSL_get_error)(const SSL*, int) = nullptr;
  const char* (*SSL_get_version)(const SSL*) = nullptr;
  const ssl_cipher_st* (*SSL_get_current_cipher)(const SSL*) = nullptr;
  const char* (*SSL_CIPHER_get_name)(const ssl_cipher_st*) = nullptr;
  const ssl_cipher_st* (*SSL_CIPHER_find)(SSL*, const unsigned char*) = nullptr;
  int (*SSL_session_reused)(const SSL*) = nullptr;
  int (*SSL_key_update)(SSL*, int) = nullptr;
  int (*SSL_export_keying_material)(
      SSL*,
      unsigned char*,
      size_t,
      const char*,
      size_t,
      const unsigned char*,
      size_t,
      int) = nullptr;
  long (*SSL_get_verify_result)(const SSL*) = nullptr;
  // SSL_get1_peer_certificate in 3.x, SSL_get_peer_certificate in 1.1.1:
  // both return a reference the caller frees.
  x509_st* (*SSL_get1_peer_certificate)(const SSL*) = nullptr;
  ssl_session_st* (*SSL_SESSION_new)() = nullptr;
  void (*SSL_SESSION_free)(ssl_session_st*) = nullptr;
  int (*SSL_SESSION_set1_master_key)(
      ssl_session_st*,
      const unsigned char*,
      size_t) = nullptr;
  int (*SSL_SESSION_set_cipher)(ssl_session_st*, const ssl_cipher_st*) =
      nullptr;
  int (*SSL_SESSION_set_protocol_version)(ssl_session_st*, int) = nullptr;
  // libcrypto's, through libssl's handle.
  int (*BIO_get_new_index)() = nullptr;
  bio_method_st* (*BIO_meth_new)(int, const char*) = nullptr;
  int (*BIO_meth_set_write_ex)(
      bio_method_st*,
      int (*)(bio_st*, const char*, size_t, size_t*)) = nullptr;
  int (*BIO_meth_set_ctrl)(
      bio_method_st*,
      long (*)(bio_st*, int, long, void*)) = nullptr;
  int (*BIO_meth_set_create)(bio_method_st*, int (*)(bio_st*)) = nullptr;
  bio_st* (*BIO_new)(const bio_method_st*) = nullptr;
  int (*BIO_free)(bio_st*) = nullptr;
  void (*BIO_set_data)(bio_st*, void*) = nullptr;
  void* (*BIO_get_data)(bio_st*) = nullptr;
  void (*BIO_set_init)(bio_st*, int) = nullptr;
  bio_st* (*BIO_new_socket)(int, int) = nullptr;
  X509_name_st* (*X509_get_subject_name)(const x509_st*) = nullptr;
  char* (*X509_NAME_oneline)(const X509_name_st*, char*, int) = nullptr;
  void (*X509_free)(x509_st*) = nullptr;
  // A certificate's names, for tls_peer_names (transport/tls.cpp).
  void* (*X509_get_ext_d2i)(const x509_st*, int, int*, int*) = nullptr;
  int (*OPENSSL_sk_num)(const stack_st*) = nullptr;
  void* (*OPENSSL_sk_value)(const stack_st*, int) = nullptr;
  void (*GENERAL_NAMES_free)(stack_st_GENERAL_NAME*) = nullptr;
  const unsigned char* (*ASN1_STRING_get0_data)(const asn1_string_st*) =
      nullptr;
  int (*ASN1_STRING_length)(const asn1_string_st*) = nullptr;
  // (1.1.1's first parameter is not const; the same ABI.)
  int (*X509_NAME_get_text_by_NID)(const X509_name_st*, int, char*, int) =
      nullptr;
  const char* (*X509_verify_cert_error_string)(long) = nullptr;
  unsigned long (*ERR_get_error)() = nullptr;
  void (*ERR_error_string_n)(unsigned long, char*, size_t) = nullptr;
  void (*ERR_clear_error)() = nullptr;

  // "<OpenSSL version> (<file>)".
  std::string description;
};

// The process's libssl, resolved on the first call only (thread-safe; never
// unloaded). Throws std::runtime_error naming libssl, every place tried and
// how to fix it, on this and every later call, if none is usable (absent,
// older than 1.1.1, or missing a function above).
//
// TORCH_RPC_EXT_TEST_LIBSSL=<path or name>, for tests only: try that
// instead.
const Libssl& libssl();

} // namespace torch_rpc_ext
