// SPDX-License-Identifier: BSD-3-Clause
// StreamConnection's TLS start (docs/architecture.md, "TLS"): whether a
// connection encrypts, and its TLS handshake before the frame handshake.
// Loop thread only.
#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>
#include <memory>
#include <string_view>

#include "csrc/common/cpace.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

namespace {

// The key exchange's two messages (docs/wire-format.md, "Key exchange"),
// in the clear before TLS: the client's offer {tag, session id, share} and
// the server's answer {tag, share}.
constexpr size_t kTagBytes = sizeof(kExchangeTag);
constexpr size_t kOfferBytes =
    kTagBytes + cpace::kSessionIdBytes + cpace::kShareBytes;
constexpr size_t kAnswerBytes = kTagBytes + cpace::kShareBytes;
constexpr char kTlsHandshakeRecord = 0x16;

} // namespace

StreamConnection::TlsStart StreamConnection::startTlsFromLoop() {
  if (!tlsContext_) {
    return TlsStart::kClear;
  }
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&peer), &len) != 0) {
    closeInternal(errnoText("getpeername failed"), false);
    return TlsStart::kClosed;
  }
  bool required = tlsContext_->appliesTo(peer);
  std::unique_ptr<TlsSession> session;
  if (outbound_) {
    if (!required) {
      return TlsStart::kClear;
    }
    if (!tlsContext_->mutual()) {
      if (!sendOfferFromLoop()) {
        return TlsStart::kClosed;
      }
    } else {
      try {
        session = tlsContext_->newSession(fd_, /*client=*/true, "");
      } catch (const std::exception& e) {
        closeInternal(e.what(), false);
        return TlsStart::kClosed;
      }
    }
  }
  // Accepted: the client's first byte decides (driveTlsFromLoop()).
  // Outbound under the group's key: the server's answer makes the session.
  std::lock_guard<std::mutex> lock(writeMutex_);
  if (state_ == State::kClosed) {
    return TlsStart::kClosed;
  }
  tls_ = std::move(session);
  tlsRequired_ = required;
  state_ = State::kTls;
  return TlsStart::kEncrypt;
}

void StreamConnection::driveTlsFromLoop() {
  if (state_ != State::kTls || closedForHeldOffSourceFromLoop()) {
    return;
  }
  noteActivity();
  // (Outbound without a session: the exchange is under way. Accepted: once
  // the offer's first bytes are read.)
  if (!tls_ && (outbound_ || !exchangeIn_.empty())) {
    if (!exchangeFromLoop()) {
      return;
    }
  } else if (!tls_) {
    // Accepted: a TLS client begins with the key exchange's offer, or under
    // certificates with a handshake record (type 22); one in the clear with
    // a frame header. TLS is taken from any peer (the two ends may see
    // different addresses: a NAT, a port forward); the clear only from one
    // this end need not encrypt for.
    char first = 0;
    ssize_t got = ::recv(fd_, &first, 1, MSG_PEEK | MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return; // nothing yet: EPOLLIN brings us back
    }
    if (got == 0 || (got < 0 && errno == ECONNRESET)) { // (peeks the 1st byte)
      closeKnockedFromLoop(/*reset=*/got != 0);
      return;
    }
    if (got < 0) {
      closeInternal(errnoText("recv failed"), false);
      return;
    }
    std::unique_ptr<TlsSession> session;
    const bool mutual = tlsContext_->mutual();
    if (first == kExchangeTag[0] || first == kTlsHandshakeRecord) {
      if ((first == kExchangeTag[0]) == mutual) {
        rejectFromLoop(
            "TLS handshake with " + peerAddress_ +
            (mutual ? ": the peer keys TLS from the group secret and this "
                      "end uses certificates (set the same tls_cert, tls_key "
                      "and tls_ca on every worker)"
                    : ": the peer began TLS without the key exchange that "
                      "keys it from the group secret: it uses certificates "
                      "(set the same tls_cert, tls_key and tls_ca on every "
                      "worker) or is a torch_rpc_ext older than this one"));
        return;
      }
      if (!mutual) {
        exchangeFromLoop(); // reads the offer as it comes
        return;
      }
      try {
        session = tlsContext_->newSession(fd_, /*client=*/false, "");
      } catch (const std::exception& e) {
        closeInternal(e.what(), false);
        return;
      }
    } else if (tlsRequired_) {
      rejectFromLoop(
          "TLS handshake with " + peerAddress_ +
          ": the peer sent a frame in the clear: it does not encrypt this "
          "connection and this end does (set the same `encryption` on "
          "every worker)");
      return;
    }
    {
      std::lock_guard<std::mutex> lock(writeMutex_);
      if (state_ == State::kClosed) {
        return;
      }
      if (!session) {
        state_ = State::kHandshake; // in the clear, as the peer began
        updateEventsLocked();
      }
      tls_ = std::move(session);
    }
    if (!tls_) {
      onReadableFromLoop();
      return;
    }
  }
  std::string error;
  TlsSession::Step step = tls_->handshake(&error);
  if (step == TlsSession::Step::kFailed) {
    if (outbound_ && error.rfind("peer closed", 0) == 0) {
      error +=
          " during the TLS handshake (does the peer have encryption off? or "
          "was it over its cap on unauthenticated connections, or does it "
          "hold our address off for proofs it refused from it lately? its "
          "log says)";
    }
    std::string reason = "TLS handshake with " + peerAddress_ + ": " + error;
    if (outbound_) {
      closeInternal(reason, false);
    } else {
      // A TLS client we refused proved nothing: a wrong key or
      // certificate, or bytes that only began like TLS (one that went
      // away, or refused us, is no guess).
      if (tls_->refusedPeer()) {
        strikeSourceFromLoop();
      }
      rejectFromLoop(reason);
    }
    return;
  }
  if (step != TlsSession::Step::kDone) {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    wantWrite_ = step == TlsSession::Step::kWantWrite;
    loop_.modify(fd_, EPOLLIN | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u));
    return;
  }
  guessOut_ = false; // the server proved it holds the key
  // Our handshake's proofs will cover this TLS session's exporter value
  // (handshake.h): they hold on this session only.
  try {
    handshake_.bindTo(tls_->exporter());
  } catch (const std::exception& e) {
    closeInternal(e.what(), false);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    state_ = State::kHandshake;
    updateEventsLocked();
  }
  if (outbound_) {
    queueControl(uint8_t(frame::FrameKind::kHello), handshake_.hello());
  }
  // TLS read ahead: the peer's first frames may already wait in the
  // session, where the socket's readiness no longer shows them.
  onReadableFromLoop();
}

bool StreamConnection::sendOfferFromLoop() {
  std::string offer(kExchangeTag, kTagBytes);
  try {
    std::string sessionId = randomBytes(cpace::kSessionIdBytes);
    offer += sessionId;
    exchange_ = std::make_unique<cpace::Exchange>(
        tlsContext_->groupKey(), std::move(sessionId));
    offer += exchange_->share();
  } catch (const std::exception& e) {
    closeInternal("key exchange with " + peerAddress_ + ": " + e.what(), false);
    return false;
  }
  return sendExchangeMessageFromLoop(offer, "offer");
}

bool StreamConnection::sendExchangeMessageFromLoop(
    const std::string& message,
    const char* what) {
  // The first bytes this end sends on the socket: its buffer takes them
  // whole (a short send is an error, never a wait).
  ssize_t sent =
      ::send(fd_, message.data(), message.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (sent == static_cast<ssize_t>(message.size())) {
    return true;
  }
  std::string head = std::string("key exchange with ") + peerAddress_ +
      ": sending the " + what;
  closeInternal(
      sent < 0 ? errnoText((head + " failed").c_str())
               : head + ": the socket took " + std::to_string(sent) + " of " +
              std::to_string(message.size()) + " bytes",
      false);
  return false;
}

void StreamConnection::refuseExchangeFromLoop(const std::string& reason) {
  if (outbound_) {
    closeInternal(reason, false);
    return;
  }
  // A share that gives no secret (a point of small order): crafted, as no
  // honest client's is, after the server ran its side of the exchange.
  // Struck against its source, as a refused proof is. (A message without
  // the tag is not: garbage never counts, docs/security.md.)
  strikeSourceFromLoop();
  rejectFromLoop(reason);
}

bool StreamConnection::exchangeFromLoop() {
  const size_t want = outbound_ ? kAnswerBytes : kOfferBytes;
  while (exchangeIn_.size() < want) {
    char buf[kOfferBytes];
    ssize_t got = ::recv(fd_, buf, want - exchangeIn_.size(), MSG_DONTWAIT);
    const int recvErrno = errno;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      std::lock_guard<std::mutex> lock(writeMutex_);
      if (state_ != State::kClosed) {
        loop_.modify(fd_, EPOLLIN); // the rest wakes us
      }
      return false;
    }
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      const std::string part = std::to_string(exchangeIn_.size()) + " of " +
          std::to_string(want) + " bytes of its " +
          (outbound_ ? "answer" : "offer");
      const bool byPeer = got == 0 || recvErrno == ECONNRESET;
      std::string ended;
      if (byPeer) {
        ended = std::string("peer ") + (got == 0 ? "closed" : "reset") +
            " the connection";
      } else {
        errno = recvErrno;
        ended = errnoText("recv failed");
      }
      if (!outbound_ || !byPeer) {
        // (Accepted: it sent the tag's first byte at least, no mere knock.)
        closeInternal(
            (outbound_ ? "TLS handshake with " + peerAddress_ + ": " : "") +
                "key exchange: " + ended + " after " + part,
            false);
      } else {
        // (As driveTlsFromLoop() says a close, the key exchange named.)
        closeInternal(
            "TLS handshake with " + peerAddress_ + ": " + ended +
                " during the TLS handshake (does the peer have encryption "
                "off? or certificates where this end has none? or was it "
                "over its cap on unauthenticated connections, or does it "
                "hold our address off for proofs it refused from it lately? "
                "its log says), after " +
                part + " to our key exchange",
            false);
      }
      return false;
    }
    exchangeIn_.append(buf, size_t(got));
  }
  std::string_view in(exchangeIn_);
  if (in.substr(0, kTagBytes) != std::string_view(kExchangeTag, kTagBytes)) {
    std::string reason = "TLS handshake with " + peerAddress_ +
        ": the peer's key exchange message does not begin with its tag";
    outbound_ ? closeInternal(reason, false) : rejectFromLoop(reason);
    return false;
  }
  in.remove_prefix(kTagBytes);
  if (!outbound_) {
    try {
      exchange_ = std::make_unique<cpace::Exchange>(
          tlsContext_->groupKey(),
          std::string(in.substr(0, cpace::kSessionIdBytes)));
    } catch (const std::exception& e) { // ours (libcrypto), not the peer's
      closeInternal("key exchange: " + std::string(e.what()), false);
      return false;
    }
    in.remove_prefix(cpace::kSessionIdBytes);
    std::string answer(kExchangeTag, kTagBytes);
    answer += exchange_->share();
    if (!sendExchangeMessageFromLoop(answer, "answer")) {
      return false;
    }
  }
  std::string psk;
  try {
    psk = exchange_->finish(in, /*client=*/outbound_);
  } catch (const X25519PeerRefused& e) {
    refuseExchangeFromLoop(
        "TLS handshake with " + peerAddress_ + ": key exchange: " + e.what());
    return false;
  } catch (const std::exception& e) { // ours (libcrypto), not the peer's
    closeInternal("key exchange: " + std::string(e.what()), false);
    return false;
  }
  // A dial under way as its server's hold-off began: no binder for it.
  if (outbound_ && guessStrikes_ && guessStrikes_->heldOff(guessTarget_)) {
    closeInternal(heldOffServerText(*guessStrikes_, guessTarget_), false);
    return false;
  }
  std::unique_ptr<TlsSession> session;
  try {
    session = tlsContext_->newSession(fd_, outbound_, std::move(psk));
  } catch (const std::exception& e) {
    closeInternal(e.what(), false);
    return false;
  }
  exchange_.reset();
  std::string().swap(exchangeIn_);
  std::lock_guard<std::mutex> lock(writeMutex_);
  if (state_ == State::kClosed) {
    return false;
  }
  tls_ = std::move(session);
  // The client's next step writes its ClientHello, whose binder tells the
  // server whether its side of the exchange was under the right key.
  guessOut_ = outbound_ && guessStrikes_ != nullptr;
  return true;
}

} // namespace torch_rpc_ext::transport::stream
