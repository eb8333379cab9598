// SPDX-License-Identifier: BSD-3-Clause
// cuda_self (self_channel.h): the sender's copy into a pooled block, the
// process's table of sends, the receiver's view of the block, the context.
#include "csrc/channel/cuda_self/self_channel.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/common/crypto.h"
#include "csrc/common/host.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// Each segment of a block at an offset aligned as cudaMalloc's.
constexpr uint64_t kAlign = 256;

uint64_t aligned(uint64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

struct SelfCounters {
  std::atomic<uint64_t> sent{0}; // segments
  std::atomic<uint64_t> sentBytes{0};
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> launches{0}; // the senders' copies into blocks
  std::atomic<uint64_t> declined{0};
};

// A segment sent and not yet received: where it lies, and the region that
// holds its block.
struct Sent {
  std::shared_ptr<PooledRegion> region;
  CUdeviceptr address = 0;
  uint64_t size = 0;
  int device = -1;
  uint64_t tag = 0;
  const void* sender = nullptr; // the channel that sent it
};

// The process's sends in flight, by number; a record must name the number
// and its random tag.
class SentTable {
 public:
  frame::SegmentRecord add(Sent sent) {
    // From the kernel's CSPRNG: a record cannot be guessed from others.
    uint64_t tag = 0;
    const std::string drawn = randomBytes(sizeof(tag));
    std::memcpy(&tag, drawn.data(), sizeof(tag));
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_++;
    sent.tag = tag;
    frame::SegmentRecord record{id, sent.tag};
    sends_.emplace(id, std::move(sent));
    return record;
  }
  // The send `record` names, taken out of the table; false if none.
  bool take(const frame::SegmentRecord& record, Sent* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sends_.find(record.a);
    if (it == sends_.end() || it->second.tag != record.b) {
      return false;
    }
    *out = std::move(it->second);
    sends_.erase(it);
    return true;
  }
  void forget(const frame::SegmentRecord& record) {
    Sent dropped;
    take(record, &dropped); // the region dies outside the lock
  }
  // The sends of `sender` no one will receive (its connection closed).
  void forgetFrom(const void* sender) {
    std::vector<Sent> dropped;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sends_.begin(); it != sends_.end();) {
      if (it->second.sender == sender) {
        dropped.push_back(std::move(it->second));
        it = sends_.erase(it);
      } else {
        ++it;
      }
    }
    // (`dropped` dies after the lock: declared first.)
  }

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, Sent> sends_;
  uint64_t next_ = 1;
};

class SelfChannel final : public Channel {
 public:
  SelfChannel(
      std::shared_ptr<const Context> context,
      std::weak_ptr<Host> host,
      SentTable& table,
      SelfCounters& counters)
      : Channel(std::move(context)),
        host_(std::move(host)),
        table_(table),
        counters_(counters) {}
  ~SelfChannel() override {
    table_.forgetFrom(this);
  }

  void takeRegions(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& offered,
      std::vector<TakenRegion>* taken,
      std::vector<ControlFrame>*,
      const std::shared_ptr<void>&) override {
    // One block and one launch per device and stream.
    std::vector<bool> done(offered.size(), false);
    std::vector<size_t> group;
    for (size_t first = 0; first < offered.size(); ++first) {
      const auto& lead = segments[offered[first]];
      if (done[first]) {
        continue;
      }
      if (!carries(lead)) {
        counters_.declined.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      group.clear();
      for (size_t j = first; j < offered.size(); ++j) {
        const auto& s = segments[offered[j]];
        if (!done[j] && carries(s) && s.deviceIndex == lead.deviceIndex &&
            s.stream == lead.stream) {
          done[j] = true;
          group.push_back(offered[j]);
        }
      }
      sendGroup(segments, group, taken);
    }
  }

  void abandonRegion(
      const frame::OutboundFrame::Segment&,
      const frame::SegmentRecord& record) override {
    table_.forget(record);
  }

  int64_t onRecordFromLoop(
      const frame::SegmentRecord& record,
      InboundSegment& segment) override {
    Sent sent;
    std::string why;
    if (!table_.take(record, &sent)) {
      why = "names no tensor this process sent";
    } else if (sent.size != segment.size) {
      why = "names " + std::to_string(sent.size) + " bytes for a segment of " +
          std::to_string(segment.size);
    } else if (segment.device >= 0 && segment.device != sent.device) {
      why = "names memory of cuda:" + std::to_string(sent.device) +
          " for a tensor of cuda:" + std::to_string(segment.device);
    }
    if (!why.empty()) {
      if (auto h = host_.lock()) {
        h->rejectFromLoop("rejected frame: a cuda_self record " + why);
      }
      return -1;
    }
    *segment.provided = reinterpret_cast<void*>(sent.address);
    *segment.region = std::move(sent.region);
    counters_.received.fetch_add(1, std::memory_order_relaxed);
    return static_cast<int64_t>(segment.size);
  }

  void onClosedFromLoop() override {
    closed_.store(true);
    table_.forgetFrom(this);
  }

 private:
  static bool carries(const frame::OutboundFrame::Segment& s) {
    // A map to another device of one's own goes through cuda_staged.
    return s.device == uint8_t(DeviceKind::kCuda) && s.deviceIndex >= 0 &&
        s.size > 0 && (s.peerDevice < 0 || s.peerDevice == s.deviceIndex);
  }

  void sendGroup(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& group,
      std::vector<TakenRegion>* taken) {
    const int device = segments[group.front()].deviceIndex;
    const auto stream =
        reinterpret_cast<CUstream>(segments[group.front()].stream);
    std::vector<uint64_t> offsets;
    offsets.reserve(group.size());
    uint64_t total = 0;
    for (size_t i : group) {
      offsets.push_back(total);
      total += aligned(segments[i].size);
    }
    std::shared_ptr<PooledRegion> region;
    CUdeviceptr base = 0;
    try {
      StagingPool& pool = StagingPool::of(device);
      CurrentDevice current(device);
      PooledEvent ready = pool.takeEvent();
      auto block = pool.takeBlock(total);
      base = block->address;
      const bool used = block->used;
      const CUevent lastUse = block->lastUse;
      // Unused, the region gives the block back after the work queued on
      // the sender's stream (the copies below): that stream outlives it,
      // as the caller's streams outlive their sends.
      region = std::make_shared<PooledRegion>(
          pool,
          std::move(block),
          ready,
          std::shared_ptr<CUstream_st>(stream, [](CUstream) {}));
      if (used) {
        // The block's last reader must be done before the copies overwrite it.
        TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, lastUse, 0);
      }
      std::vector<CopyEngine::Segment> copies;
      CopyEngine& engine = copyEngine(device);
      size_t launches = 0;
      for (size_t k = 0; k < group.size(); ++k) {
        const auto& s = segments[group[k]];
        const CopyEngine::Segment copy{
            base + offsets[k], reinterpret_cast<CUdeviceptr>(s.data), s.size};
        // A received tensor sent on: its memory is read on `stream` now.
        if (auto* origin = dynamic_cast<frame::DeviceRegion*>(s.origin.get())) {
          origin->recordUse(s.stream);
        }
        if (s.view) {
          engine.pack(
              stream,
              copy.dst,
              copy.src,
              s.view->sizes,
              s.view->strides,
              s.view->elementSize);
          launches++;
        } else {
          copies.push_back(copy);
        }
      }
      if (!copies.empty()) {
        engine.copySegments(stream, copies);
        launches++;
      }
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, ready.get(), stream);
      counters_.launches.fetch_add(launches, std::memory_order_relaxed);
    } catch (const std::exception&) {
      // Nothing taken: cuda_staged carries the group (or says why not).
      counters_.declined.fetch_add(group.size(), std::memory_order_relaxed);
      return;
    }
    for (size_t k = 0; k < group.size(); ++k) {
      const auto& s = segments[group[k]];
      Sent sent;
      sent.region = region;
      sent.address = base + offsets[k];
      sent.size = s.size;
      sent.device = device;
      sent.sender = this;
      taken->push_back({group[k], table_.add(std::move(sent))});
      counters_.sent.fetch_add(1, std::memory_order_relaxed);
      counters_.sentBytes.fetch_add(s.size, std::memory_order_relaxed);
    }
    // A send that raced the close: forgetFrom() either found these entries
    // (added before it took the table's lock) or ran before they were
    // added, and then `closed_` (set before it) is seen here, after our
    // add took the same lock. Before, they held their block until the
    // channel object went.
    if (closed_.load()) {
      for (auto it = taken->end() - group.size(); it != taken->end(); ++it) {
        table_.forget(it->record);
      }
    }
  }

  std::weak_ptr<Host> host_;
  SentTable& table_;
  SelfCounters& counters_;
  std::atomic<bool> closed_{false};
};

class SelfContext final : public Context {
 public:
  explicit SelfContext(WireIds ids) : Context(ids) {
    uint64_t drawn = 0;
    const std::string bytes = randomBytes(sizeof(drawn));
    std::memcpy(&drawn, bytes.data(), sizeof(drawn));
    descriptor_ = bootId() + ";" + pidNamespace() + ";" +
        std::to_string(::getpid()) + ";" + std::to_string(drawn);
  }

  std::string name() const override {
    return "cuda_self";
  }
  DeviceKind device() const override {
    return DeviceKind::kCuda;
  }
  Channel::Mode mode() const override {
    return Channel::Mode::kRegion;
  }
  std::string unviableReason() const override {
    std::call_once(probed_, [this] { unviable_ = noCudaDeviceReason(); });
    return unviable_;
  }
  std::string domainDescriptor() const override {
    return descriptor_;
  }
  bool needsDescriptorPassing() const override {
    return false;
  }
  std::shared_ptr<Channel> open(std::weak_ptr<Host> host, const std::string&)
      override {
    return std::make_shared<SelfChannel>(
        shared_from_this(), std::move(host), table_, counters_);
  }
  std::map<std::string, uint64_t> counters() const override {
    return {
        {"segments_sent", counters_.sent.load()},
        {"bytes_sent", counters_.sentBytes.load()},
        {"segments_received", counters_.received.load()},
        {"launches", counters_.launches.load()},
        {"declined", counters_.declined.load()},
    };
  }

 private:
  std::string descriptor_;
  mutable std::once_flag probed_;
  mutable std::string unviable_;
  mutable SentTable table_;
  mutable SelfCounters counters_;
};

} // namespace

std::shared_ptr<Context> createSelfChannel(WireIds ids) {
  return std::make_shared<SelfContext>(ids);
}

} // namespace torch_rpc_ext::channel::cuda
