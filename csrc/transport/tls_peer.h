// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// How a TLS peer shows who it is (transport/tls.h): its connection's
// pre-shared key (TLS 1.3 external PSK, from a key exchange keyed by the
// group secret: common/cpace.h), or, under mutual
// TLS, a certificate whose names tls_peer_names may constrain. Called by
// TlsContext and TlsSession with libssl loaded.

#include <string>
#include <vector>

#include "csrc/common/libssl.h"

namespace torch_rpc_ext::transport {

// The SSL ex_data slot (SSL_set_app_data's) that holds an SSL's
// TlsSession, whose psk() the callbacks below read.
constexpr int kTlsSessionSlot = 0;

// Installs the callbacks by which a client offers, and a server finds, the
// connection's pre-shared key (the identity "torch_rpc_ext/1", bound to
// TLS_AES_128_GCM_SHA256's hash); a server finds nothing for another
// identity, which fails the handshake.
void usePreSharedKey(const Libssl& lib, ssl_ctx_st* ctx);

// The subject of the peer's certificate ("/CN=worker1"), "?" without one.
std::string peerSubject(const Libssl& lib, ssl_st* ssl);

// "" if one of the peer certificate's names matches one of `patterns`
// (fnmatch(3); DNS subject alternative names and a CN without regard to
// case, URIs as they are; the CN only when there is no SAN, and only whole,
// without a NUL), else why not, naming its names and the patterns.
std::string peerNameMismatch(
    const Libssl& lib,
    ssl_st* ssl,
    const std::vector<std::string>& patterns);

} // namespace torch_rpc_ext::transport
