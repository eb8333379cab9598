// SPDX-License-Identifier: BSD-3-Clause
// cuda_staged (staged_channel.h): device bytes staged through pinned host
// memory, the thread that lets the stream write each chunk once its copy
// has completed, and the device memory a received tensor views.
#include "csrc/channel/cuda/staged_channel.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// A segment on its way out: pinned memory filled chunk by chunk. Given back
// to the pool when the frame is done with it and its last copy has
// completed (the staging thread holds it until then).
class StagedBytes final : public StagedOut {
 public:
  StagedBytes(StagingPool& pool, StagingPool::HostBuffer buffer)
      : pool_(pool), buffer_(buffer) {}
  ~StagedBytes() override {
    pool_.giveHost(buffer_);
  }
  const char* data() const override {
    return buffer_.data;
  }
  uint64_t readyBytes() const override {
    return ready_.load(std::memory_order_acquire);
  }
  void raiseReady(uint64_t bytes) {
    uint64_t cur = ready_.load(std::memory_order_relaxed);
    while (
        cur < bytes &&
        !ready_.compare_exchange_weak(cur, bytes, std::memory_order_release)) {
    }
  }
  char* buffer() {
    return buffer_.data;
  }

 private:
  StagingPool& pool_;
  const StagingPool::HostBuffer buffer_;
  std::atomic<uint64_t> ready_{0};
};

// The one thread that watches the copies out of devices and lets each
// connection write what became ready. It polls their events (cuEventQuery:
// a stream stuck behind the caller's work holds back only its own chunks,
// and no thread spins inside the driver), sleeping longer while nothing
// completes, and trims the staging pools now and then (freeing memory may
// wait for the device: never on a transport loop). Leaked with the process.
class StagingThread {
 public:
  struct Item {
    int device;
    PooledEvent copied;
    std::shared_ptr<StagedBytes> staged;
    uint64_t readyAfter;
    std::weak_ptr<Host> host;
  };

  static StagingThread& get() {
    static StagingThread* t = new StagingThread();
    return *t;
  }

  void add(Item item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_one();
  }

 private:
  StagingThread() : thread_([this] { run(); }) {
    thread_.detach();
  }

  void run() {
    pthread_setname_np(pthread_self(), "rpcext-staging");
    using std::chrono::microseconds;
    std::vector<Item> pending;
    auto pause = microseconds(20);
    auto lastTrim = std::chrono::steady_clock::now();
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (pending.empty() && queue_.empty()) {
          // Idle: wake for new work, or to trim the pools.
          cv_.wait_for(lock, std::chrono::milliseconds(kStagedIdleMs / 5));
        } else if (queue_.empty()) {
          cv_.wait_for(lock, pause);
        }
        for (auto& item : queue_) {
          pending.push_back(std::move(item));
        }
        queue_.clear();
      }
      bool progressed = false;
      for (size_t i = 0; i < pending.size();) {
        if (!poll(pending[i])) {
          ++i;
          continue;
        }
        progressed = true;
        pending[i] = std::move(pending.back());
        pending.pop_back();
      }
      pause = progressed ? microseconds(20)
                         : std::min(pause * 2, microseconds(1000));
      auto now = std::chrono::steady_clock::now();
      if (now - lastTrim > std::chrono::milliseconds(kStagedIdleMs / 5)) {
        lastTrim = now;
        try {
          StagingPool::trimAll();
        } catch (const std::exception& e) {
          logWarning(
              std::string(
                  "torch_rpc_ext: cuda_staged could not free idle "
                  "memory: ") +
              e.what());
        }
      }
    }
  }

  // Whether `item` is done with (its copy completed, or failed).
  static bool poll(Item& item) {
    std::string error;
    try {
      CurrentDevice current(item.device);
      CUresult rc = libcuda().cuEventQuery(item.copied.get());
      if (rc == CUDA_ERROR_NOT_READY) {
        return false;
      }
      checkCuda("cuEventQuery", rc);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (error.empty()) {
      // Chunks of one segment complete in order on its stream, but may be
      // seen out of order here: the mark only moves forward.
      item.staged->raiseReady(item.readyAfter);
    }
    item.copied.reset();
    item.staged.reset();
    auto host = item.host.lock();
    if (!host) {
      return true;
    }
    std::weak_ptr<Host> weak = host;
    host->post([weak, error, device = item.device] {
      auto h = weak.lock();
      if (!h) {
        return;
      }
      if (error.empty()) {
        h->resumeWritesFromLoop();
      } else {
        // Its bytes will never be ready: the frame cannot be written.
        h->rejectFromLoop(
            "cuda_staged: copying a segment out of cuda:" +
            std::to_string(device) + " failed: " + error);
      }
    });
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::thread thread_;
};

// A received segment's device memory: a block of the device's pool, filled
// by the channel's copies, ready at `ready`. When it dies, the block goes
// back once the work queued by then on every stream it was used on has
// finished (the block's lastUse event, which the next copy into it waits
// for).
class StagedRegion final : public frame::DeviceRegion {
 public:
  StagedRegion(
      StagingPool& pool,
      std::shared_ptr<StagingPool::Block> block,
      PooledEvent ready,
      CUstream copyStream)
      : pool_(pool),
        block_(std::move(block)),
        ready_(std::move(ready)),
        copyStream_(copyStream) {}

  ~StagedRegion() override {
    try {
      std::lock_guard<std::mutex> lock(mu_);
      CurrentDevice current(pool_.device());
      // Unused: the copy onto the device was its last use.
      CUstream last = streams_.empty() ? copyStream_ : streams_.back();
      for (CUstream other : streams_) {
        if (other == last) {
          continue;
        }
        auto joined = pool_.takeEvent();
        TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, joined.get(), other);
        TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, last, joined.get(), 0);
      }
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->lastUse, last);
      block_->used = true;
    } catch (const std::exception& e) {
      // Not given back: the next copy into it must not race this use.
      logWarning(
          std::string(
              "torch_rpc_ext: cuda_staged keeps a block it could not "
              "release: ") +
          e.what());
      return;
    }
    pool_.giveBlock(std::move(block_));
  }

  int device() const override {
    return pool_.device();
  }

  void waitOn(uintptr_t stream) override {
    const auto s = reinterpret_cast<CUstream>(stream);
    CurrentDevice current(pool_.device());
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, s, ready_.get(), 0);
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(streams_.begin(), streams_.end(), s) == streams_.end()) {
      streams_.push_back(s);
    }
  }

 private:
  StagingPool& pool_;
  std::shared_ptr<StagingPool::Block> block_;
  PooledEvent ready_;
  const CUstream copyStream_;
  std::mutex mu_;
  std::vector<CUstream> streams_; // it was used on
};

} // namespace

struct StagedChannel::Landing {
  StagingPool* pool;
  uint64_t size;
  uint64_t copied = 0; // bytes queued for the device
  StagingPool::HostBuffer host;
  std::shared_ptr<StagingPool::Block> block;
  CUstream stream = nullptr;
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

std::shared_ptr<StagedOut> StagedChannel::stageOut(
    const frame::OutboundFrame::Segment& segment) {
  if (segment.device != uint8_t(DeviceKind::kCuda) || segment.deviceIndex < 0 ||
      segment.size == 0) {
    return nullptr;
  }
  StagingPool& pool = StagingPool::of(segment.deviceIndex);
  std::string why;
  auto buffer = pool.takeHost(segment.size, &why);
  if (buffer.data == nullptr) {
    counters_.declined++;
    throw std::runtime_error(why);
  }
  auto staged = std::make_shared<StagedBytes>(pool, buffer);
  CurrentDevice current(segment.deviceIndex);
  const auto stream = reinterpret_cast<CUstream>(segment.stream);
  auto src = reinterpret_cast<CUdeviceptr>(segment.data);
  // A strided view is packed on the device first, into a block of the
  // pool's that goes back once the copies out of it are done.
  std::shared_ptr<StagingPool::Block> packed;
  auto givePacked = [&] {
    if (packed) {
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, packed->lastUse, stream);
      packed->used = true;
      pool.giveBlock(std::move(packed));
    }
  };
  // Chunk by chunk on the stream the bytes are ready on: the stream writes
  // the first chunk while the next ones are still copying.
  try {
    if (segment.view) {
      packed = pool.takeBlock(segment.size);
      if (packed->used) {
        TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, packed->lastUse, 0);
      }
      copyEngine(segment.deviceIndex)
          .pack(
              stream,
              packed->address,
              src,
              segment.view->sizes,
              segment.view->strides,
              segment.view->elementSize);
      src = packed->address;
      counters_.packed++;
    }
    for (uint64_t at = 0; at < segment.size; at += kStagedChunkBytes) {
      uint64_t n = std::min<uint64_t>(kStagedChunkBytes, segment.size - at);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyDtoHAsync, staged->buffer() + at, src + at, n, stream);
      auto copied = pool.takeEvent();
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, copied.get(), stream);
      StagingThread::get().add(
          {segment.deviceIndex, std::move(copied), staged, at + n, host_});
      counters_.chunks++;
    }
    givePacked();
  } catch (...) {
    // A copy queued without an event to follow may still write into the
    // buffer: it must not go back to the pool before that copy is done (a
    // host wait, on this failing path only).
    libcuda().cuStreamSynchronize(stream);
    if (packed) {
      packed->used = false; // nothing of the stream uses it any more
      pool.giveBlock(std::move(packed));
    }
    throw;
  }
  counters_.sent++;
  counters_.sentBytes += segment.size;
  return staged;
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
  if (segment.device < 0) {
    return reject(
        "segment of " + std::to_string(segment.size) +
        " bytes for a tensor this process keeps in host memory");
  }
  abandonLanding(); // none, unless the last frame broke off
  auto landing = std::make_unique<Landing>();
  try {
    landing->pool = &StagingPool::of(segment.device);
    std::string why;
    landing->host = landing->pool->takeHost(segment.size, &why);
    if (landing->host.data == nullptr) {
      counters_.declined++;
      return reject("cannot take the segment: " + why);
    }
    landing->size = segment.size;
    landing_ = std::move(landing);
    landing_->block = landing_->pool->takeBlock(segment.size);
    landing_->stream = landing_->pool->copyStream();
    if (landing_->block->used) {
      CurrentDevice current(segment.device);
      // The block's last user must be done before the copies overwrite it.
      TORCH_RPC_EXT_CUDA_CHECK(
          cuStreamWaitEvent, landing_->stream, landing_->block->lastUse, 0);
    }
  } catch (const std::exception& e) {
    abandonLanding();
    return reject(
        "cannot land " + std::to_string(segment.size) +
        " bytes on cuda:" + std::to_string(segment.device) + ": " + e.what());
  }
  return landing_->host.data;
}

bool StagedChannel::landedFromLoop(InboundSegment& segment, uint64_t filled) {
  Landing* l = landing_.get();
  if (l == nullptr || filled > l->size) {
    return false; // unreachable: landFromLoop() came first
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
    *segment.region = std::make_shared<StagedRegion>(
        *l->pool, std::move(l->block), std::move(ready), l->stream);
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
    std::call_once(probed_, [this] {
      try {
        if (deviceCount() == 0) {
          unviable_ = "no CUDA device is visible to this process";
        }
      } catch (const std::exception& e) {
        unviable_ = e.what();
      }
    });
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
