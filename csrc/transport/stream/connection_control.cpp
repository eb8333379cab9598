// SPDX-License-Identifier: BSD-3-Clause
// StreamConnection's control frames (the handshake's, pings and pongs, the
// channels' releases): made, and queued ahead of message frames not yet
// started. Callers hold writeMutex_ for everything named *Locked. Also what
// a failed write or a stalled handshake closes with, and reads held while a
// record's bytes come another way (a lane).
#include <poll.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

StreamConnection::PendingWrite StreamConnection::controlFrame(
    channel::ControlFrame frame) {
  Loop::Io::add(loop_.io().controlFrames);
  PendingWrite w;
  frame::FrameHeader h{
      frame::kFrameMagic,
      frame::kProtocolVersion,
      uint8_t(frame.kind),
      0,
      static_cast<uint32_t>(frame.head.size()),
      0,
      0};
  w.prefix.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  w.prefix += frame.head;
  w.passFds = std::move(frame.fds);
  w.frame.keepAlive = std::move(frame.keepAlive);
  return w;
}

void StreamConnection::sendControl(channel::ControlFrame frame) {
  std::vector<channel::ControlFrame> frames;
  frames.push_back(std::move(frame));
  sendControlFrames(std::move(frames), /*collect=*/false);
}

void StreamConnection::sendPendingControl() {
  sendControlFrames({}, /*collect=*/true);
}

void StreamConnection::sendControlFrames(
    std::vector<channel::ControlFrame> frames,
    bool collect) {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ != State::kReady) {
      // Nothing rides before kReady; after the close, nothing goes.
      for (auto& f : frames) {
        if (f.keepAlive) {
          finished_.push_back(std::move(f.keepAlive));
        }
      }
    } else {
      if (collect) {
        // What the channels keep for a ride, taken under the lock a
        // message frame takes it with (channel.h, sendPendingControl).
        for (auto& ch : channels_) {
          ch->collectPendingLocked(&frames);
        }
      }
      // The caller may be any thread (a dying tensor's): it sends only
      // these frames, if nothing else waits; else the loop thread does.
      bool wasEmpty = writes_.empty();
      // Each goes to the front: in reverse, they keep their order.
      for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
        PendingWrite w = controlFrame(std::move(*it));
        // Our own housekeeping proves nothing of the peer (heartbeat).
        w.control = true;
        insertControlLocked(std::move(w));
      }
      if (!frames.empty() && wasEmpty) {
        error = flushLocked();
      } else if (!frames.empty()) {
        updateEventsLocked();
      }
    }
  }
  afterFlush(error);
}

void StreamConnection::insertControlLocked(PendingWrite w) {
  // Control frames jump the queue: nothing else is sent before kReady, and
  // a pong may not split a frame that is partly written.
  auto pos = writes_.begin();
  if (pos != writes_.end() && pos->started()) {
    ++pos;
  }
  writes_.insert(pos, std::move(w));
}

void StreamConnection::queueControl(uint8_t kind, std::string head) {
  PendingWrite w =
      controlFrame({frame::FrameKind(kind), std::move(head), {}, nullptr});
  w.control = true;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    insertControlLocked(std::move(w));
    error = flushLocked();
  }
  afterFlush(error);
}

bool StreamConnection::writeFailed(const std::string& error) {
  // A peer may send its last frames and close at once, before our next
  // write (a heartbeat, our frame ring's offer, an answer): that write
  // fails, and closing then would drop frames it sent before, unread in
  // our socket. (Seen as a lost frame on a starved host: the peer finished
  // before our loop got back to the handshake it had just completed.)
  if (!peerProven_ || !peerEndedWrites_ || state_ == State::kClosed) {
    closeInternal(error, false);
    return false;
  }
  if (closingAfterInput_.exchange(true)) {
    return true;
  }
  std::weak_ptr<StreamConnection> weak = weak_from_this();
  loop_.post([weak, error] {
    if (auto self = weak.lock()) {
      self->closeAfterInputFromLoop(error);
    }
  });
  return true;
}

void StreamConnection::closeAfterInputFromLoop(const std::string& error) {
  // Bounded by what the peer left: it has closed, so no more comes. Each
  // round reads until the socket (or its ring, for kRingWaitPerFlush) has
  // nothing, or the peer's end closes the connection ("peer closed"). The
  // socket's end may not have been seen yet: the refused write proved it.
  if (inRing_) {
    socketEnded_ = true; // closed once the ring is read to its end
  }
  for (int round = 0; round < 64 && state_ == State::kReady; ++round) {
    onReadableFromLoop();
    if (recordHeld_ && state_ == State::kReady) {
      // Its bytes come another way (a lane), and may still: the rest is
      // read, and the connection closed, once they are in.
      closeWhenResumed_ = error;
      return;
    }
    if (!inputWaitingFromLoop()) {
      break;
    }
  }
  if (inRing_ && state_ == State::kReady && !inputWaitingFromLoop()) {
    // The ring is read to its end: what the next read would have said. (A
    // round ends at its ring deadline, kRingWaitPerFlush, which a loaded
    // host can reach right after the peer's last frame, before the read
    // that finds the end: the write's error stood in for it, seen in a
    // README run with a 1 MiB body on the socket.)
    closeInternal(kPeerClosed, false);
    return;
  }
  closeInternal(error, false);
}

void StreamConnection::resumeReadsFromLoop() {
  if (!recordHeld_ || state_ == State::kClosed) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    recordHeld_ = false;
    socketEndedWhileHeld_ = false; // its end comes back, read this time
  }
  if (!placeRecordFromLoop()) {
    return; // closed, or held again
  }
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (registered_ && state_ != State::kClosed) {
      loop_.modify(fd_, readEvents() | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u));
    }
  }
  // What was read past the record, then what the socket has meanwhile.
  if (consumeFromLoop()) {
    onReadableFromLoop();
  }
  if (closeWhenResumed_ && !recordHeld_ && state_ != State::kClosed) {
    std::string why = std::move(*closeWhenResumed_);
    closeWhenResumed_.reset();
    closeAfterInputFromLoop(why);
  }
}

uint32_t StreamConnection::readEvents() const {
  // A frame ring's socket carries descriptors and large bodies, taken as
  // their frames are parsed: only its end is watched, and its input while a
  // body is read (but not while a record is held: rings are shm's and lanes
  // TCP's, so never both).
  if (recordHeld_) {
    return socketEndedWhileHeld_ ? uint32_t(EPOLLONESHOT) : 0u;
  }
  return !ringIn_     ? uint32_t(EPOLLIN)
      : bodyOnSocket_ ? uint32_t(EPOLLIN | EPOLLRDHUP)
                      : uint32_t(EPOLLRDHUP);
}

void StreamConnection::socketEndedWhileHeldFromLoop() {
  // Bounded: a record's channel resumes reads or loses the connection
  // (a lane that ends first), and the heartbeat closes a silent one (lane
  // progress is activity; the gone socket's unread bytes are not).
  if (socketEndedWhileHeld_.exchange(true)) {
    return; // EPOLLONESHOT's one event: the socket is not watched now
  }
  Loop::Io::add(loop_.io().heldSocketEnds);
  std::lock_guard<std::mutex> lock(writeMutex_);
  if (registered_ && state_ != State::kClosed) {
    loop_.modify(fd_, readEvents() | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u));
  }
}

bool StreamConnection::inputWaitingFromLoop() const {
  int unread = 0;
  return (::ioctl(fd_, FIONREAD, &unread) == 0 && unread > 0) ||
      !socketStash_.empty() || !ringStash_.empty() ||
      (inRing_ && inRing_->waiting() != 0);
}

std::string StreamConnection::awaitedText() const {
  // Which side was slow, and where: a hello never sent (the peer never ran
  // its loop after connecting), a challenge or proof that never came (the
  // peer stalled mid-way, or stopped there on purpose).
  if (state_ == State::kConnecting) {
    // Which of two it was (a loaded CI host saw this twice over shm): a
    // socket connected, whose writable event this loop never handled, or
    // one the peer's end never took.
    pollfd p{fd_, POLLOUT, 0};
    bool writable = ::poll(&p, 1, 0) == 1 && (p.revents & POLLOUT) != 0;
    return std::string("the connection to be accepted (our socket ") +
        (writable ? "is writable, its event not handled"
                  : "is not writable yet") +
        "; loop takeovers " + std::to_string(loop_.takeovers()) + ")";
  }
  if (state_ == State::kTls) {
    return "its TLS handshake";
  }
  switch (handshake_.expectedKind()) {
    case frame::FrameKind::kHello:
      return "its hello";
    case frame::FrameKind::kChallenge:
      return "its challenge";
    default:
      return "its proof";
  }
}

} // namespace torch_rpc_ext::transport::stream
