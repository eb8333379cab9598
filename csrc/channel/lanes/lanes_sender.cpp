// SPDX-License-Identifier: BSD-3-Clause
// LanesChannel, sending: segments striped over the peer's lanes, each lane
// dialled and then written by a thread of its own.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"
#include "csrc/common/logging.h"
#include "csrc/common/resident_pages.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

constexpr uint64_t kStripeAlign = 64 * 1024;
constexpr int kDialTimeoutMs = 5000;
// A CPU stripe's memory is asked whether it is in RAM this much at a time.
constexpr uint64_t kResidentWindow = 8ull << 20;

} // namespace

void LanesChannel::takeRegions(
    const std::vector<frame::OutboundFrame::Segment>& segments,
    const std::vector<size_t>& offered,
    std::vector<TakenRegion>* taken,
    std::vector<ControlFrame>* /*before*/,
    const std::shared_ptr<void>& keepAlive) {
  auto stripes = [&](const frame::OutboundFrame::Segment& segment) {
    return segment.size >= minBytes_ && segment.size <= kMaxStripedBytes;
  };
  bool any = false;
  for (size_t i : offered) {
    any = any || stripes(segments[i]);
  }
  if (!any) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!lanesTakeLocked()) {
    return;
  }
  for (size_t i : offered) {
    const auto& segment = segments[i];
    if (!stripes(segment)) {
      continue;
    }
    // A provisional number until the frame is queued (the token then).
    uint64_t id = nextTaken_++;
    taken_.emplace(
        id,
        Taken{static_cast<const char*>(segment.data), segment.size, keepAlive});
    frame::SegmentRecord record{};
    LaneRecord r{id, segment.size};
    std::memcpy(&record, &r, sizeof(record));
    taken->push_back({i, record});
  }
}

bool LanesChannel::takeStaged(
    const frame::OutboundFrame::Segment& segment,
    const std::shared_ptr<StagedOut>& staged,
    frame::SegmentRecord* record,
    const std::shared_ptr<void>& keepAlive) {
  if (segment.size < minBytes_ || segment.size > kMaxStripedBytes) {
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!lanesTakeLocked()) {
    return false;
  }
  // The stripes hold the frame and the staged bytes.
  struct Both {
    std::shared_ptr<void> frame;
    std::shared_ptr<StagedOut> staged;
  };
  uint64_t id = nextTaken_++;
  taken_.emplace(
      id,
      Taken{
          staged->data(),
          segment.size,
          std::make_shared<Both>(Both{keepAlive, staged}),
          staged.get()});
  LaneRecord r{id, segment.size};
  std::memcpy(record, &r, sizeof(*record));
  return true;
}

bool LanesChannel::lanesTakeLocked() {
  if (closing_) {
    return false;
  }
  if ((outState_ == OutState::kIdle || outState_ == OutState::kCapped) &&
      offered_) {
    startLanesLocked(); // this segment and any until they are up: the stream
  }
  return outState_ == OutState::kUp;
}

bool LanesChannel::waitStaged(
    const StagedOut& staged,
    uint64_t end,
    const std::function<bool()>& keepAlive,
    std::string* error) {
  // The staging thread raises the mark chunk by chunk (4 MiB at PCIe
  // speed: ~100-300 us each) and wakes us (StagedOut::waitReady). A failed
  // copy closes the connection where it still exists; one gone without
  // closing never stops us, so that is checked every 10 ms too.
  auto there = [&] { return staged.readyBytes() >= end || staged.failed(); };
  if (!there() &&
      !waitSayingAlive(
          [&] {
            staged.waitReady(end, std::chrono::milliseconds(10));
            return there();
          },
          keepAlive,
          "its device copy was under way",
          error)) {
    return false;
  }
  if (staged.failed()) {
    // (Chunks seen out of order may have raised the mark past it.)
    *error = "cuda_staged: copying a segment out of its device failed";
    return false;
  }
  return true;
}

void LanesChannel::onRegionsQueuedLocked(
    const std::vector<frame::SegmentRecord*>& records) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (frame::SegmentRecord* record : records) {
      LaneRecord r;
      std::memcpy(&r, record, sizeof(r));
      auto it = taken_.find(r.token);
      if (it == taken_.end()) {
        continue; // unreachable: taken, not abandoned
      }
      Taken t = std::move(it->second);
      taken_.erase(it);
      if (closing_) {
        continue; // the frame holds its memory too: never the last owner
      }
      r.token = nextToken_++;
      std::memcpy(record, &r, sizeof(r));
      queueStripesLocked(r.token, std::move(t));
    }
  }
  wake_.notify_all();
}

bool LanesChannel::hasQueuedSends() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closing_) {
    return false; // (what was queued is dropped)
  }
  if (stripesWriting_ > 0 || !taken_.empty()) {
    return true;
  }
  for (const auto& lane : out_) {
    if (!lane.queue.empty()) {
      return true;
    }
  }
  return false;
}

void LanesChannel::queueStripesLocked(uint64_t token, Taken taken) {
  auto& stats = lanesContext().stats();
  const size_t n = out_.size();
  uint64_t stripe = (taken.size + n - 1) / n;
  stripe = (stripe + kStripeAlign - 1) / kStripeAlign * kStripeAlign;
  size_t lane = nextFirstLane_;
  nextFirstLane_ = (nextFirstLane_ + 1) % n;
  for (uint64_t offset = 0; offset < taken.size; offset += stripe) {
    out_[lane].queue.push_back(
        Stripe{
            token,
            taken.size,
            offset,
            std::min<uint64_t>(stripe, taken.size - offset),
            taken.data,
            taken.keepAlive,
            taken.staged});
    lane = (lane + 1) % n;
  }
  stats.segments.fetch_add(1, std::memory_order_relaxed);
  if (taken.staged != nullptr) {
    stats.stagedSegments.fetch_add(1, std::memory_order_relaxed);
  }
  stats.bytes.fetch_add(taken.size, std::memory_order_relaxed);
}

void LanesChannel::abandonRegion(
    const frame::OutboundFrame::Segment& /*segment*/,
    const frame::SegmentRecord& record) {
  // Its frame was never queued: nothing went to the lanes.
  LaneRecord r;
  std::memcpy(&r, &record, sizeof(r));
  std::shared_ptr<void> keepAlive;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = taken_.find(r.token);
    if (it != taken_.end()) {
      keepAlive = std::move(it->second.keepAlive);
      taken_.erase(it);
    }
  }
}

void LanesChannel::startLanesLocked() {
  // As many of the lanes offered as the process's cap leaves (the peer
  // takes any of its tickets; the rest are revoked at close).
  uint64_t n = lanesContext().holdLanes(/*inbound=*/false, outTickets_.size());
  if (n == 0) {
    // None left: the stream, until lanes go back.
    if (outState_ != OutState::kCapped) {
      outState_ = OutState::kCapped;
      lanesContext().noteCapped(
          /*inbound=*/false, describeAddress(peerAddress_));
    }
    return;
  }
  heldOut_ = n;
  outState_ = OutState::kDialing;
  out_.resize(n);
  for (uint16_t i = 0; i < out_.size(); ++i) {
    try {
      out_[i].thread = std::thread([self = shared_from_this(),
                                    i,
                                    address = peerLanes_,
                                    ticket = outTickets_[i]] {
        nameThisThread("rpcx-lane-out");
        self->runOutLane(i, address, ticket);
      });
    } catch (const std::exception& e) {
      // Out of threads: this connection stays on its stream (the lanes
      // started so far dial, then idle until it closes; the rest go back).
      outState_ = OutState::kFailed;
      lanesContext().releaseLanes(/*inbound=*/false, heldOut_ - i);
      heldOut_ = i;
      // (mutex_ is held here: the decline goes from the loop.)
      if (auto host = host_.lock()) {
        host->post([weak = weak_from_this()] {
          if (auto self = weak.lock()) {
            self->sendDecline();
          }
        });
      }
      lanesContext().stats().lanesFailed.fetch_add(
          1, std::memory_order_relaxed);
      logWarning(
          std::string("torch_rpc_ext: tcp_lanes: no thread for a lane (") +
          e.what() +
          "); large tensors to this peer travel in the "
          "connection's stream");
      return;
    }
  }
}

void LanesChannel::runOutLane(
    uint16_t lane,
    sockaddr_storage address,
    std::string ticket) {
  auto& stats = lanesContext().stats();
  std::string error;
  int fd = dialLane(
      address, kDialTimeoutMs, [this] { return stop_.load(); }, &error);
  if (fd >= 0 && !sayHello(fd, lane, ticket, &error)) {
    ::close(fd);
    fd = -1;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (fd < 0 || closing_) {
    bool decline = false;
    if (fd >= 0) {
      ::close(fd);
    } else if (!closing_) {
      --heldOut_; // no thread or socket left of this lane: it goes back
      lanesContext().releaseLanes(/*inbound=*/false, 1);
      // Counted after the release (seq_cst, as lanes_out's update is): a
      // reader of the stats that sees this failure sees its lane gone.
      stats.lanesFailed.fetch_add(1);
      if (outState_ == OutState::kDialing) {
        outState_ = OutState::kFailed;
        decline = true;
        const std::string line = "torch_rpc_ext: tcp_lanes: lane " +
            std::to_string(lane) + " to " + describeAddress(address) +
            " failed (" + error +
            "); large tensors to this peer travel in the connection's "
            "stream (is that port reachable? docs/guide.md, firewalls)";
        if (lanesContext().encryptedOnly()) {
          // Lanes the program did not name (the default on encrypted
          // connections): said now and then, not for every peer.
          logWarningLimited(
              "tcp_lanes default dial",
              line +
                  "; lanes are on by default for encrypted connections, "
                  "TORCH_RPC_EXT_LANES_WHEN_ENCRYPTED=0 turns them off");
        } else {
          logWarning(line);
        }
      }
    }
    lock.unlock();
    if (decline) {
      sendDecline();
    }
    return;
  }
  out_[lane].fd = fd;
  stats.lanesOpened.fetch_add(1, std::memory_order_relaxed);
  std::unique_ptr<LaneCipher> cipher;
  if (outEncrypted_) {
    cipher = std::make_unique<LaneCipher>(
        outSecret_, lane, outRecordsPerKey_, &stats.rekeys);
  }
  if (++outUp_ == out_.size() && outState_ == OutState::kDialing) {
    outState_ = OutState::kUp;
  }
  std::string buffer;
  while (true) {
    // Woken by a stripe or by closing; a connection that died without
    // closing (its channels destroyed with it) ends us within a second.
    wake_.wait_for(lock, std::chrono::seconds(1), [&] {
      return closing_ || !out_[lane].queue.empty();
    });
    if (closing_) {
      return;
    }
    if (host_.expired()) {
      // Gone without closing: the peer's reader learns it from us.
      ::shutdown(fd, SHUT_RDWR);
      return;
    }
    if (out_[lane].queue.empty()) {
      continue;
    }
    Stripe stripe = std::move(out_[lane].queue.front());
    out_[lane].queue.pop_front();
    ++stripesWriting_;
    lock.unlock();
    bool ok;
    try {
      ok = writeStripe(fd, stripe, cipher.get(), &buffer, &error);
    } catch (const std::exception& e) {
      ok = false;
      error = e.what();
    }
    release(std::move(stripe.keepAlive));
    lock.lock();
    --stripesWriting_;
    if (!ok) {
      if (!closing_) {
        lock.unlock();
        failConnection(
            "tcp_lanes: lane " + std::to_string(lane) + " to " +
                describeAddress(address) + " failed: " + error,
            /*refused=*/false);
      }
      return;
    }
  }
}

bool LanesChannel::writeForged(
    int fd,
    const Stripe& stripe,
    std::string* error) {
  // For a segment no record will claim: what the receiver lets in of it
  // would wait there, unclaimed, for the connection's life.
  const uint64_t token = stripe.token + (uint64_t(1) << 40);
  const std::string& how = lanesContext().settings().testForge;
  const char byte = 0;
  auto chunk = [&](uint64_t segmentSize, uint64_t offset) {
    ChunkHeader header{token, segmentSize, offset, 1, 0};
    return sendAll(fd, &header, sizeof(header), error) &&
        sendAll(fd, &byte, 1, error);
  };
  if (how == "tiny") {
    return chunk(1, 0);
  }
  // "scatter": more pieces than a segment may arrive in.
  for (uint64_t k = 0; k <= kMaxRangesPerSegment; ++k) {
    if (!chunk(stripe.segmentSize, stripe.offset + 2 * k)) {
      return false;
    }
  }
  return true;
}

void LanesChannel::sendDecline() {
  // The peer's lanes go back to its cap, not held for our life.
  if (auto host = host_.lock()) {
    host->sendControl(
        ControlFrame{context().wireIds().kind(kDeclineFrame), {}, {}, nullptr});
  }
}

bool LanesChannel::sayHello(
    int fd,
    uint16_t lane,
    const std::string& ticket,
    std::string* error) {
  uint8_t challenge[kChallengeBytes];
  if (!recvWithin(
          fd,
          challenge,
          sizeof(challenge),
          kDialTimeoutMs,
          [this] { return stop_.load(); },
          error)) {
    *error = "no challenge from the lanes' listener (" + *error + ")";
    return false;
  }
  Hello hello{kHelloMagic, kHelloVersion, lane, {}, {}};
  std::memcpy(hello.ticket, ticket.data(), kTicketBytes);
  try {
    // The secret was set before any lane thread started, and stays.
    helloMac(helloKey(outSecret_), challenge, lane, hello.ticket, hello.mac);
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
  if (!sendAll(fd, &hello, sizeof(hello), error)) {
    return false;
  }
  // Up only once the listener took it: one that refused it (a ticket
  // revoked, its pending hellos full, no thread to run the lane) closes
  // it, and a stripe written meanwhile would be lost with it.
  uint8_t answer = 0;
  if (!recvWithin(
          fd,
          &answer,
          1,
          kDialTimeoutMs,
          [this] { return stop_.load(); },
          error)) {
    *error = *error == "closed"
        ? std::string(
              "the lanes' listener closed the lane after its hello "
              "(refused it)")
        : "no admission from the lanes' listener after the hello (" + *error +
            ")";
    return false;
  }
  if (answer != kAdmitted) {
    *error = "the lanes' listener answered the hello with byte " +
        std::to_string(answer) + ", not its admission";
    return false;
  }
  return true;
}

bool LanesChannel::sendKeepAlive(
    int fd,
    const Stripe& stripe,
    uint64_t offset,
    LaneCipher* cipher,
    std::string* error) {
  lanesContext().stats().keepAlives.fetch_add(1, std::memory_order_relaxed);
  ChunkHeader header{
      stripe.token, stripe.segmentSize, offset, 0, kChunkKeepAlive};
  if (cipher == nullptr) {
    return sendAll(fd, &header, sizeof(header), error);
  }
  // A record of no bytes: the tag covers the header (and its sequence).
  char record[sizeof(header) + Aead::kTagBytes];
  std::memcpy(record, &header, sizeof(header));
  char none = 0;
  cipher->seal(
      std::string_view(record, sizeof(header)),
      &none,
      &none,
      0,
      reinterpret_cast<uint8_t*>(record + sizeof(header)));
  return sendAll(fd, record, sizeof(record), error);
}

bool LanesChannel::writeStripe(
    int fd,
    const Stripe& stripe,
    LaneCipher* cipher,
    std::string* buffer,
    std::string* error) {
  if (cipher == nullptr && !lanesContext().settings().testForge.empty() &&
      !forged_.exchange(true) && !writeForged(fd, stripe, error)) {
    return false;
  }
  if (lanesContext().settings().testStuckCopy && !stuck_.exchange(true)) {
    while (!stop_.load() && !host_.expired()) {
      if (!sendKeepAlive(fd, stripe, stripe.offset, cipher, error)) {
        return false;
      }
      std::this_thread::sleep_for(kKeepAliveEvery);
    }
    *error = "closing";
    return false;
  }
  const uint64_t piece = cipher != nullptr ? kRecordBytes : kClearChunkBytes;
  uint64_t resident = 0; // of the stripe, seen in memory
  for (uint64_t done = 0; done < stripe.length;) {
    uint64_t length = std::min(piece, stripe.length - done);
    const char* src = stripe.data + stripe.offset + done;
    auto sayAlive = [&] {
      return sendKeepAlive(fd, stripe, stripe.offset + done, cipher, error);
    };
    if (stripe.staged != nullptr &&
        !waitStaged(
            *stripe.staged, stripe.offset + done + length, sayAlive, error)) {
      return false;
    }
    if (stripe.staged == nullptr && done + length > resident) {
      const uint64_t window =
          std::min(stripe.length - done, std::max(length, kResidentWindow));
      if (pagesResident(src, window)) {
        resident = done + window; // (a tensor's memory, nearly always)
      } else {
        // Pages that must come in from a file or swap first (a memory-
        // mapped tensor): read in off this thread, which says it is alive
        // meanwhile (or the receiver would take the silence for a stalled
        // lane), 1 MiB at a time, this chunk cut to it, so that the
        // receiver counts each as progress, as it did each MiB the send
        // faulted in: slow storage that keeps moving is no stall.
        const uint64_t slice = std::min(window, kProgressSliceBytes);
        if (!waitResident(src, slice, stripe.keepAlive, sayAlive, error)) {
          return false;
        }
        resident = done + slice;
        length = std::min(length, slice);
      }
    }
    ChunkHeader header{
        stripe.token,
        stripe.segmentSize,
        stripe.offset + done,
        static_cast<uint32_t>(length),
        0};
    if (cipher == nullptr) {
      if (!sendAll(fd, &header, sizeof(header), error)) {
        return false;
      }
      for (uint64_t sent = 0; sent < length;) {
        uint64_t slice = std::min(kProgressSliceBytes, length - sent);
        if (!sendAll(fd, src + sent, slice, error)) {
          return false;
        }
        sent += slice;
        if (sent < length) {
          noteProgress();
        }
      }
    } else {
      buffer->resize(sizeof(header) + length + Aead::kTagBytes);
      char* out = buffer->data();
      std::memcpy(out, &header, sizeof(header));
      cipher->seal(
          std::string_view(out, sizeof(header)),
          src,
          out + sizeof(header),
          length,
          reinterpret_cast<uint8_t*>(out + sizeof(header) + length));
      if (!sendAll(fd, out, buffer->size(), error)) {
        return false;
      }
    }
    done += length;
    // Bytes the socket took: the peer is reading (its stream may not be,
    // while it holds a record for these stripes).
    noteProgress();
  }
  return true;
}

} // namespace torch_rpc_ext::channel::lanes
