// SPDX-License-Identifier: BSD-3-Clause
// LanesChannel, receiving: each lane's reader thread lands chunks in the
// segment's memory; a record waits in the stream until its segment is in.
#include <unistd.h>

#include <cstring>

#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

// Bytes that may arrive on lanes ahead of the records that claim them: a
// peer past this is misbehaving (or the stream is stuck), and the
// connection closes rather than grow without bound.
constexpr uint64_t kMaxUnclaimedBytes = 4ull << 30;

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
  lanesContext().stats().lanesOpened.fetch_add(1, std::memory_order_relaxed);
  inFds_.push_back(fd);
  inThreads_.emplace_back([this, lane, fd] { runInLane(lane, fd); });
}

std::shared_ptr<LanesChannel::Landing> LanesChannel::landingLocked(
    uint64_t token,
    uint64_t size,
    std::string* error) {
  auto it = landings_.find(token);
  if (it != landings_.end()) {
    if (it->second->size != size) {
      *error = "segment " + std::to_string(token) + " announced as " +
          std::to_string(it->second->size) + " and " + std::to_string(size) +
          " bytes";
      return nullptr;
    }
    return it->second;
  }
  if (size > kMaxUnclaimedBytes - unclaimedBytes_) {
    *error = "more than " + std::to_string(kMaxUnclaimedBytes) +
        " bytes on lanes ahead of their records";
    return nullptr;
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
  landing->abandoned = abandoned_.erase(token) != 0;
  unclaimedBytes_ += size;
  landings_.emplace(token, landing);
  return landing;
}

void LanesChannel::runInLane(uint16_t lane, int fd) {
  std::unique_ptr<Aead> aead;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!inKey_.empty()) {
      aead = std::make_unique<Aead>(inKey_);
    }
  }
  uint64_t sequence = 0;
  std::string error;
  while (readChunk(fd, lane, aead.get(), &sequence, &error)) {
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
      header.segmentSize == 0 ||
      header.segmentSize > frame::kSegmentLengthMask ||
      header.offset > header.segmentSize ||
      header.length > header.segmentSize - header.offset) {
    *error = "a malformed chunk header (segment " +
        std::to_string(header.segmentSize) + " bytes, offset " +
        std::to_string(header.offset) + ", length " +
        std::to_string(header.length) + ")";
    return false;
  }
  std::shared_ptr<Landing> landing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landing = landingLocked(header.token, header.segmentSize, error);
  }
  if (!landing) {
    return false;
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
    if (landing->received > landing->size) {
      *error =
          "more bytes than segment " + std::to_string(header.token) + " has";
      return false;
    }
    if (landing->received == landing->size) {
      if (landing->abandoned) {
        unclaimedBytes_ -= landing->size;
        landings_.erase(header.token);
      } else {
        resume = landing->held;
      }
    }
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
  auto host = host_.lock();
  std::string why;
  if (r.size != segment.size || segment.filled != 0 ||
      segment.provided == nullptr) {
    why = "a lanes record of " + std::to_string(r.size) +
        " bytes for a segment of " + std::to_string(segment.size);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<Landing> landing;
  if (why.empty()) {
    landing = landingLocked(r.token, r.size, &why);
  }
  if (!landing || landing->abandoned) {
    if (host) {
      host->rejectFromLoop(
          "rejected frame: " +
          (why.empty() ? "a record for an abandoned segment" : why));
    }
    return -1;
  }
  if (landing->received < landing->size) {
    if (!landing->held) {
      landing->held = true;
      lanesContext().stats().heldRecords.fetch_add(
          1, std::memory_order_relaxed);
    }
    return 0; // the last stripe's reader resumes the stream
  }
  *segment.provided = landing->data;
  *segment.region = landing->region;
  unclaimedBytes_ -= landing->size;
  landings_.erase(r.token);
  return static_cast<int64_t>(r.size);
}

} // namespace torch_rpc_ext::channel::lanes
