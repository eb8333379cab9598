// SPDX-License-Identifier: BSD-3-Clause
// LanesChannel, receiving: each lane's reader thread lands chunks in the
// segment's memory; a record waits in the stream until its segment is in.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iterator>

#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

// How long a chunk may wait for room under kMaxUnclaimedBytes (lane.h)
// before the connection gives up: only records that never come (a peer
// that misbehaves) keep it waiting that long.
constexpr auto kBudgetWait = std::chrono::seconds(30);

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
  if (closing_) {
    ::close(fd);
    return;
  }
  try {
    inThreads_.emplace_back(
        [self = shared_from_this(), lane, fd] { self->runInLane(lane, fd); });
  } catch (...) {
    ::close(fd);
    throw; // the accept thread logs it; the peer's lane fails, and closes
  }
  inFds_.push_back(fd);
  lanesContext().stats().lanesOpened.fetch_add(1, std::memory_order_relaxed);
}

std::shared_ptr<LanesChannel::Landing> LanesChannel::landingLocked(
    std::unique_lock<std::mutex>& lock,
    uint64_t token,
    uint64_t size,
    bool claim,
    std::string* error) {
  auto it = landings_.find(token);
  if (it == landings_.end() && !claim) {
    // Stripes ahead of their record wait for room: records free it.
    auto room = [&] {
      return closing_ || landings_.count(token) != 0 ||
          size <= kMaxUnclaimedBytes - unclaimedBytes_;
    };
    if (!budget_.wait_for(lock, kBudgetWait, room)) {
      *error = "more than " + std::to_string(kMaxUnclaimedBytes) +
          " bytes arrived on lanes ahead of their records for " +
          std::to_string(kBudgetWait.count()) + " s";
      return nullptr;
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
      *error = "segment " + std::to_string(token) + " announced as " +
          std::to_string(landing->size) + " and " + std::to_string(size) +
          " bytes";
      return nullptr;
    }
    if (claim) {
      if (landing->claimed) {
        *error = "two records for segment " + std::to_string(token);
        return nullptr;
      }
      landing->claimed = true;
      unclaimedBytes_ -= size;
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
    unclaimedBytes_ += size;
  }
  landings_.emplace(token, landing);
  return landing;
}

void LanesChannel::eraseLandingLocked(uint64_t token) {
  auto it = landings_.find(token);
  if (it == landings_.end()) {
    return;
  }
  if (!it->second->claimed) {
    unclaimedBytes_ -= it->second->size;
    budget_.notify_all();
  }
  landings_.erase(it);
}

void LanesChannel::runInLane(uint16_t lane, int fd) {
  std::string error;
  try {
    std::unique_ptr<Aead> aead;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!inKey_.empty()) {
        aead = std::make_unique<Aead>(inKey_);
      }
    }
    uint64_t sequence = 0;
    while (readChunk(fd, lane, aead.get(), &sequence, &error)) {
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  failConnection(
      error == "closed"
          ? "tcp_lanes: the peer closed lane " + std::to_string(lane)
          : "tcp_lanes: lane " + std::to_string(lane) +
              " from the peer: " + error);
}

bool LanesChannel::readChunk(
    int fd,
    uint16_t lane,
    Aead* aead,
    uint64_t* sequence,
    std::string* error) {
  ChunkHeader header;
  if (!recvAll(fd, &header, sizeof(header), error)) {
    return false;
  }
  const uint64_t bound = aead != nullptr ? kRecordBytes : kClearChunkBytes;
  if (header.flags != 0 || header.length == 0 || header.length > bound ||
      header.segmentSize == 0 || header.segmentSize > kMaxStripedBytes ||
      header.offset > header.segmentSize ||
      header.length > header.segmentSize - header.offset) {
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
    landing = landingLocked(
        lock, header.token, header.segmentSize, /*claim=*/false, error);
    if (!landing) {
      return false;
    }
    // Its range, before any byte lands: no chunk may overwrite another's.
    auto next = landing->ranges.lower_bound(header.offset);
    if ((next != landing->ranges.end() && next->first < end) ||
        (next != landing->ranges.begin() &&
         std::prev(next)->second > header.offset)) {
      *error = "chunks overlap in segment " + std::to_string(header.token);
      return false;
    }
    landing->ranges.emplace(header.offset, end);
  }
  char* dst = landing->data + header.offset;
  if (!recvAll(fd, dst, header.length, error)) {
    return false;
  }
  if (aead != nullptr) {
    uint8_t tag[Aead::kTagBytes];
    uint8_t nonce[Aead::kNonceBytes];
    if (!recvAll(fd, tag, sizeof(tag), error)) {
      return false;
    }
    laneNonce(lane, (*sequence)++, nonce);
    if (!aead->open(
            nonce,
            std::string_view(
                reinterpret_cast<const char*>(&header), sizeof(header)),
            dst,
            dst,
            header.length,
            tag)) {
      // The segment stays incomplete, so it is never delivered.
      *error =
          "a record failed its integrity check (altered or injected "
          "on the wire, or not from our peer)";
      return false;
    }
  }
  if (auto host = host_.lock()) {
    host->noteProgress();
  }
  bool resume = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landing->received += header.length;
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
  if (r.size != segment.size || segment.filled != 0 ||
      segment.provided == nullptr || r.size > kMaxStripedBytes) {
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
      landing = landingLocked(lock, r.token, r.size, /*claim=*/true, &why);
    }
    if (landing && landing->received < landing->size) {
      if (!landing->held) {
        landing->held = true;
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
      host->rejectFromLoop("rejected frame: " + why);
    }
  }
  return placed;
}

} // namespace torch_rpc_ext::channel::lanes
