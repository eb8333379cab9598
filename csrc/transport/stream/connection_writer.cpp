// SPDX-License-Identifier: BSD-3-Clause
// The write side of StreamConnection: the queue of outbound frames, vectored
// writes, descriptor passing, and frames whose chunked segments go through a
// backend's out-of-band channel. Callers hold writeMutex_ for everything
// named *Locked.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

namespace {

constexpr int kMaxIov = 1024;

// A socket's write refused because the peer closed its end (it may have
// sent frames first: StreamConnection::writeFailed()).
bool peerEnded(int err) {
  return err == EPIPE || err == ECONNRESET;
}

// A TlsSession's write error as a close reason: its socket's refusal says
// "write failed" already, TLS's own failures do not.
std::string tlsWriteFailed(const std::string& error) {
  return error.rfind("write failed", 0) == 0 ? error : "write failed: " + error;
}

} // namespace

void StreamConnection::resumeWritesFromLoop() {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    chunksBlocked_ = false;
    error = flushLocked();
  }
  afterFlush(error);
}

bool StreamConnection::write(frame::OutboundFrame frame) {
  if (state_ == State::kClosed) {
    return false;
  }
  const auto& limits = options_.limits;
  if (frame.segments.size() > limits.maxSegments ||
      frame.head.size() > limits.maxHeadBytes) { // (a small frame, maybe)
    throw std::length_error(
        "a frame of " + std::to_string(frame.segments.size()) +
        " segments (one per tensor storage) and a head of " +
        std::to_string(frame.head.size()) + " bytes exceeds this agent's " +
        std::to_string(limits.maxSegments) + " segments or " +
        std::to_string(limits.maxHeadBytes) + " head bytes");
  }
  if (frame.wireSize() > options_.limits.maxFrameBytes) {
    throw std::length_error(
        "frame of " + std::to_string(frame.wireSize()) + " bytes in " +
        std::to_string(frame.segments.size()) +
        " segments exceeds this agent's limits (max_frame_bytes=" +
        std::to_string(options_.limits.maxFrameBytes) + ")");
  }
  PendingWrite w;
  // The channels choose how segments travel (a region's copy happens now,
  // on this thread, with no lock held); a region segment's place on the
  // wire takes its record. `region` stays empty (no allocation) for a frame
  // with none.
  std::vector<uint8_t> slots;
  std::vector<channel::ControlFrame> before;
  try {
    planSegments(frame, w, slots, before);
  } catch (...) {
    abandonPlan(frame, w, slots, std::move(before));
    throw;
  }
  if (!w.staged.empty()) {
    // The frame holds its staged bytes too: they go back (outside
    // writeMutex_) when it is written or dropped.
    struct Held {
      std::shared_ptr<void> keepAlive;
      std::vector<std::shared_ptr<channel::StagedOut>> staged;
    };
    frame.keepAlive =
        std::make_shared<Held>(Held{std::move(frame.keepAlive), w.staged});
  }
  frame::FrameHeader h{};
  h.magic = frame::kFrameMagic;
  h.version = frame::kProtocolVersion;
  h.kind = uint8_t(frame.kind);
  h.headLength = static_cast<uint32_t>(frame.head.size());
  h.numSegments = static_cast<uint32_t>(frame.segments.size());
  for (const auto& segment : frame.segments) {
    h.dataLength += segment.size;
  }
  if (!w.chunked.empty()) {
    h.flags = frame::kFlagChunkedSegments;
  }
  w.prefix.reserve(sizeof(h) + 8 * frame.segments.size() + frame.head.size());
  w.prefix.append(reinterpret_cast<const char*>(&h), sizeof(h));
  for (size_t i = 0; i < frame.segments.size(); ++i) {
    uint64_t n = frame.segments[i].size;
    // The decision is made: the queue must not hold regions (their last
    // reference could then die under writeMutex_, and a dying lease takes it).
    frame.segments[i].origin = nullptr;
    uint8_t slot = !slots.empty() && slots[i] != 0 ? slots[i]
        : !w.chunked.empty()                       ? w.chunked[i]
                                                   : 0;
    if (slot != 0) {
      n |= uint64_t(channels_[slot - 1]->context().wireId())
          << frame::kChannelIdShift;
    }
    if (!w.staged.empty() && w.staged[i]) {
      // Written from host memory, as far as the copies out have come.
      frame.segments[i].data = w.staged[i]->data();
    } else if (!slots.empty() && slots[i] != 0) {
      // The record goes on the wire in the segment's place.
      frame.segments[i].data = &w.regionRecords[i];
      frame.segments[i].size = sizeof(frame::SegmentRecord);
    }
    w.prefix.append(reinterpret_cast<const char*>(&n), 8);
  }
  w.prefix += frame.head;
  frame.head.clear();
  w.frame = std::move(frame);
  Loop::Io::add(loop_.io().frames);
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return false;
    }
    bool wasEmpty = writes_.empty();
    // The channels' waiting control traffic takes this ride; a new region
    // reaches the peer before the first record that names it.
    for (auto& ch : channels_) {
      ch->collectPendingLocked(&before);
    }
    for (auto& b : before) {
      writes_.push_back(controlFrame(std::move(b)));
    }
    announceRegionsLocked(w, slots);
    writes_.push_back(std::move(w));
    if (state_ == State::kReady && wasEmpty) {
      error = flushLocked();
    }
  }
  afterFlush(error);
  return true;
}

std::string StreamConnection::flushLocked() {
  if (state_ == State::kClosed || state_ == State::kTls || !registered_) {
    return {};
  }
  std::chrono::nanoseconds ringWait = kRingWaitPerFlush;
  if (tls_) {
    // A record the socket did not take whole goes first.
    std::string error;
    int f = tls_->flush(&error);
    if (f < 0) {
      peerEndedWrites_ = tls_->sendRefusedByPeer();
      return tlsWriteFailed(error);
    }
    if (f == 0) {
      updateEventsLocked();
      return {};
    }
  }
  stagingBlocked_ = false;
  socketBodyBlocked_ = false;
  while (!writes_.empty()) {
    if (state_ != State::kReady && !writes_.front().control) {
      break;
    }
    if (!writes_.front().chunked.empty()) {
      if (chunksBlocked_) {
        break;
      }
      // Before its first byte, each chunk channel it uses may set itself up
      // (or resize) with a control frame that must reach the peer first.
      if (!writes_.front().started() && !writes_.front().channelChecked) {
        writes_.front().channelChecked = true;
        std::vector<PendingWrite> setups;
        for (size_t k = 0; k < channels_.size(); ++k) {
          const auto& used = writes_.front().chunked;
          if (std::find(used.begin(), used.end(), uint8_t(k + 1)) ==
              used.end()) {
            continue;
          }
          if (auto setup = channels_[k]->prepareChunksLocked()) {
            setups.push_back(controlFrame(std::move(*setup)));
          }
        }
        for (auto it = setups.rbegin(); it != setups.rend(); ++it) {
          writes_.push_front(std::move(*it));
        }
        if (!setups.empty()) {
          continue;
        }
      }
      std::string error;
      ChunkFlush r = flushChunkedFrameLocked(writes_.front(), &error);
      if (!error.empty()) {
        return error;
      }
      if (r != ChunkFlush::kDone) {
        chunksBlocked_ = r == ChunkFlush::kChannelFull;
        break;
      }
      auto& w = writes_.front();
      if (w.frame.keepAlive) {
        finished_.push_back(std::move(w.frame.keepAlive));
      }
      writes_.pop_front();
      continue;
    }
    iovec iov[kMaxIov];
    int n = 0;
    const std::vector<int>* fds = nullptr;
    bool toSocket = false; // a ring frame's body (the first write's)
    for (auto& w : writes_) {
      if (state_ != State::kReady && !w.control) {
        break;
      }
      if (!w.chunked.empty()) {
        break; // written on its own, above
      }
      if (ringOut_ && !w.ringMarked) {
        markForRingLocked(w);
      }
      if (!w.passFds.empty() && w.written == 0) {
        if (n > 0) {
          break; // descriptors ride on the first byte of their own send
        }
        fds = &w.passFds;
      }
      size_t skip = w.written;
      auto add = [&](const void* p, size_t len) {
        if (n == kMaxIov || len == 0) {
          return;
        }
        if (skip >= len) {
          skip -= len;
          return;
        }
        iov[n].iov_base = const_cast<char*>(static_cast<const char*>(p)) + skip;
        iov[n].iov_len = len - skip;
        skip = 0;
        ++n;
      };
      bool held = false;
      if (w.written == 0 && !stagedStartable(w)) {
        // Not started until each staged segment has its first chunk: a
        // started frame holds pings and every later frame behind it, and
        // the copies out may wait on the caller's work for long.
        stagingBlocked_ = n == 0;
        break;
      }
      add(w.prefix.data(), w.prefix.size());
      if (w.switchesToRing) {
        break; // what follows goes through the ring
      }
      if (w.bodyOnSocket) {
        if (w.written < w.prefix.size()) {
          break; // the prefix through the ring first, then the body
        }
        toSocket = true; // the first write (its prefix is out)
      }
      for (size_t j = 0; j < w.frame.segments.size() && !held; ++j) {
        const auto& s = w.frame.segments[j];
        size_t len = s.size;
        if (!w.staged.empty() && w.staged[j]) {
          // Up to what the copies out of the device have made ready.
          len = std::min<size_t>(len, w.staged[j]->readyBytes());
          held = len < s.size;
        }
        add(s.data, len);
      }
      if (held) {
        stagingBlocked_ = n == 0; // resumeWritesFromLoop() comes next
        break;
      }
      if (n == kMaxIov || fds != nullptr || toSocket) {
        break;
      }
    }
    if (n == 0) {
      break;
    }
    bool spansRing = false;
    if (ringOut_ && !toSocket) {
      // A frame of at least the ring's size left to go through it (the
      // first in iov; of one whose body goes on the socket, the prefix).
      const auto& w = writes_.front();
      uint64_t total = w.prefix.size();
      for (const auto& seg : w.frame.segments) {
        total += w.bodyOnSocket ? 0 : seg.size;
      }
      spansRing =
          total > w.written && total - w.written >= outRing_->capacity();
    }
    ssize_t sent = toSocket
        ? sendSocketLocked(iov, n, nullptr)
        : sendLocked(iov, n, fds, spansRing ? &ringWait : nullptr);
    size_t asked = 0;
    for (int k = 0; k < n; ++k) {
      asked += iov[k].iov_len;
    }
    noteSentLocked(sent, asked);
    if (sent < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        socketBodyBlocked_ = toSocket; // its EPOLLOUT resumes the body
        break;
      }
      if (errno == EINTR) {
        continue;
      }
      peerEndedWrites_ = ringError_.empty() &&
          (tls_ ? tls_->sendRefusedByPeer() : peerEnded(errno));
      return !ringError_.empty() ? "write failed: " + ringError_
          : tls_                 ? tlsWriteFailed(tlsWriteError_)
                                 : errnoText("write failed");
    }
    size_t left = static_cast<size_t>(sent);
    while (left > 0 && !writes_.empty()) {
      auto& w = writes_.front();
      size_t total = w.prefix.size();
      for (const auto& s : w.frame.segments) {
        total += s.size;
      }
      size_t need = total - w.written;
      if (left >= need) {
        left -= need;
        if (w.switchesToRing) {
          ringOut_ = true;
          outRing_->closeHandedOver(); // the peer has them now
        }
        if (w.frame.keepAlive) {
          finished_.push_back(std::move(w.frame.keepAlive));
        }
        writes_.pop_front();
      } else {
        w.written += left;
        left = 0;
      }
    }
  }
  updateEventsLocked();
  return {};
}

ssize_t StreamConnection::sendLocked(
    const iovec* iov,
    int n,
    const std::vector<int>* fds,
    std::chrono::nanoseconds* ringWait) {
  return ringOut_ ? sendToRingLocked(iov, n, fds, ringWait)
                  : sendSocketLocked(iov, n, fds);
}

ssize_t StreamConnection::sendSocketLocked(
    const iovec* iov,
    int n,
    const std::vector<int>* fds) {
  Loop::Io::add(loop_.io().writes);
  if (tls_) {
    // A piece of 16 KiB or more straight from its buffer (up to 256 KiB of
    // records a call: the caller comes back for more), smaller ones
    // gathered so a small frame is one record, not one per piece.
    constexpr size_t kRecord = 16384;
    const void* src = iov[0].iov_base;
    size_t size = iov[0].iov_len;
    if (size < kRecord && n > 1) {
      tlsGather_.clear();
      for (int i = 0; i < n && tlsGather_.size() < kRecord; ++i) {
        size_t take = std::min(iov[i].iov_len, kRecord - tlsGather_.size());
        tlsGather_.append(static_cast<const char*>(iov[i].iov_base), take);
      }
      src = tlsGather_.data();
      size = tlsGather_.size();
    }
    ssize_t got = counted(tls_->write(src, size, &tlsWriteError_));
    if (got == 0) {
      errno = EAGAIN;
      return -1;
    }
    if (got < 0) {
      errno = EPROTO;
    }
    return got;
  }
  if (fds == nullptr) {
    // sendmsg, not writev: MSG_NOSIGNAL (a reset peer must not raise
    // SIGPIPE in a program that restored its default action).
    msghdr msg{};
    msg.msg_iov = const_cast<iovec*>(iov);
    msg.msg_iovlen = static_cast<size_t>(n);
    return counted(::sendmsg(fd_, &msg, MSG_NOSIGNAL));
  }
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(n);
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds->size());
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds->size());
  std::memcpy(CMSG_DATA(c), fds->data(), sizeof(int) * fds->size());
  return counted(::sendmsg(fd_, &msg, MSG_NOSIGNAL));
}

ssize_t StreamConnection::counted(ssize_t written) {
  if (written > 0) {
    loop_.io().bytesWritten.fetch_add(
        static_cast<uint64_t>(written), std::memory_order_relaxed);
  }
  return written;
}

StreamConnection::ChunkFlush StreamConnection::flushChunkedFrameLocked(
    PendingWrite& w,
    std::string* error) {
  const auto& segments = w.frame.segments;
  if (!w.started() && !stagedStartable(w)) {
    return ChunkFlush::kChannelFull; // as in flushLocked()
  }
  while (true) {
    // Records first: the consumer can only take chunks it has heard of.
    if (w.recordsWritten < w.records.size()) {
      ssize_t got = sendSome(
          w.records.data() + w.recordsWritten,
          w.records.size() - w.recordsWritten,
          error);
      if (got <= 0) {
        return ChunkFlush::kSocketFull;
      }
      w.recordsWritten += static_cast<size_t>(got);
      if (w.recordsWritten == w.records.size()) {
        w.records.clear();
        w.recordsWritten = 0;
      }
      continue;
    }
    if (w.piece > segments.size()) {
      return ChunkFlush::kDone;
    }
    const char* data;
    size_t size;
    if (w.piece == 0) {
      data = w.prefix.data();
      size = w.prefix.size();
    } else {
      data = static_cast<const char*>(segments[w.piece - 1].data);
      size = segments[w.piece - 1].size;
    }
    if (w.pieceOffset == size) {
      ++w.piece;
      w.pieceOffset = 0;
      continue;
    }
    if (w.piece > 0 && !w.staged.empty() && w.staged[w.piece - 1]) {
      size = std::min<size_t>(size, w.staged[w.piece - 1]->readyBytes());
      if (w.pieceOffset == size) {
        return ChunkFlush::kChannelFull; // until more is ready
      }
    }
    if (w.piece > 0 && w.chunked[w.piece - 1] != 0) {
      frame::SegmentRecord record{};
      channel::StagedOut* staged =
          w.staged.empty() ? nullptr : w.staged[w.piece - 1].get();
      size_t n = channels_[w.chunked[w.piece - 1] - 1]->produceChunkLocked(
          data + w.pieceOffset, size - w.pieceOffset, staged, &record, error);
      if (!error->empty()) {
        return ChunkFlush::kSocketFull;
      }
      if (n == 0) {
        return ChunkFlush::kChannelFull;
      }
      w.pieceOffset += n;
      w.records.append(reinterpret_cast<const char*>(&record), sizeof(record));
      continue;
    }
    ssize_t got = sendSome(data + w.pieceOffset, size - w.pieceOffset, error);
    if (got <= 0) {
      return ChunkFlush::kSocketFull;
    }
    w.pieceOffset += static_cast<size_t>(got);
  }
}

bool StreamConnection::stagedStartable(const PendingWrite& w) {
  for (size_t j = 0; j < w.staged.size(); ++j) {
    if (w.staged[j] && w.staged[j]->readyBytes() == 0) {
      return false;
    }
  }
  for (const auto& s : w.stagedElsewhere) {
    if (s->readyBytes() == 0) {
      return false;
    }
  }
  return true;
}

ssize_t StreamConnection::sendSome(
    const char* data,
    size_t size,
    std::string* error) {
  if (ringOut_) {
    iovec one{const_cast<char*>(data), size};
    ssize_t got = sendToRingLocked(&one, 1, nullptr);
    noteSentLocked(got, size);
    if (got > 0) {
      return got;
    }
    if (errno == EAGAIN) {
      return 0;
    }
    *error = "write failed: " + ringError_;
    return -1;
  }
  Loop::Io::add(loop_.io().writes);
  if (tls_) {
    std::string why;
    ssize_t got = counted(tls_->write(data, size, &why));
    noteSentLocked(got, size);
    if (got < 0) {
      peerEndedWrites_ = tls_->sendRefusedByPeer();
      *error = tlsWriteFailed(why);
    }
    return got;
  }
  while (true) {
    ssize_t got = counted(::send(fd_, data, size, MSG_NOSIGNAL));
    noteSentLocked(got, size);
    if (got > 0) {
      return got;
    }
    if (got == 0 || errno == EAGAIN || errno == EWOULDBLOCK) {
      return 0;
    }
    if (errno != EINTR) {
      peerEndedWrites_ = peerEnded(errno);
      *error = errnoText("write failed");
      return -1;
    }
  }
}

void StreamConnection::updateEventsLocked() {
  if (state_ == State::kTls) {
    return; // driveTlsFromLoop() asks for what the TLS handshake needs
  }
  // Still connecting: the connect's completion (EPOLLOUT) is awaited
  // whatever is queued. A flush meanwhile (cuda_staged's resume, in the
  // loop's batch after startFromLoop()) found nothing to send (frames wait
  // for kReady) and took that wait away: the connection sat "waiting for
  // the connection to be accepted" until its handshake timed out (CI's
  // staged soak, twice; test_staged_channel.py).
  bool want = state_ == State::kConnecting ||
      (ringOut_ ? (carrierBlocked_ || socketBodyBlocked_) && !writes_.empty()
                : (!writes_.empty() &&
                   (state_ == State::kReady || writes_.front().control) &&
                   !(chunksBlocked_ && !writes_.front().chunked.empty()) &&
                   !stagingBlocked_) ||
               (tls_ && tls_->hasPendingOutput()));
  if (registered_ && want != wantWrite_ && state_ != State::kClosed) {
    wantWrite_ = want;
    loop_.modify(fd_, readEvents() | (want ? uint32_t(EPOLLOUT) : 0u));
  }
}

} // namespace torch_rpc_ext::transport::stream
