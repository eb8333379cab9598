// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tls_peer.h"

#include <fnmatch.h>

#include <cstddef>
#include <cstring>

#include "csrc/transport/tls.h"

#if __has_include(<openssl/ssl.h>)
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#define TORCH_RPC_EXT_OPENSSL_HEADERS 1
#endif

namespace torch_rpc_ext::transport {

namespace {

// OpenSSL's values; checked against its headers below where they exist.
constexpr int kPskVersion = 0x0304; // TLS1_3_VERSION: the PSK session's
constexpr int kNidSubjectAltName = 85; // NID_subject_alt_name
constexpr int kNidCommonName = 13; // NID_commonName
constexpr int kGenDns = 2; // GEN_DNS
constexpr int kGenUri = 6; // GEN_URI
// OpenSSL's GENERAL_NAME: its type, then a union of pointers (the DNS and
// URI names are ASN1_IA5STRINGs), a layout public since 0.9.
struct GeneralName {
  int type;
  const asn1_string_st* value;
};

#ifdef TORCH_RPC_EXT_OPENSSL_HEADERS
static_assert(kPskVersion == TLS1_3_VERSION);
static_assert(kNidSubjectAltName == NID_subject_alt_name);
static_assert(kNidCommonName == NID_commonName);
static_assert(kGenDns == GEN_DNS && kGenUri == GEN_URI);
static_assert(offsetof(GENERAL_NAME, d) == offsetof(GeneralName, value));
static_assert(offsetof(GENERAL_NAME, type) == offsetof(GeneralName, type));
#endif

// The identity a client offers with its connection's key, and the suite the key
// is bound to (TLS_AES_128_GCM_SHA256's IANA code: the suites offered all
// use SHA-256, as a TLS 1.3 PSK must match its hash).
constexpr unsigned char kPskIdentity[] = "torch_rpc_ext/1";
constexpr size_t kPskIdentityBytes = sizeof(kPskIdentity) - 1;
constexpr unsigned char kAes128GcmSha256[2] = {0x13, 0x01};

ssl_session_st* pskSession(ssl_st* ssl, const std::string& psk) {
  const Libssl& lib = libssl();
  const ssl_cipher_st* cipher = lib.SSL_CIPHER_find(ssl, kAes128GcmSha256);
  if (cipher == nullptr) {
    return nullptr;
  }
  ssl_session_st* s = lib.SSL_SESSION_new();
  if (s == nullptr) {
    return nullptr;
  }
  if (lib.SSL_SESSION_set1_master_key(
          s, reinterpret_cast<const unsigned char*>(psk.data()), psk.size()) !=
          1 ||
      lib.SSL_SESSION_set_cipher(s, cipher) != 1 ||
      lib.SSL_SESSION_set_protocol_version(s, kPskVersion) != 1) {
    lib.SSL_SESSION_free(s);
    return nullptr;
  }
  return s;
}

const TlsSession& sessionOf(ssl_st* ssl) {
  return *static_cast<const TlsSession*>(
      libssl().SSL_get_ex_data(ssl, kTlsSessionSlot));
}

// Client: offer the connection's key (OpenSSL frees the session).
int useSessionCb(
    ssl_st* ssl,
    const evp_md_st* /*md*/,
    const unsigned char** id,
    size_t* idLength,
    ssl_session_st** session) {
  *session = pskSession(ssl, sessionOf(ssl).psk());
  if (*session == nullptr) {
    return 0; // fails the handshake
  }
  *id = kPskIdentity;
  *idLength = kPskIdentityBytes;
  return 1;
}

// Server: the connection's key for our identity; nothing for any other (the
// handshake then fails: the server has no certificate to fall back on).
int findSessionCb(
    ssl_st* ssl,
    const unsigned char* identity,
    size_t identityLength,
    ssl_session_st** session) {
  *session = nullptr;
  if (identityLength == kPskIdentityBytes &&
      std::memcmp(identity, kPskIdentity, identityLength) == 0) {
    *session = pskSession(ssl, sessionOf(ssl).psk());
    return *session != nullptr ? 1 : 0;
  }
  return 1;
}

} // namespace

void usePreSharedKey(const Libssl& lib, ssl_ctx_st* ctx) {
  lib.SSL_CTX_set_psk_use_session_callback(ctx, useSessionCb);
  lib.SSL_CTX_set_psk_find_session_callback(ctx, findSessionCb);
}

std::string peerSubject(const Libssl& lib, ssl_st* ssl) {
  std::string subject = "?";
  if (x509_st* cert = lib.SSL_get1_peer_certificate(ssl)) {
    char buf[512];
    if (lib.X509_NAME_oneline(
            lib.X509_get_subject_name(cert), buf, sizeof(buf)) != nullptr) {
      subject = buf;
    }
    lib.X509_free(cert);
  }
  return subject;
}

std::string peerNameMismatch(
    const Libssl& lib,
    ssl_st* ssl,
    const std::vector<std::string>& patterns) {
  x509_st* cert = lib.SSL_get1_peer_certificate(ssl);
  if (cert == nullptr) {
    return "the peer showed no certificate";
  }
  std::vector<std::string> names; // "DNS:x", "URI:y", "CN:z"
  int critical = -1; // -1: no SAN extension; -2: more than one (refused)
  auto* sans = static_cast<stack_st_GENERAL_NAME*>(
      lib.X509_get_ext_d2i(cert, kNidSubjectAltName, &critical, nullptr));
  if (sans == nullptr && critical == -2) {
    lib.X509_free(cert);
    return "the peer's certificate has more than one subjectAltName "
           "extension";
  }
  if (sans != nullptr) {
    auto* stack = reinterpret_cast<const stack_st*>(sans);
    for (int i = 0; i < lib.OPENSSL_sk_num(stack); ++i) {
      const auto* name =
          static_cast<const GeneralName*>(lib.OPENSSL_sk_value(stack, i));
      if (name == nullptr || (name->type != kGenDns && name->type != kGenUri)) {
        continue;
      }
      const auto* text = lib.ASN1_STRING_get0_data(name->value);
      int length = lib.ASN1_STRING_length(name->value);
      std::string value(reinterpret_cast<const char*>(text), length);
      if (value.find('\0') == std::string::npos) { // (else: a forgery)
        names.push_back((name->type == kGenDns ? "DNS:" : "URI:") + value);
      }
    }
    lib.GENERAL_NAMES_free(sans);
  } else {
    char cn[256] = {};
    int length = lib.X509_NAME_get_text_by_NID(
        lib.X509_get_subject_name(cert), kNidCommonName, cn, sizeof(cn));
    // Whole and without NUL (a forgery would hide a suffix behind one).
    if (length > 0 && length < static_cast<int>(sizeof(cn)) - 1 &&
        std::strlen(cn) == static_cast<size_t>(length)) {
      names.push_back(std::string("CN:") + cn);
    }
  }
  lib.X509_free(cert);
  for (const auto& name : names) {
    const char* value = name.c_str() + name.find(':') + 1;
    // DNS names (and CNs, which hold them) compare without case; URIs as
    // they are. `*` matches across dots and slashes (fnmatch without flags).
    const int flags = name.rfind("URI:", 0) == 0 ? 0 : FNM_CASEFOLD;
    for (const auto& pattern : patterns) {
      if (::fnmatch(pattern.c_str(), value, flags) == 0) {
        return "";
      }
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (const auto& s : v) {
      out += (out.empty() ? "" : ", ") + s;
    }
    return out.empty() ? std::string("none") : out;
  };
  return "the peer's certificate (names: " + join(names) +
      ") matches none of tls_peer_names (" + join(patterns) + ")";
}

} // namespace torch_rpc_ext::transport
