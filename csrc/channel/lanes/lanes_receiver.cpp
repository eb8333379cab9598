// SPDX-License-Identifier: BSD-3-Clause
// LanesChannel, receiving: each lane's reader thread lands chunks in the
// segment's memory; a record waits in the stream until its segment is in.
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

// What an unclaimed landing pins: its memory comes in whole pages.
uint64_t pinnedBytes(uint64_t size) {
  return (size + 4095) / 4096 * 4096;
}

// Landing memory from the context's pool, given back when the last tensor
// viewing it is gone.
class LandingRegion final : public frame::SharedRegion {
 public:
  LandingRegion(std::shared_ptr<BufferPool> pool, size_t size)
      : pool_(std::move(pool)), block_(pool_->acquire(size)) {}
  ~LandingRegion() override {
    pool_->release(block_);
  }
  char* data() const {
    return static_cast<char*>(block_.data);
  }

 private:
  std::shared_ptr<BufferPool> pool_;
  BufferPool::Block block_;
};

} // namespace

void LanesChannel::attachInbound(uint16_t lane, int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closing_ || declined_ || inLanes_ >= heldIn_) {
    ::close(fd); // (its dialler, which declined our lanes, fails it)
    return;
  }
  const size_t slot = inFds_.size();
  try {
    inFds_.reserve(slot + 1); // (stopAll() shuts every lane's fd)
    inSlots_.reserve(slot + 1);
    inThreads_.emplace_back([self = shared_from_this(), lane, slot, fd] {
      self->runInLane(lane, slot, fd);
    });
  } catch (...) {
    ::close(fd);
    throw; // the accept thread logs it; the peer's lane fails, and closes
  }
  inFds_.push_back(fd);
  inSlots_.emplace_back();
  ++inLanes_;
  lanesContext().stats().lanesOpened.fetch_add(1, std::memory_order_relaxed);
}

std::shared_ptr<LanesChannel::Landing> LanesChannel::landingLocked(
    std::unique_lock<std::mutex>& lock,
    uint64_t token,
    uint64_t size,
    bool claim,
    std::string* error,
    bool* refused) {
  auto it = landings_.find(token);
  if (it == landings_.end() && !claim) {
    // Stripes ahead of their record wait for room, as long as it takes:
    // records free it, and they come (stripes and records are queued in
    // one order, so the record a held stream waits for never waits behind
    // this chunk; a later one's record arrives and claims its landing).
    // A stream that stops (a dead peer, a partition) closes the
    // connection, which ends the wait. A time limit here would fail a
    // slow stream that is still moving: the heartbeat watches that.
    auto room = [&] {
      return closing_ || landings_.count(token) != 0 ||
          (pinnedBytes(size) <= kMaxUnclaimedBytes - unclaimedBytes_ &&
           unclaimedSegments_ < kMaxUnclaimedSegments);
    };
    // (A connection dropped without closing: no record comes, ever.)
    while (!budget_.wait_for(lock, std::chrono::seconds(1), room)) {
      if (host_.expired()) {
        *error = "closed";
        return nullptr;
      }
    }
    if (closing_) {
      *error = "closed";
      return nullptr;
    }
    it = landings_.find(token);
  }
  if (it != landings_.end()) {
    auto& landing = it->second;
    if (landing->size != size) {
      *refused = true;
      *error = "segment " + std::to_string(token) + " announced as " +
          std::to_string(landing->size) + " and " + std::to_string(size) +
          " bytes";
      return nullptr;
    }
    if (claim) {
      if (landing->claimed) {
        *refused = true;
        *error = "two records for segment " + std::to_string(token);
        return nullptr;
      }
      landing->claimed = true;
      unclaimedBytes_ -= pinnedBytes(size);
      --unclaimedSegments_;
      budget_.notify_all();
    }
    return landing;
  }
  auto landing = std::make_shared<Landing>();
  try {
    auto region =
        std::make_shared<LandingRegion>(lanesContext().sharedPool(), size);
    landing->data = region->data();
    landing->region = std::move(region);
  } catch (const std::bad_alloc&) {
    *error =
        "out of memory for a segment of " + std::to_string(size) + " bytes";
    return nullptr;
  }
  landing->size = size;
  landing->claimed = claim;
  if (!claim) {
    unclaimedBytes_ += pinnedBytes(size);
    ++unclaimedSegments_;
  }
  landings_.emplace(token, landing);
  if (claim) {
    // A lane may wait for room to land this segment's first chunk: its
    // landing is here now.
    budget_.notify_all();
  }
  return landing;
}

void LanesChannel::eraseLandingLocked(uint64_t token) {
  auto it = landings_.find(token);
  if (it == landings_.end()) {
    return;
  }
  if (!it->second->claimed) {
    unclaimedBytes_ -= pinnedBytes(it->second->size);
    --unclaimedSegments_;
    budget_.notify_all();
  }
  landings_.erase(it);
}

bool LanesChannel::landingsCompleteLocked() const {
  for (const auto& [token, landing] : landings_) {
    if (landing->received < landing->size) {
      return false;
    }
  }
  return true;
}

void LanesChannel::noteProgress() {
  if (auto host = host_.lock()) {
    host->noteProgress();
  }
}

void LanesChannel::runInLane(uint16_t lane, size_t slot, int fd) {
  std::string error;
  bool refused = false;
  try {
    std::unique_ptr<LaneCipher> cipher;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (inEncrypted_) {
        cipher = std::make_unique<LaneCipher>(
            inSecret_,
            lane,
            lanesContext().settings().recordsPerKey,
            &lanesContext().stats().rekeys);
      }
    }
    // The dialler stripes onto this lane only once it has this.
    const uint8_t admitted = kAdmitted;
    uint64_t chunks = 0;
    if (sendAll(fd, &admitted, 1, &error)) {
      while (readChunk(fd, lane, slot, cipher.get(), &error, &refused)) {
        ++chunks;
      }
    }
    if (chunks == 0 && !refused) {
      // Ended before it carried anything: as a close, whatever the socket
      // said. A dialler that gave up on the lane just as our admission
      // came (its 5 s, or its own close) closes with that byte unread,
      // which resets the socket; it stripes onto none of its lanes then.
      error = "closed";
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (error == "closed") {
    // Between chunks. A peer closing its connection shuts its lanes just
    // before its stream: with every segment whole, the stream's own end
    // closes the connection, as a close and not as a fault of the peer's.
    std::unique_lock<std::mutex> lock(mutex_);
    if (slot < inSlots_.size()) {
      inSlots_[slot].ended = true;
    }
    lingerLocked(lock);
    if (closing_) {
      return;
    }
    if (landingsCompleteLocked()) {
      inLaneEnded_ = true; // a record that still needs stripes: reject
      return;
    }
  }
  std::string why = error == "closed"
      ? "the peer closed lane " + std::to_string(lane) +
          " with a segment not all in"
      : "lane " + std::to_string(lane) + " from the peer: " + error;
  if (!refused) {
    // Broken (a reset, an error, a close in the middle of a segment): the
    // connection is lost, but not before the frames the peer sent ahead of
    // the lost segment's record are read. The stream may lag the lanes (a
    // busy loop; on a network, another path), so those frames may not be
    // here yet: the loss comes with the first record whose stripes are not
    // all in (onRecordFromLoop()), or now if one waits already (everything
    // ahead of it was read). A peer that died ends the stream, which is
    // read to its end. Before, the connection closed at once, dropping
    // them.
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) {
      return;
    }
    if (slot < inSlots_.size()) {
      inSlots_[slot].ended = true; // (no other lane lingers for it)
    }
    lanesContext().stats().lanesBroken.fetch_add(1, std::memory_order_relaxed);
    bool waiting = false;
    for (const auto& [token, landing] : landings_) {
      waiting = waiting || (landing->held && landing->received < landing->size);
    }
    if (!waiting) {
      if (inLaneBroken_.empty()) {
        inLaneBroken_ = why;
      }
      return;
    }
  }
  failConnection("tcp_lanes: " + why, refused);
}

bool LanesChannel::readChunk(
    int fd,
    uint16_t lane,
    size_t slot,
    LaneCipher* cipher,
    std::string* error,
    bool* refused) {
  ChunkHeader header;
  if (!recvAll(fd, &header, sizeof(header), error)) {
    return false; // "closed": between chunks
  }
  auto ticks = [] {
    return std::chrono::steady_clock::now().time_since_epoch().count();
  };
  if (header.flags == kChunkKeepAlive && header.length == 0) {
    // Its sender waits for the stripe's bytes (lane.h): alive, nothing in.
    if (cipher != nullptr) {
      uint8_t tag[Aead::kTagBytes];
      char none = 0;
      if (!recvAll(fd, tag, sizeof(tag), error)) {
        if (*error == "closed") {
          *error = "closed in the middle of a chunk";
        }
        return false;
      }
      if (!cipher->open(
              std::string_view(
                  reinterpret_cast<const char*>(&header), sizeof(header)),
              &none,
              &none,
              0,
              tag)) {
        *refused = true;
        *error =
            "a record failed its integrity check (altered or injected "
            "on the wire, or not from our peer)";
        return false;
      }
    }
    {
      // Its segment's, if its record claimed or its stripes began it.
      std::lock_guard<std::mutex> lock(mutex_);
      if (slot < inSlots_.size()) {
        inSlots_[slot].token = header.token;
      }
      auto it = landings_.find(header.token);
      if (it != landings_.end()) {
        it->second->keptAt.store(ticks(), std::memory_order_relaxed);
      }
    }
    noteProgress();
    return true;
  }
  const uint64_t bound = cipher != nullptr ? kRecordBytes : kClearChunkBytes;
  if (header.flags != 0 || header.length == 0 || header.length > bound ||
      header.segmentSize < kMinStripedBytes ||
      header.segmentSize > kMaxStripedBytes ||
      header.offset > header.segmentSize ||
      header.length > header.segmentSize - header.offset) {
    *refused = true;
    *error = "a malformed chunk header (segment " +
        std::to_string(header.segmentSize) + " bytes, offset " +
        std::to_string(header.offset) + ", length " +
        std::to_string(header.length) + ")";
    return false;
  }
  const uint64_t end = header.offset + header.length;
  std::shared_ptr<Landing> landing;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (slot < inSlots_.size()) {
      inSlots_[slot].token = header.token; // (before a wait for room)
    }
    landing = landingLocked(
        lock,
        header.token,
        header.segmentSize,
        /*claim=*/false,
        error,
        refused);
    if (!landing) {
      return false;
    }
    // Its range, before any byte lands: no chunk may overwrite another's.
    // Adjacent ranges merge, so a segment keeps one range per lane.
    auto& ranges = landing->ranges;
    auto next = ranges.lower_bound(header.offset);
    auto prev = next == ranges.begin() ? ranges.end() : std::prev(next);
    if ((next != ranges.end() && next->first < end) ||
        (prev != ranges.end() && prev->second > header.offset)) {
      *refused = true;
      *error = "chunks overlap in segment " + std::to_string(header.token);
      return false;
    }
    uint64_t rangeEnd = end;
    if (next != ranges.end() && next->first == end) {
      rangeEnd = next->second;
      ranges.erase(next);
    }
    if (prev != ranges.end() && prev->second == header.offset) {
      prev->second = rangeEnd;
    } else if (ranges.size() == kMaxRangesPerSegment) {
      *refused = true;
      *error = "segment " + std::to_string(header.token) +
          " arrives in more than " + std::to_string(kMaxRangesPerSegment) +
          " pieces";
      return false;
    } else {
      ranges.emplace(header.offset, rangeEnd);
    }
  }
  // The rest of the chunk: an end here is mid-chunk, not between chunks.
  auto recvRest = [&](void* to, size_t size) {
    if (recvAll(fd, to, size, error)) {
      return true;
    }
    if (*error == "closed") {
      *error = "closed in the middle of a chunk";
    }
    return false;
  };
  char* dst = landing->data + header.offset;
  for (uint64_t done = 0; done < header.length;) {
    uint64_t slice =
        std::min<uint64_t>(kProgressSliceBytes, header.length - done);
    if (!recvRest(dst + done, slice)) {
      return false;
    }
    done += slice;
    if (done < header.length) {
      landing->bytesAt.store(ticks(), std::memory_order_relaxed);
      noteProgress();
    }
  }
  if (cipher != nullptr) {
    uint8_t tag[Aead::kTagBytes];
    if (!recvRest(tag, sizeof(tag))) {
      return false;
    }
    if (!cipher->open(
            std::string_view(
                reinterpret_cast<const char*>(&header), sizeof(header)),
            dst,
            dst,
            header.length,
            tag)) {
      // The segment stays incomplete, so it is never delivered.
      *refused = true;
      *error =
          "a record failed its integrity check (altered or injected "
          "on the wire, or not from our peer)";
      return false;
    }
  }
  landing->bytesAt.store(ticks(), std::memory_order_relaxed);
  noteProgress();
  bool resume = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landing->received += header.length;
    if (lane < kMaxLanes) {
      landing->laneBytes[lane] += header.length;
    }
    resume = landing->received == landing->size && landing->held;
  }
  if (resume) {
    if (auto host = host_.lock()) {
      std::weak_ptr<Host> weak = host;
      host->post([weak] {
        if (auto h = weak.lock()) {
          h->resumeReadsFromLoop();
        }
      });
    }
  }
  return true;
}

int64_t LanesChannel::onRecordFromLoop(
    const frame::SegmentRecord& record,
    InboundSegment& segment) {
  LaneRecord r;
  std::memcpy(&r, &record, sizeof(r));
  std::string why;
  int64_t placed = -1;
  bool lost = false; // not the peer's fault: its lanes ended (it closes)
  if (r.size != segment.size || segment.filled != 0 ||
      segment.provided == nullptr || r.size < kMinStripedBytes ||
      r.size > kMaxStripedBytes) {
    why = "a lanes record of " + std::to_string(r.size) +
        " bytes for a segment of " + std::to_string(segment.size);
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = landings_.find(r.token);
    // A record offered again after a hold has claimed its landing already.
    std::shared_ptr<Landing> landing;
    if (it != landings_.end() && it->second->claimed) {
      landing = it->second;
    } else {
      bool refused = false; // a record: any failure is a reject
      landing =
          landingLocked(lock, r.token, r.size, /*claim=*/true, &why, &refused);
    }
    if (landing && landing->received < landing->size &&
        !inLaneBroken_.empty()) {
      why = inLaneBroken_ + " (segment " + std::to_string(r.token) +
          "'s record came with " + std::to_string(landing->received) + " of " +
          std::to_string(landing->size) + " bytes in)";
      lost = true;
      landing.reset();
    } else if (landing && landing->received < landing->size && inLaneEnded_) {
      why = "segment " + std::to_string(r.token) +
          " is not all in, and the peer closed a lane";
      lost = true;
      landing.reset();
    } else if (landing && landing->received < landing->size) {
      if (!landing->held) {
        landing->held = true;
        landing->heldSince = std::chrono::steady_clock::now();
        lanesContext().stats().heldRecords.fetch_add(
            1, std::memory_order_relaxed);
      }
      placed = 0; // the last stripe's reader resumes the stream
    } else if (landing) {
      *segment.provided = landing->data;
      *segment.region = landing->region;
      eraseLandingLocked(r.token);
      placed = static_cast<int64_t>(r.size);
    }
  }
  // Never with mutex_ held: closing the connection stops us (stopAll()).
  if (placed < 0) {
    if (auto host = host_.lock()) {
      if (lost) {
        host->loseFromLoop("tcp_lanes: " + why);
      } else {
        host->rejectFromLoop("rejected frame: " + why);
      }
    }
  }
  return placed;
}

} // namespace torch_rpc_ext::channel::lanes
