// SPDX-License-Identifier: BSD-3-Clause
// StreamConnection's TLS start (docs/architecture.md, "TLS"): whether a
// connection encrypts, and its TLS handshake before the frame handshake.
// Loop thread only.
#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>

#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

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
    try {
      session = tlsContext_->newSession(fd_, /*client=*/true);
    } catch (const std::exception& e) {
      closeInternal(e.what(), false);
      return TlsStart::kClosed;
    }
  }
  // Accepted: the client's first byte decides (driveTlsFromLoop()).
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
  if (!tls_) {
    // Accepted: a TLS client begins with a handshake record (type 22), one
    // in the clear with a frame header. TLS is taken from any peer (the two
    // ends may see different addresses: a NAT, a port forward); the clear
    // only from one this end need not encrypt for.
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
    if (first == 0x16) {
      try {
        session = tlsContext_->newSession(fd_, /*client=*/false);
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

} // namespace torch_rpc_ext::transport::stream
