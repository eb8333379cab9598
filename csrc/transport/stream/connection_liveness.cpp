// SPDX-License-Identifier: BSD-3-Clause
// A stream connection's liveness (connection.h): the handshake's deadline,
// the heartbeat and its pings, and which of our own sends count as the
// peer's sign of life.
#include "csrc/transport/stream/connection.h"

#include <sys/ioctl.h>

#include <algorithm>
#include <cerrno>

#include "csrc/common/host_load.h"

namespace torch_rpc_ext::transport::stream {

namespace {

// A handshake never takes longer than this many handshake timeouts, however
// the peer trickles its bytes (handshakeTimeoutFromLoop()), and a peer is
// never silent for longer than this many heartbeat timeouts however starved
// this process is (heartbeatFromLoop()).
constexpr int kMaxHandshakeTimeouts = 6;
// Saturated CPUs alone (no sign that this process itself was starved) buy a
// silent peer one more timeout at most: detection of a frozen or silent
// peer stays prompt on a busy host.
constexpr int kBusyHostTimeouts = 2;
// A ready connection's tick when the heartbeat is off: the backend's idle
// housekeeping (onTickFromLoop()) still runs.
constexpr std::chrono::milliseconds kIdleTick{2000};

} // namespace

void StreamConnection::armHandshakeTimer(std::chrono::milliseconds after) {
  handshakeDue_ = std::chrono::steady_clock::now() + after;
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  loop_.runAfter(after, [weak] {
    if (auto self = weak.lock()) {
      self->handshakeTimeoutFromLoop();
    }
  });
}

void StreamConnection::handshakeTimeoutFromLoop() {
  if (state_ == State::kReady || state_ == State::kClosed) {
    return;
  }
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  const auto now = std::chrono::steady_clock::now();
  const auto timeout = options_.handshakeTimeout;
  const auto heard = std::chrono::steady_clock::time_point(
      std::chrono::steady_clock::duration(lastActivity_.load()));
  // The timeout measures a silent peer, not a busy host. So the deadline
  // runs from the peer's last byte, and it does not fire while bytes of the
  // peer's wait unread in our socket or when this timer itself ran late
  // (then it is this process that was starved of CPU: a host full of
  // workers all connecting at once), nor while the host's CPUs are
  // saturated (host_load.h: then a peer on it is likely starved too; for
  // one more timeout at most). A peer that trickles bytes cannot hold the
  // slot for more than kMaxHandshakeTimeouts timeouts in all.
  if (now - handshakeStartedAt_ < kMaxHandshakeTimeouts * timeout) {
    if (now - heard < timeout) {
      armHandshakeTimer(
          duration_cast<milliseconds>(timeout - (now - heard)) +
          milliseconds(1));
      return;
    }
    int unread = 0;
    bool waiting = ::ioctl(fd_, FIONREAD, &unread) == 0 && unread > 0;
    bool late = now - handshakeDue_ > timeout / 4;
    bool busyHost = now - heard < kBusyHostTimeouts * timeout &&
        cpuPressurePercent() >= kStarvedPressurePercent;
    if (waiting || late || busyHost) {
      armHandshakeTimer(std::max(milliseconds(1), timeout / 4));
      return;
    }
  }
  auto silent = duration_cast<milliseconds>(now - heard).count();
  closeInternal(
      "handshake did not complete in time: nothing from the peer for " +
          std::to_string(silent) + " ms, waiting for " + awaitedText() +
          " (handshake_timeout " + std::to_string(timeout.count()) + " ms)",
      false);
}

void StreamConnection::scheduleHeartbeat() {
  auto every = options_.heartbeatTimeout.count() > 0
      ? options_.heartbeatTimeout / 5
      : kIdleTick;
  tickDue_ = std::chrono::steady_clock::now() + every;
  std::weak_ptr<StreamConnection> weak = weak_from_this();
  loop_.runAfter(every, [weak] {
    if (auto self = weak.lock()) {
      self->heartbeatFromLoop();
    }
  });
}

void StreamConnection::noteSentLocked(ssize_t sent, size_t asked) {
  // Bytes a buffer with room takes prove nothing: the kernel (or our ring)
  // takes them from a frozen or cut-off peer too, and a caller sending
  // every second kept such a peer "alive" until its buffers filled (TCP's:
  // megabytes, minutes). Bytes taken where a send found no room before
  // were drained by the peer. (-1 with an errno other than EAGAIN is a
  // failed write: nothing to note.)
  if (sent > 0 && outFull_) {
    noteActivity();
  }
  // Whether the socket (or the ring) left bytes of ours waiting: a TLS
  // send takes a record's worth at a time, so its pending output says, not
  // what it took of what we asked.
  if (sent >= 0) {
    outFull_ =
        tls_ ? tls_->hasPendingOutput() : static_cast<size_t>(sent) < asked;
  } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
    outFull_ = true;
  }
}

void StreamConnection::heartbeatFromLoop() {
  if (state_ != State::kReady) {
    return;
  }
  if (options_.heartbeatTimeout.count() > 0) {
    const auto timeout = options_.heartbeatTimeout;
    auto silent = std::chrono::steady_clock::now().time_since_epoch() -
        std::chrono::steady_clock::duration(lastActivity_.load());
    if (silent >= timeout) {
      // As for the handshake: a silent peer, not a starved host. Bytes of
      // the peer waiting unread in our socket, this tick running late (this
      // process was kept off the CPU), or saturated CPUs (host_load.h) give
      // the peer more time, up to kMaxHandshakeTimeouts timeouts in all.
      bool waiting = !socketEndedWhileHeld_ && inputWaitingFromLoop();
      bool late = std::chrono::steady_clock::now() - tickDue_ > timeout / 5;
      bool busy = waiting || late ||
          (silent < kBusyHostTimeouts * timeout &&
           cpuPressurePercent() >= kStarvedPressurePercent);
      if (!busy || silent >= kMaxHandshakeTimeouts * timeout) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(silent);
        Loop::Io::add(loop_.io().heartbeatTimeouts);
        closeInternal(
            "no sign of life from the peer for " +
                std::to_string(ms.count() / 1000.0).substr(0, 5) +
                " s (heartbeat_timeout)",
            false);
        return;
      }
    }
    // While a record is held (its bytes come on a lane), we read nothing
    // of the stream: the peer's pings go unanswered, and a lane's
    // keepalives, which count as its sign of life here, tell it nothing of
    // ours. So we ping each tick then: before session 94 a sender whose
    // stripe waited on a slow device copy took us for dead after one
    // heartbeat_timeout (of 2.5 s or more: the keepalives come each 0.5 s).
    // Likewise while a frame of the peer's is partly in (phase_): its
    // sender, whose own sends are no sign of our life (noteSentLocked) and
    // whose pings wait behind the frame it is writing, hears from us then
    // (a long frame through a chunk channel, a staged copy setting the
    // pace: the stream carries small records that never fill a buffer).
    if (silent >= timeout / 5 || recordHeld_ || phase_ != ReadPhase::kHeader) {
      queueControl(uint8_t(frame::FrameKind::kPing), {});
    }
  }
  tickChannelsFromLoop();
  if (state_ != State::kClosed) {
    scheduleHeartbeat();
  }
}

} // namespace torch_rpc_ext::transport::stream
