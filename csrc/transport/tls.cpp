// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tls.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "csrc/common/crypto.h"
#include "csrc/common/libssl.h"
#include "csrc/transport/tls_peer.h"

#if __has_include(<openssl/ssl.h>)
#include <openssl/err.h>
#include <openssl/ssl.h>
#define TORCH_RPC_EXT_OPENSSL_HEADERS 1
#endif

namespace torch_rpc_ext::transport {

namespace {

// OpenSSL's values (ssl.h, prov_ssl.h, sslerr.h, x509.h); checked against
// its headers below where they exist.
constexpr int kTls13 = 0x0304; // TLS1_3_VERSION
constexpr int kCtrlMode = 33; // SSL_CTRL_MODE
constexpr int kCtrlReadAhead = 41; // SSL_CTRL_SET_READ_AHEAD
constexpr int kCtrlMinProto = 123; // SSL_CTRL_SET_MIN_PROTO_VERSION
constexpr int kCtrlMaxProto = 124; // SSL_CTRL_SET_MAX_PROTO_VERSION
constexpr long kModePartialWrite = 0x1; // SSL_MODE_ENABLE_PARTIAL_WRITE
constexpr long kModeMovingBuffer = 0x2; // SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER
constexpr uint64_t kOpNoTicket = uint64_t(1) << 14; // SSL_OP_NO_TICKET
constexpr uint64_t kOpNoCompression = uint64_t(1) << 17;
constexpr int kVerifyPeer = 0x01; // SSL_VERIFY_PEER
constexpr int kVerifyFailIfNoPeerCert = 0x02;
constexpr int kFiletypePem = 1; // SSL_FILETYPE_PEM
constexpr int kErrorSsl = 1; // SSL_ERROR_SSL
constexpr int kErrorWantRead = 2;
constexpr int kErrorWantWrite = 3;
constexpr int kErrorSyscall = 5;
constexpr int kErrorZeroReturn = 6;
constexpr int kKeyUpdateRequested = 1; // SSL_KEY_UPDATE_REQUESTED
// ERR_GET_REASON's mask in 1.1.1 (3.x's is wider; the reasons we name fit).
constexpr unsigned long kReasonMask = 0xFFF;
constexpr unsigned long kBadRecordMac = 281; // SSL_R_DECRYPTION_FAILED_...
constexpr unsigned long kUnexpectedEof = 294; // 3.x: ..._UNEXPECTED_EOF_...
// The plaintext one SSL_write_ex call takes: one record (TLS's maximum).
constexpr size_t kRecordBytes = 16384;
// Records encrypted ahead of the socket at most, per connection; and the
// capacity of the buffer kept once it is drained (a larger one goes).
constexpr size_t kOutHighWater = 256 * 1024;
constexpr size_t kOutKeep = 64 * 1024;
// What one read(2) of OpenSSL's takes at most (with read-ahead).
constexpr size_t kReadBufferBytes = 64 * 1024;
constexpr int kBioTypeSourceSink = 0x0400; // BIO_TYPE_SOURCE_SINK
constexpr int kBioCtrlFlush = 11; // BIO_CTRL_FLUSH
constexpr int kBioNoClose = 0; // BIO_NOCLOSE

#ifdef TORCH_RPC_EXT_OPENSSL_HEADERS
static_assert(kTls13 == TLS1_3_VERSION);
static_assert(kCtrlMode == SSL_CTRL_MODE);
static_assert(kCtrlReadAhead == SSL_CTRL_SET_READ_AHEAD);
static_assert(kCtrlMinProto == SSL_CTRL_SET_MIN_PROTO_VERSION);
static_assert(kCtrlMaxProto == SSL_CTRL_SET_MAX_PROTO_VERSION);
static_assert(kModePartialWrite == SSL_MODE_ENABLE_PARTIAL_WRITE);
static_assert(kModeMovingBuffer == SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
static_assert(kOpNoTicket == SSL_OP_NO_TICKET);
static_assert(kOpNoCompression == SSL_OP_NO_COMPRESSION);
static_assert(kVerifyPeer == SSL_VERIFY_PEER);
static_assert(kVerifyFailIfNoPeerCert == SSL_VERIFY_FAIL_IF_NO_PEER_CERT);
static_assert(kFiletypePem == SSL_FILETYPE_PEM);
static_assert(kErrorSsl == SSL_ERROR_SSL);
static_assert(kKeyUpdateRequested == SSL_KEY_UPDATE_REQUESTED);
static_assert(kErrorWantRead == SSL_ERROR_WANT_READ);
static_assert(kErrorWantWrite == SSL_ERROR_WANT_WRITE);
static_assert(kErrorSyscall == SSL_ERROR_SYSCALL);
static_assert(kErrorZeroReturn == SSL_ERROR_ZERO_RETURN);
static_assert(kBadRecordMac == SSL_R_DECRYPTION_FAILED_OR_BAD_RECORD_MAC);
#ifdef SSL_R_UNEXPECTED_EOF_WHILE_READING
static_assert(kUnexpectedEof == SSL_R_UNEXPECTED_EOF_WHILE_READING);
#endif
static_assert(kRecordBytes == SSL3_RT_MAX_PLAIN_LENGTH);
static_assert(kBioTypeSourceSink == BIO_TYPE_SOURCE_SINK);
static_assert(kBioCtrlFlush == BIO_CTRL_FLUSH);
static_assert(kBioNoClose == BIO_NOCLOSE);
#endif

// The pre-shared key's derivation label.
constexpr const char* kPskLabel = "torch_rpc_ext/tls-psk/1";
constexpr const char* kPskSuites =
    "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";
constexpr const char* kCertSuites =
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
    "TLS_CHACHA20_POLY1305_SHA256";

// OpenSSL's error queue as text ("" when empty); empties it.
std::string drainErrors(const Libssl& lib, unsigned long* first = nullptr) {
  std::string out;
  char buf[256];
  while (unsigned long e = lib.ERR_get_error()) {
    if (first != nullptr && *first == 0) {
      *first = e;
    }
    lib.ERR_error_string_n(e, buf, sizeof(buf));
    out += (out.empty() ? "" : "; ") + std::string(buf);
  }
  return out;
}

// Our output BIO: OpenSSL's records go to the session's out_.
int outputWrite(bio_st* b, const char* data, size_t size, size_t* written) {
  static_cast<TlsSession*>(libssl().BIO_get_data(b))->appendOutput(data, size);
  *written = size;
  return 1;
}

long outputCtrl(bio_st* /*b*/, int cmd, long /*num*/, void* /*ptr*/) {
  return cmd == kBioCtrlFlush ? 1 : 0; // nothing else to answer
}

int outputCreate(bio_st* b) {
  libssl().BIO_set_init(b, 1);
  return 1;
}

// The method of our output BIOs, made once (never freed).
bio_method_st* outputMethod() {
  static bio_method_st* method = [] {
    const Libssl& lib = libssl();
    bio_method_st* m = lib.BIO_meth_new(
        lib.BIO_get_new_index() | kBioTypeSourceSink, "torch_rpc_ext output");
    if (m == nullptr || lib.BIO_meth_set_write_ex(m, outputWrite) != 1 ||
        lib.BIO_meth_set_ctrl(m, outputCtrl) != 1 ||
        lib.BIO_meth_set_create(m, outputCreate) != 1) {
      throw std::runtime_error("BIO_meth_new failed: " + drainErrors(lib));
    }
    return m;
  }();
  return method;
}

bool isLoopback(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&in6)) {
      return true;
    }
    return IN6_IS_ADDR_V4MAPPED(&in6) && in6.s6_addr[12] == 127;
  }
  return a.ss_family == AF_UNIX; // same kernel
}

} // namespace

const char* tlsModeName(TlsOptions::Mode mode) {
  switch (mode) {
    case TlsOptions::Mode::kOff:
      return "off";
    case TlsOptions::Mode::kRemote:
      return "auto";
    case TlsOptions::Mode::kAlways:
      return "always";
  }
  return "?";
}

TlsOptions::Mode parseTlsMode(const std::string& name) {
  if (name == "off") {
    return TlsOptions::Mode::kOff;
  }
  if (name == "auto") {
    return TlsOptions::Mode::kRemote;
  }
  if (name == "always") {
    return TlsOptions::Mode::kAlways;
  }
  throw std::invalid_argument(
      "encryption must be \"auto\", \"always\" or \"off\", not \"" + name +
      "\"");
}

std::shared_ptr<TlsContext> TlsContext::create(
    const TlsOptions& options,
    const std::string& secret) {
  if (options.mode == TlsOptions::Mode::kOff) {
    return nullptr;
  }
  const Libssl& lib = libssl();
  bool mutual = !options.certFile.empty();
  if (mutual && (options.keyFile.empty() || options.caFile.empty())) {
    throw std::runtime_error(
        "mutual TLS needs tls_cert, tls_key and tls_ca together");
  }
  std::string groupKey;
  if (!mutual) {
    if (secret.size() < 16) {
      throw std::runtime_error(
          "TLS's pre-shared key comes from the group secret, which has " +
          std::to_string(secret.size()) + " bytes (at least 16 needed)");
    }
    Digest d = hmacSha256(secret, kPskLabel);
    groupKey.assign(reinterpret_cast<const char*>(d.data()), d.size());
  }
  TlsOptions effective = options;
  if (const char* text = std::getenv("TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES");
      text != nullptr && *text != '\0') {
    uint64_t v = 0;
    const char* end = text + std::strlen(text);
    auto [ptr, ec] = std::from_chars(text, end, v);
    if (ec != std::errc() || ptr != end || v < (uint64_t(1) << 20) ||
        v > (uint64_t(1) << 40)) {
      throw std::runtime_error(
          std::string("TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES=") + text +
          " is not a whole number of bytes from 1048576 (1 MiB) to "
          "1099511627776 (1 TiB)");
    }
    effective.keyUpdateBytes = v;
  }
  std::shared_ptr<TlsContext> c(new TlsContext(effective, std::move(groupKey)));
  lib.ERR_clear_error();
  c->ctx_ = lib.SSL_CTX_new(lib.TLS_method());
  if (c->ctx_ == nullptr) {
    throw std::runtime_error("SSL_CTX_new failed: " + drainErrors(lib));
  }
  auto fail = [&](const std::string& what) {
    throw std::runtime_error(what + ": " + drainErrors(lib));
  };
  if (lib.SSL_CTX_ctrl(c->ctx_, kCtrlMinProto, kTls13, nullptr) != 1 ||
      lib.SSL_CTX_ctrl(c->ctx_, kCtrlMaxProto, kTls13, nullptr) != 1) {
    fail("this libssl cannot do TLS 1.3 (" + lib.description + ")");
  }
  lib.SSL_CTX_set_options(c->ctx_, kOpNoTicket | kOpNoCompression);
  lib.SSL_CTX_set_num_tickets(c->ctx_, 0);
  // (Our BIO never blocks: a write is whole or an error.)
  lib.SSL_CTX_ctrl(
      c->ctx_, kCtrlMode, kModePartialWrite | kModeMovingBuffer, nullptr);
  // Several whole records per read(2), not a header and a body each.
  lib.SSL_CTX_ctrl(c->ctx_, kCtrlReadAhead, 1, nullptr);
  lib.SSL_CTX_set_default_read_buffer_len(c->ctx_, kReadBufferBytes);
  if (lib.SSL_CTX_set_ciphersuites(
          c->ctx_, mutual ? kCertSuites : kPskSuites) != 1) {
    fail("SSL_CTX_set_ciphersuites failed");
  }
  if (!mutual) {
    usePreSharedKey(lib, c->ctx_);
    return c;
  }
  if (lib.SSL_CTX_use_certificate_chain_file(
          c->ctx_, options.certFile.c_str()) != 1) {
    fail("cannot use tls_cert " + options.certFile);
  }
  if (lib.SSL_CTX_use_PrivateKey_file(
          c->ctx_, options.keyFile.c_str(), kFiletypePem) != 1) {
    fail("cannot use tls_key " + options.keyFile);
  }
  if (lib.SSL_CTX_check_private_key(c->ctx_) != 1) {
    fail(
        "tls_key " + options.keyFile + " does not match tls_cert " +
        options.certFile);
  }
  if (lib.SSL_CTX_load_verify_locations(
          c->ctx_, options.caFile.c_str(), nullptr) != 1) {
    fail("cannot load tls_ca " + options.caFile);
  }
  lib.SSL_CTX_set_verify(
      c->ctx_, kVerifyPeer | kVerifyFailIfNoPeerCert, nullptr);
  return c;
}

TlsContext::TlsContext(TlsOptions options, std::string groupKey)
    : options_(std::move(options)), groupKey_(std::move(groupKey)) {}

TlsContext::~TlsContext() {
  if (ctx_ != nullptr) {
    libssl().SSL_CTX_free(ctx_);
  }
}

bool TlsContext::appliesTo(const sockaddr_storage& peer) const {
  switch (options_.mode) {
    case TlsOptions::Mode::kOff:
      return false;
    case TlsOptions::Mode::kAlways:
      return true;
    case TlsOptions::Mode::kRemote:
      return !isLoopback(peer);
  }
  return true;
}

std::unique_ptr<TlsSession> TlsContext::newSession(
    int fd,
    bool client,
    std::string psk) const {
  if (psk.size() != (mutual() ? 0 : kTlsPskBytes)) {
    throw std::invalid_argument(
        mutual() ? "a TLS session under certificates takes no pre-shared key"
                 : "a TLS session needs its connection's pre-shared key (" +
                std::to_string(kTlsPskBytes) +
                " bytes from the key "
                "exchange), not " +
                std::to_string(psk.size()) + " bytes");
  }
  const Libssl& lib = libssl();
  lib.ERR_clear_error();
  ssl_st* ssl = lib.SSL_new(ctx_);
  if (ssl == nullptr) {
    throw std::runtime_error("SSL_new failed: " + drainErrors(lib));
  }
  std::unique_ptr<TlsSession> s(
      new TlsSession(shared_from_this(), ssl, fd, std::move(psk)));
  bio_st* in = lib.BIO_new_socket(fd, kBioNoClose);
  bio_st* out = lib.BIO_new(outputMethod());
  if (in == nullptr || out == nullptr) {
    if (in != nullptr) {
      lib.BIO_free(in);
    }
    if (out != nullptr) {
      lib.BIO_free(out);
    }
    throw std::runtime_error("BIO_new failed: " + drainErrors(lib));
  }
  lib.BIO_set_data(out, s.get());
  lib.SSL_set_bio(ssl, in, out); // the SSL owns both now
  if (lib.SSL_set_ex_data(ssl, kTlsSessionSlot, s.get()) != 1) {
    throw std::runtime_error("SSL_set_ex_data failed: " + drainErrors(lib));
  }
  if (client) {
    if (!mutual()) {
      // A server that ignores our key and shows a certificate instead is
      // not one of ours: with no CA to check it against, verification
      // fails the handshake (handshake() also checks the key was used).
      lib.SSL_set_verify(ssl, kVerifyPeer, nullptr);
    }
    lib.SSL_set_connect_state(ssl);
  } else {
    lib.SSL_set_accept_state(ssl);
  }
  return s;
}

TlsSession::TlsSession(
    std::shared_ptr<const TlsContext> context,
    ssl_st* ssl,
    int fd,
    std::string psk)
    : context_(std::move(context)), ssl_(ssl), fd_(fd), psk_(std::move(psk)) {}

TlsSession::~TlsSession() {
  libssl().SSL_free(ssl_);
  std::fill(psk_.begin(), psk_.end(), '\0');
}

std::string TlsSession::errorText(const char* what, int result, bool* ours)
    const {
  const Libssl& lib = libssl();
  int e = lib.SSL_get_error(ssl_, result);
  int savedErrno = errno;
  unsigned long first = 0;
  std::string queue = drainErrors(lib, &first);
  if (ours) {
    // OpenSSL's reason for an alert the peer sent is 1000 + the alert.
    const unsigned long reason = first & kReasonMask;
    *ours = e == kErrorSsl && reason != kUnexpectedEof && reason < 1000;
  }
  if (e == kErrorZeroReturn) {
    return "peer closed the connection (TLS close_notify)";
  }
  if (e == kErrorSyscall && queue.empty()) {
    return savedErrno == 0 || savedErrno == ECONNRESET || savedErrno == EPIPE
        ? std::string("peer closed the connection") +
            (savedErrno != 0
                 ? std::string(" (") + std::strerror(savedErrno) + ")"
                 : "")
        : std::string(what) + " failed: " + std::strerror(savedErrno);
  }
  if (e == kErrorSsl && (first & kReasonMask) == kUnexpectedEof) {
    return "peer closed the connection (" + queue + ")";
  }
  if (e == kErrorSsl && (first & kReasonMask) == kBadRecordMac) {
    return "a TLS record failed its integrity check (altered or injected on "
           "the wire?): " +
        queue;
  }
  std::string out = std::string(what) + " failed: " +
      (queue.empty() ? "SSL_get_error " + std::to_string(e) : queue);
  if (context_->mutual()) {
    long v = lib.SSL_get_verify_result(ssl_);
    if (v != 0) {
      out += " (peer certificate: " +
          std::string(lib.X509_verify_cert_error_string(v)) + ")";
    }
  }
  return out;
}

TlsSession::Step TlsSession::handshake(std::string* error) {
  Step step = handshakeStep(error);
  if (step == Step::kDone) {
    context_->handshakes_.fetch_add(1, std::memory_order_relaxed);
  } else if (step == Step::kFailed) {
    context_->handshakeFailures_.fetch_add(1, std::memory_order_relaxed);
  }
  return step;
}

TlsSession::Step TlsSession::handshakeStep(std::string* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Libssl& lib = libssl();
  lib.ERR_clear_error();
  errno = 0;
  int r = lib.SSL_do_handshake(ssl_);
  if (r != 1) {
    int e = lib.SSL_get_error(ssl_, r);
    if (e != kErrorWantRead && e != kErrorWantWrite) {
      *error = errorText("TLS handshake", r, &refusedPeer_);
      std::string ignored;
      flushLocked(&ignored); // the alert that says why, if the peer listens
      return Step::kFailed;
    }
  }
  // What this step wrote goes now; what the socket does not take, with the
  // next write (hasPendingOutput()) or on EPOLLOUT.
  int sent = flushLocked(error);
  if (sent < 0) {
    return Step::kFailed;
  }
  if (r == 1) {
    if (!context_->mutual() && lib.SSL_session_reused(ssl_) != 1) {
      *error =
          "the peer did not use the group's key (a TLS server that is not "
          "one of ours?)";
      refusedPeer_ = true;
      return Step::kFailed;
    }
    if (context_->mutual() && !context_->options_.peerNames.empty()) {
      *error = peerNameMismatch(lib, ssl_, context_->options_.peerNames);
      if (!error->empty()) {
        refusedPeer_ = true;
        return Step::kFailed;
      }
    }
    return Step::kDone;
  }
  return sent == 0 ? Step::kWantWrite : Step::kWantRead;
}

ssize_t TlsSession::read(void* dst, size_t size, std::string* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Libssl& lib = libssl();
  lib.ERR_clear_error();
  errno = 0;
  size_t n = 0;
  int r = lib.SSL_read_ex(ssl_, dst, size, &n);
  if (outSent_ < out_.size()) {
    // A read wrote (an alert): send it; a failure shows on the next write.
    int saved = errno;
    std::string ignored;
    flushLocked(&ignored);
    errno = saved;
  }
  if (r == 1) {
    return static_cast<ssize_t>(n);
  }
  int e = lib.SSL_get_error(ssl_, r);
  if (e == kErrorWantRead) {
    return 0;
  }
  if (e == kErrorWantWrite) {
    // A key update's answer is written inside the read (our BIO never
    // blocks), so this is not ours: a renegotiation, which TLS 1.3 has not.
    drainErrors(lib);
    *error = "TLS read wants a write, which our output never needs";
    return -1;
  }
  *error = errorText("TLS read", r);
  return -1;
}

int TlsSession::flushLocked(std::string* error) {
  sendRefusedByPeer_ = false;
  while (outSent_ < out_.size()) {
    ssize_t n = ::send(
        fd_, out_.data() + outSent_, out_.size() - outSent_, MSG_NOSIGNAL);
    if (n > 0) {
      outSent_ += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return 0;
    }
    sendRefusedByPeer_ = n < 0 && (errno == EPIPE || errno == ECONNRESET);
    *error = n == 0 ? std::string("send returned 0")
                    : std::string("write failed: ") + std::strerror(errno);
    return -1;
  }
  if (out_.capacity() > kOutKeep) {
    std::string().swap(out_);
  } else {
    out_.clear();
  }
  outSent_ = 0;
  return 1;
}

int TlsSession::flush(std::string* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  return flushLocked(error);
}

ssize_t TlsSession::write(const void* src, size_t size, std::string* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (flushLocked(error) < 0) {
    return -1;
  }
  const Libssl& lib = libssl();
  const char* p = static_cast<const char*>(src);
  size_t taken = 0;
  // Whole records into out_ (our BIO never blocks, so neither does this),
  // as far as the high-water mark.
  while (taken < size && out_.size() - outSent_ < kOutHighWater) {
    lib.ERR_clear_error();
    errno = 0;
    size_t n = 0;
    int r = lib.SSL_write_ex(
        ssl_, p + taken, std::min(size - taken, kRecordBytes), &n);
    if (r != 1) {
      sendRefusedByPeer_ = false; // TLS's own failure
      *error = errorText("TLS write", r);
      return -1;
    }
    taken += n;
    sentUnderKey_ += n;
    if (sentUnderKey_ >= context_->options_.keyUpdateBytes) {
      // Fresh keys both ways from the next record on: OpenSSL sends the
      // KeyUpdate with it, and the peer answers with its own.
      sentUnderKey_ = 0;
      if (lib.SSL_key_update(ssl_, kKeyUpdateRequested) != 1) {
        *error = "TLS key update failed: " + drainErrors(lib);
        return -1;
      }
      context_->keyUpdates_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (flushLocked(error) < 0) {
    return -1;
  }
  return static_cast<ssize_t>(taken);
}

std::string TlsSession::exporter() const {
  static constexpr char kLabel[] = "EXPORTER-torch_rpc_ext-handshake";
  std::lock_guard<std::mutex> lock(mutex_);
  const Libssl& lib = libssl();
  std::string out(32, '\0');
  lib.ERR_clear_error();
  if (lib.SSL_export_keying_material(
          ssl_,
          reinterpret_cast<unsigned char*>(out.data()),
          out.size(),
          kLabel,
          sizeof(kLabel) - 1,
          nullptr,
          0,
          0) != 1) {
    throw std::runtime_error(errorText("SSL_export_keying_material", 0));
  }
  return out;
}

std::string TlsSession::describe() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Libssl& lib = libssl();
  std::string out = lib.SSL_get_version(ssl_);
  if (const ssl_cipher_st* c = lib.SSL_get_current_cipher(ssl_)) {
    out += std::string(" ") + lib.SSL_CIPHER_get_name(c);
  }
  if (!context_->mutual()) {
    return out + ", pre-shared key from the group secret (CPace)";
  }
  return out + ", peer certificate " + peerSubject(lib, ssl_);
}

} // namespace torch_rpc_ext::transport
