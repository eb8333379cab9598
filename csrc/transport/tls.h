// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// TLS 1.3 over a stream socket, from OpenSSL's libssl loaded at run time
// (csrc/common/libssl.h). docs/security.md, "Encryption in transit".
//
// A connection that leaves the host is encrypted: the TLS handshake runs
// first on the bare socket, then the frame protocol and its handshake
// (handshake.h) run inside it. Two ways to authenticate TLS itself:
//  * a pre-shared key (the default), each connection's own: the result of
//    a CPace exchange (common/cpace.h) keyed by HMAC-SHA256(group secret,
//    kPskLabel) that the stream connection runs in the clear before TLS,
//    so a recording of the TLS handshake holds nothing to test a guessed
//    secret against; with an ephemeral X25519 exchange on top (psk_dhe_ke),
//    so a recorded connection stays secret even if the group secret leaks
//    later. Nothing to manage: every member already has the secret.
//  * certificates (mutual TLS), for sites with a PKI: each end presents
//    its certificate chain and key and checks the peer's against the CA.
// Either way the group's own handshake follows inside, as on every
// connection. A record altered or injected on the wire fails TLS's
// authentication tag: the read fails and the stream core closes that
// connection only.
//
// Threads: a TlsContext is immutable once made and shared by every
// connection of a transport. A TlsSession is one connection's: handshake()
// and read() run on the loop thread, write() and flush() on any thread
// with the connection's write lock held; the session's own mutex_
// serialises them all (an OpenSSL SSL object is not safe to use from two
// threads at once).
//
// I/O: OpenSSL reads the socket itself, ahead (up to 64 KiB, several
// records, a read(2)); what it writes goes to a BIO of ours that appends
// the records to out_, which the session sends with send(MSG_NOSIGNAL) as
// the socket takes it: up to 256 KiB of records per send(2) rather than one
// write(2) per 16 KiB record, no SIGPIPE, and no OpenSSL retry rules (its
// writes never block).

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct ssl_st;
struct ssl_ctx_st;

namespace torch_rpc_ext::transport {

struct TlsOptions {
  enum class Mode {
    kOff, // never
    kRemote, // connections whose peer address is not loopback (default)
    kAlways, // every connection of a transport that crosses hosts
  };
  Mode mode = Mode::kRemote;
  // Mutual TLS with these PEM files when certFile is set (all three are,
  // or none); else the pre-shared key from the group secret.
  std::string certFile;
  std::string keyFile;
  std::string caFile;
  // Mutual TLS only: glob patterns (fnmatch(3)), one of which a peer's
  // certificate must match with one of its names (its DNS and URI subject
  // alternative names; its subject's CN if it has none), beside being
  // signed by the CA. Empty: any certificate the CA signed.
  std::vector<std::string> peerNames;
  // A session asks for fresh keys (a TLS 1.3 KeyUpdate, both ways: the
  // peer answers with its own) after sending this many bytes under one
  // key: 32 GiB, far inside AES-GCM's limits for a key (RFC 8446, 5.5).
  // TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES (1 MiB to 1 TiB) sets it.
  uint64_t keyUpdateBytes = uint64_t(32) << 30;
};

// "off", "auto", "always" (the option's values) for a mode, and back;
// parseTlsMode throws std::invalid_argument naming the value.
const char* tlsModeName(TlsOptions::Mode mode);
TlsOptions::Mode parseTlsMode(const std::string& name);

class TlsSession;

// A connection's pre-shared key (cpace::Exchange::finish's).
constexpr size_t kTlsPskBytes = 32;

class TlsContext : public std::enable_shared_from_this<TlsContext> {
 public:
  // Null for Mode::kOff. Throws std::runtime_error naming the problem: no
  // usable libssl, a certificate, key or CA file that cannot be read or
  // does not match, a secret too short to derive a key from.
  static std::shared_ptr<TlsContext> create(
      const TlsOptions& options,
      const std::string& secret);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  // Whether a connection to or from `peer` (the socket's peer address) is
  // encrypted under this context's mode.
  bool appliesTo(const sockaddr_storage& peer) const;
  bool mutual() const {
    return !options_.certFile.empty();
  }
  const TlsOptions& options() const {
    return options_;
  }
  // The key each connection's exchange starts from (32 bytes,
  // HMAC-SHA256(group secret, kPskLabel); empty under mutual TLS). Never a
  // TLS key itself.
  const std::string& groupKey() const {
    return groupKey_;
  }
  // A session for the connected socket `fd` (not owned), as the client
  // (the end that connected) or the server, under `psk`: the connection's
  // pre-shared key from its exchange (kTlsPskBytes), empty under mutual
  // TLS. Throws std::invalid_argument for a key of another size,
  // std::runtime_error if libssl fails.
  std::unique_ptr<TlsSession> newSession(int fd, bool client, std::string psk)
      const;
  // KeyUpdates its sessions have asked for (options().keyUpdateBytes).
  uint64_t keyUpdates() const {
    return keyUpdates_.load(std::memory_order_relaxed);
  }
  // Its sessions' handshakes that completed, and that failed (the peer's
  // key, certificate or name refused, a reset or garbage mid-handshake).
  uint64_t handshakes() const {
    return handshakes_.load(std::memory_order_relaxed);
  }
  uint64_t handshakeFailures() const {
    return handshakeFailures_.load(std::memory_order_relaxed);
  }

 private:
  TlsContext(TlsOptions options, std::string groupKey);
  friend class TlsSession;

  const TlsOptions options_;
  const std::string groupKey_; // 32 bytes; empty under mutual TLS
  ssl_ctx_st* ctx_ = nullptr;
  mutable std::atomic<uint64_t> keyUpdates_{0};
  mutable std::atomic<uint64_t> handshakes_{0};
  mutable std::atomic<uint64_t> handshakeFailures_{0};
};

// One connection's TLS state. Every call returns at once (the socket is
// non-blocking).
class TlsSession {
 public:
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  enum class Step { kDone, kWantRead, kWantWrite, kFailed };
  // Advance the TLS handshake; kFailed with `error` set.
  Step handshake(std::string* error);
  // The handshake failed because this end refused the peer (its key,
  // certificate or name, or bytes that are not TLS as we speak it), not
  // because the peer went away or refused us (an alert it sent).
  bool refusedPeer() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return refusedPeer_;
  }

  // Decrypt into `dst`: bytes (>0), 0 if none are ready, -1 when the
  // connection is over, with `error` saying why (the peer closed, or a
  // record failed authentication).
  ssize_t read(void* dst, size_t size, std::string* error);

  // Encrypt from `src` and send: bytes taken (>0), 0 while 256 KiB of
  // records wait for the socket, -1 with `error`. Bytes taken are the
  // caller's to forget: records not yet on the socket stay here
  // (hasPendingOutput()) and go out first on the next write() or flush().
  ssize_t write(const void* src, size_t size, std::string* error);
  // Send what write() left: 1 when nothing is left, 0 if the socket is
  // full, -1 with `error`.
  int flush(std::string* error);
  bool hasPendingOutput() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return outSent_ < out_.size();
  }
  // The last write() or flush() failed because the socket refused it, the
  // peer having closed its end (EPIPE, ECONNRESET): nothing failed in TLS
  // itself (our records go through out_, not a socket BIO), so the records
  // the peer sent before it closed can still be read and decrypted.
  bool sendRefusedByPeer() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return sendRefusedByPeer_;
  }
  // Our BIO's write: OpenSSL's records, appended to out_ (mutex_ is held:
  // only SSL calls of ours write).
  void appendOutput(const char* data, size_t size) {
    out_.append(data, size);
  }

  // "TLSv1.3 TLS_AES_128_GCM_SHA256, pre-shared key" or, under mutual TLS,
  // "TLSv1.3 TLS_AES_128_GCM_SHA256, peer certificate <subject>". Once the
  // handshake is done.
  std::string describe() const;

  // The connection's pre-shared key (empty under mutual TLS): what the
  // PSK callbacks (tls_peer.h) offer and find.
  const std::string& psk() const {
    return psk_;
  }

  // 32 bytes from the session's keys (RFC 8446 exporter, our label), the
  // same at both ends of this TLS session and at no others: the handshake's
  // proofs cover it, so a relay that runs two sessions fails them. Once
  // the handshake is done; throws std::runtime_error if libssl refuses.
  std::string exporter() const;

 private:
  TlsSession(
      std::shared_ptr<const TlsContext> context,
      ssl_st* ssl,
      int fd,
      std::string psk);
  friend class TlsContext;
  // OpenSSL's error queue and the failing call's result, as text.
  // `ours`, where given: whether this end decided the failure (an SSL
  // error of its own, not an end of stream or a peer's alert).
  std::string errorText(const char* what, int result, bool* ours = nullptr)
      const;
  // send(2) out_ from outSent_: 1 when all of it is on the socket, 0 if the
  // socket is full, -1 with `error`.
  int flushLocked(std::string* error);
  // handshake()'s step, which it counts in the context when it ends.
  Step handshakeStep(std::string* error);

  const std::shared_ptr<const TlsContext> context_;
  ssl_st* const ssl_;
  const int fd_; // not owned
  std::string psk_; // wiped on destruction
  mutable std::mutex mutex_;
  // Records OpenSSL wrote, and how many of their bytes are on the socket
  // (mutex_).
  std::string out_;
  size_t outSent_ = 0;
  // Bytes sent under the current key (mutex_).
  uint64_t sentUnderKey_ = 0;
  bool sendRefusedByPeer_ = false; // mutex_
  bool refusedPeer_ = false; // mutex_
};

} // namespace torch_rpc_ext::transport
