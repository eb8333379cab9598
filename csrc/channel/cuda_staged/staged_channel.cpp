// SPDX-License-Identifier: BSD-3-Clause
// cuda_staged (staged_channel.h), receiving: the pinned memory a segment
// lands in, the copies onto its device, and the device memory a received
// tensor views; and the channel's context. Sending: staged_sender.cpp.
#include "csrc/channel/cuda_staged/staged_channel.h"

#include <algorithm>
#include <mutex>
#include <new>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

struct StagedChannel::Landing {
  StagingPool* pool;
  uint64_t size;
  uint64_t copied = 0; // bytes queued for the device
  StagingPool::HostBuffer host;
  std::shared_ptr<StagingPool::Block> block;
  CUstream stream = nullptr;
  // A segment that cannot land here (our memory, not the peer's doing): its
  // bytes are read into `discard`, so that the stream stays in step, and the
  // message fails with `failure` (frame::FailedRegion).
  std::unique_ptr<char[]> discard;
  std::string failure;
};

StagedChannel::StagedChannel(
    std::shared_ptr<const Context> context,
    std::weak_ptr<Host> host,
    StagedCounters& counters)
    : Channel(std::move(context)),
      host_(std::move(host)),
      counters_(counters) {}

StagedChannel::~StagedChannel() {
  abandonLanding();
}

int64_t StagedChannel::onRecordFromLoop(
    const frame::SegmentRecord&,
    InboundSegment&) {
  if (auto h = host_.lock()) {
    h->rejectFromLoop(
        "rejected frame: a record for cuda_staged, which has none");
  }
  return -1;
}

char* StagedChannel::landFromLoop(InboundSegment& segment) {
  auto reject = [&](const std::string& why) -> char* {
    if (auto h = host_.lock()) {
      h->rejectFromLoop("rejected frame: cuda_staged " + why);
    }
    return nullptr;
  };
  if (segment.device < 0 && segment.device != frame::kDeviceNotServed) {
    return reject(
        "segment of " + std::to_string(segment.size) +
        " bytes for a tensor this process keeps in host memory");
  }
  abandonLanding(); // none, unless the last frame broke off
  // Our side's shortage fails the message's call, not the connection: the
  // bytes are read and dropped. Only where even that memory is missing does
  // the connection close.
  auto fail = [&](const std::string& why) -> char* {
    auto failed = std::make_unique<Landing>();
    failed->size = segment.size;
    failed->failure = "cuda_staged could not land " +
        std::to_string(segment.size) + " bytes on " +
        (segment.device >= 0 ? "cuda:" + std::to_string(segment.device)
                             : std::string(
                                   "a device this process does not "
                                   "serve")) +
        ": " + why;
    failed->discard.reset(new (std::nothrow) char[segment.size]);
    if (failed->discard == nullptr) {
      return reject(failed->failure + " (nor hold them to drop them)");
    }
    landing_ = std::move(failed);
    return landing_->discard.get();
  };
  if (segment.device == frame::kDeviceNotServed) {
    // The agent fails the message, naming the device: nothing of it here.
    return fail("the sender's device map names it");
  }
  auto landing = std::make_unique<Landing>();
  try {
    landing->pool = &StagingPool::of(segment.device);
    std::string why;
    landing->host = landing->pool->takeHost(segment.size, &why);
    if (landing->host.data == nullptr) {
      counters_.declined++;
      return fail(why);
    }
    landing->size = segment.size;
    landing_ = std::move(landing);
    landing_->block = landing_->pool->takeBlockForCopies(segment.size);
    landing_->stream = landing_->pool->copyStream();
  } catch (const std::exception& e) {
    abandonLanding();
    counters_.declined++;
    return fail(e.what());
  }
  return landing_->host.data;
}

bool StagedChannel::landedFromLoop(InboundSegment& segment, uint64_t filled) {
  Landing* l = landing_.get();
  if (l == nullptr || filled > l->size) {
    return false; // unreachable: landFromLoop() came first
  }
  if (!l->failure.empty()) {
    if (filled == l->size) {
      *segment.provided = nullptr;
      *segment.region = std::make_shared<frame::FailedRegion>(l->failure);
      landing_.reset();
    }
    return true;
  }
  try {
    CurrentDevice current(l->pool->device());
    // Whole chunks as they complete, then the tail: the copy of one runs
    // while the next is still arriving.
    while (l->copied < filled &&
           (filled - l->copied >= kStagedChunkBytes || filled == l->size)) {
      uint64_t n = std::min<uint64_t>(kStagedChunkBytes, filled - l->copied);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyHtoDAsync,
          l->block->address + l->copied,
          l->host.data + l->copied,
          n,
          l->stream);
      l->copied += n;
      counters_.chunks++;
    }
    if (filled < l->size) {
      return true;
    }
    auto ready = l->pool->takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, ready.get(), l->stream);
    l->pool->retireHost(l->host, ready);
    l->host = {};
    *segment.provided = reinterpret_cast<void*>(l->block->address);
    *segment.region = std::make_shared<PooledRegion>(
        *l->pool,
        std::move(l->block),
        std::move(ready),
        // The pool's stream lives as long as the process: not owned.
        std::shared_ptr<CUstream_st>(l->stream, [](CUstream_st*) {}));
  } catch (const std::exception& e) {
    abandonLanding();
    if (auto h = host_.lock()) {
      h->rejectFromLoop(
          std::string(
              "cuda_staged: copying a segment onto the device "
              "failed: ") +
          e.what());
    }
    return false;
  }
  landing_.reset();
  counters_.received++;
  counters_.receivedBytes += segment.size;
  return true;
}

void StagedChannel::abandonLanding() {
  if (!landing_) {
    return;
  }
  auto l = std::move(landing_);
  if (!l->failure.empty()) {
    return; // holds only its discard buffer
  }
  try {
    if (l->stream != nullptr &&
        (l->copied > 0 || (l->block && l->block->used))) {
      // Copies may still read the host buffer and write the block.
      CurrentDevice current(l->pool->device());
      auto done = l->pool->takeEvent();
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, done.get(), l->stream);
      if (l->block) {
        TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, l->block->lastUse, l->stream);
        l->block->used = true;
      }
      l->pool->retireHost(l->host, std::move(done));
    } else {
      l->pool->giveHost(l->host);
    }
    if (l->block) {
      l->pool->giveBlock(std::move(l->block));
    }
  } catch (const std::exception& e) {
    // Kept, not reused: a copy may still touch them.
    logWarning(
        std::string(
            "torch_rpc_ext: cuda_staged keeps a landing it could "
            "not release: ") +
        e.what());
  }
}

void StagedChannel::onClosedFromLoop() {
  abandonLanding();
}

namespace {

class StagedContext final : public Context {
 public:
  explicit StagedContext(WireIds ids) : Context(ids) {}

  std::string name() const override {
    return "cuda_staged";
  }
  DeviceKind device() const override {
    return DeviceKind::kCuda;
  }
  Channel::Mode mode() const override {
    return Channel::Mode::kStaged;
  }
  std::string unviableReason() const override {
    std::call_once(probed_, [this] { unviable_ = noCudaDeviceReason(); });
    return unviable_;
  }
  // Reaches every peer that offers it: the bytes go through the stream.
  std::string domainDescriptor() const override {
    return "any";
  }
  bool needsDescriptorPassing() const override {
    return false;
  }
  std::shared_ptr<Channel> open(std::weak_ptr<Host> host, const std::string&)
      override {
    return std::make_shared<StagedChannel>(
        shared_from_this(), std::move(host), counters_);
  }
  std::map<std::string, uint64_t> counters() const override {
    return {
        {"segments_sent", counters_.sent.load()},
        {"bytes_sent", counters_.sentBytes.load()},
        {"segments_received", counters_.received.load()},
        {"bytes_received", counters_.receivedBytes.load()},
        {"chunk_copies", counters_.chunks.load()},
        {"declined", counters_.declined.load()},
        {"packed", counters_.packed.load()},
        {"gathered", counters_.gathered.load()},
        {"pinned_bytes", StagingPool::pinnedBytesAll()},
    };
  }

 private:
  mutable std::once_flag probed_;
  mutable std::string unviable_;
  mutable StagedCounters counters_;
};

} // namespace

std::shared_ptr<Context> createStagedChannel(WireIds ids) {
  return std::make_shared<StagedContext>(ids);
}

} // namespace torch_rpc_ext::channel::cuda
