// SPDX-License-Identifier: BSD-3-Clause
// cuda_ring (cuda_ring_channel.h): the shared ring, receiving (the copies out
// of its slots onto the device, the releases), and the channel's context.
// Sending: cuda_ring_sender.cpp.
#include "csrc/channel/cuda_ring/cuda_ring_channel.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda/staging_thread.h"
#include "csrc/channel/shm/slab.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/fd_closer.h"
#include "csrc/common/host.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"
#include "csrc/common/signal_socket.h"

namespace torch_rpc_ext::channel::cuda {

// ---- The ring ---------------------------------------------------------------

namespace {

// Unregistering and unmapping pinned memory may wait for the device: never
// on a transport loop, so the last holder's release runs on the staging
// thread, wherever it lets go.
std::shared_ptr<RingMemory> ownedOffLoop(RingMemory* r) {
  return std::shared_ptr<RingMemory>(
      r, [](RingMemory* m) { runOnStagingThread([m] { delete m; }); });
}

} // namespace

std::shared_ptr<RingMemory> RingMemory::create(
    uint64_t generation,
    uint32_t slots,
    uint64_t slotBytes) {
  auto r = ownedOffLoop(new RingMemory());
  r->file_ = shm::Slab::create(kRingHeaderBytes + slots * slotBytes);
  SignalPair pair = makeSignalPair();
  r->wakeFd_ = pair.ours;
  r->peerWakeFd_ = pair.theirs;
  r->generation_ = generation;
  r->slots_ = slots;
  r->slotBytes_ = slotBytes;
  return r;
}

std::string RingMemory::attach(
    const RingSetup& setup,
    int memFd,
    int wakeFd,
    std::shared_ptr<RingMemory>* out) {
  std::unique_ptr<RingMemory> r(new RingMemory());
  r->wakeFd_ = wakeFd; // closed with `r` on every way out
  if (setup.slots == 0 || setup.slots > kMaxRingSlots || setup.reserved != 0 ||
      setup.slotBytes == 0 || setup.slotBytes > kMaxRingSlotBytes ||
      setup.slotBytes % shm::kSlabPage != 0 ||
      setup.slots * setup.slotBytes > kMaxRingBytes) {
    closeOffThread(memFd);
    return "a ring of " + std::to_string(setup.slots) + " slots of " +
        std::to_string(setup.slotBytes) + " bytes (at most " +
        std::to_string(kMaxRingSlots) + " of " +
        std::to_string(kMaxRingSlotBytes) + ", in whole pages, " +
        std::to_string(kMaxRingBytes) + " in all)";
  }
  // The sender's wake-up must be a Unix stream socket, which a release
  // signals with MSG_DONTWAIT whatever its flags: a write to a pipe, or to
  // an eventfd the peer made blocking and filled, would block the staging
  // thread that releases a slot.
  if (!isSignalSocket(wakeFd)) {
    closeOffThread(memFd);
    return "its wake-up descriptor is not a Unix stream socket";
  }
  std::string why = shm::Slab::attach(
      memFd, kRingHeaderBytes + setup.slots * setup.slotBytes, &r->file_);
  if (!why.empty()) {
    return why;
  }
  r->generation_ = setup.generation;
  r->slots_ = setup.slots;
  r->slotBytes_ = setup.slotBytes;
  *out = ownedOffLoop(r.release());
  return {};
}

RingMemory::~RingMemory() {
  if (pinnedDevice_ >= 0 && file_ && !ExitGate::closed()) {
    try {
      CurrentDevice current(pinnedDevice_);
      TORCH_RPC_EXT_CUDA_CHECK(cuMemHostUnregister, slot(0));
    } catch (const std::exception& e) {
      logWarning(
          std::string(
              "torch_rpc_ext: cuda_ring could not unregister a "
              "ring: ") +
          e.what());
    }
  }
  // An attached ring's wake-up is the peer's (fd_closer.h); ours goes the
  // same way.
  for (int fd : {wakeFd_, peerWakeFd_}) {
    closeOffThread(fd);
  }
}

char* RingMemory::slot(uint32_t i) const {
  return file_->data() + kRingHeaderBytes + i * slotBytes_;
}

int RingMemory::memFd() const {
  return file_->fd();
}

uint64_t RingMemory::released(uint32_t i) const {
  return __atomic_load_n(
      reinterpret_cast<uint64_t*>(file_->data() + i * kRingCounterStride),
      __ATOMIC_ACQUIRE);
}

void RingMemory::release(uint32_t i) {
  __atomic_fetch_add(
      reinterpret_cast<uint64_t*>(file_->data() + i * kRingCounterStride),
      1,
      __ATOMIC_RELEASE);
  // Never blocks. Full: signals are pending already; the sender gone:
  // nobody is left to wake.
  (void)sendSignal(wakeFd_);
}

SignalDrain RingMemory::drainWakeups() {
  return drainSignals(wakeFd_);
}

void RingMemory::pin(int device) {
  std::lock_guard<std::mutex> lock(pinMu_);
  if (pinnedDevice_ >= 0) {
    return;
  }
  if (!pinError_.empty()) {
    throw std::runtime_error(pinError_); // tried once: no second wait
  }
  try {
    CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuMemHostRegister,
        slot(0),
        slots_ * slotBytes_,
        CU_MEMHOSTREGISTER_PORTABLE);
  } catch (const std::exception& e) {
    pinError_ = e.what();
    throw;
  }
  pinnedDevice_ = device;
}

void recordOrHold(
    int device,
    const PooledEvent& event,
    CUstream stream,
    std::shared_ptr<RingMemory> ring) {
  try {
    CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, event.get(), stream);
  } catch (const std::exception&) {
    // No completion will hold the ring: it goes once the stream has
    // drained (on the staging thread, where a ring is let go anyway).
    runOnStagingThread([device, stream, ring = std::move(ring)]() mutable {
      try {
        CurrentDevice current(device);
        libcuda().cuStreamSynchronize(stream);
      } catch (const std::exception&) {
        // The driver is gone: nothing runs on the ring any more.
      }
      ring.reset();
    });
    throw;
  }
}

// ---- Receiving --------------------------------------------------------------

namespace {

// The receiver's slots pinned, or (where the driver refuses to register
// them) copied from as they are: a copy out of pageable memory is correct,
// only slower (the driver runs it synchronously through a buffer of its
// own). Said once per process.
void pinOrWarn(RingMemory& ring, int device) {
  try {
    ring.pin(device);
  } catch (const std::exception& e) {
    static std::once_flag said;
    std::call_once(said, [&] {
      logWarning(
          std::string(
              "torch_rpc_ext: cuda_ring could not pin a peer's "
              "ring, copies from it run at pageable speed: ") +
          e.what());
    });
  }
}

} // namespace

struct RingChannel::Landing {
  StagingPool* pool = nullptr;
  std::shared_ptr<StagingPool::Block> block;
  CUstream stream = nullptr;
  bool copied = false; // a copy onto the block was queued
  // Our side could not land it (no device memory): its chunks are released
  // unread and the message fails with this (frame::FailedRegion).
  std::string failure;
};

RingChannel::RingChannel(
    std::shared_ptr<const Context> context,
    std::weak_ptr<Host> host,
    SlotRingCounters& counters)
    : Channel(std::move(context)),
      host_(std::move(host)),
      counters_(counters),
      used_(std::chrono::steady_clock::now()) {}

RingChannel::~RingChannel() {
  abandonLanding();
}

int64_t RingChannel::onRecordFromLoop(
    const frame::SegmentRecord& raw,
    InboundSegment& segment) {
  auto host = host_.lock();
  SlotRecord record;
  static_assert(sizeof(record) == sizeof(raw));
  std::memcpy(&record, &raw, sizeof(record));
  auto reject = [&](const std::string& why) -> int64_t {
    if (host) {
      host->rejectFromLoop("rejected frame: cuda_ring " + why);
    }
    return -1;
  };
  const std::shared_ptr<RingMemory> ring = ringIn_;
  if (!ring || record.generation != ring->generation()) {
    return reject("record names a ring that is not the peer's current one");
  }
  if (record.slot >= ring->slots() || record.bytes == 0 ||
      record.bytes > ring->slotBytes() ||
      record.bytes > segment.size - segment.filled) {
    return reject(
        "record of " + std::to_string(record.bytes) + " bytes in slot " +
        std::to_string(record.slot) + " does not fit its ring or segment");
  }
  const bool served = segment.device != frame::kDeviceNotServed;
  if ((segment.device < 0 && served) || segment.provided == nullptr) {
    return reject(
        "segment of " + std::to_string(segment.size) +
        " bytes for a tensor this process keeps in host memory");
  }
  const bool last = segment.filled + record.bytes == segment.size;
  if (segment.filled == 0) {
    abandonLanding(); // none, unless the last frame broke off
    landing_ = std::make_unique<Landing>();
    if (!served) {
      // The agent fails the message, naming the device: nothing is made
      // for it here, and its slots go back unread.
      landing_->failure = "cuda_ring will not land " +
          std::to_string(segment.size) +
          " bytes on a device this process does not serve";
    } else {
      try {
        landing_->pool = &StagingPool::of(segment.device);
        landing_->block = landing_->pool->takeBlockForCopies(segment.size);
        landing_->stream = landing_->pool->copyStream();
        pinOrWarn(*ring, segment.device);
      } catch (const std::exception& e) {
        // Our shortage fails the message's call, not the connection.
        abandonLanding();
        landing_ = std::make_unique<Landing>();
        landing_->failure = "cuda_ring could not land " +
            std::to_string(segment.size) +
            " bytes on cuda:" + std::to_string(segment.device) + ": " +
            e.what();
        counters_.declined++;
      }
    }
  }
  Landing* l = landing_.get();
  if (l == nullptr) {
    return reject("record in the middle of a segment it did not begin");
  }
  if (!l->failure.empty()) {
    ring->release(record.slot); // read by no one
    if (last) {
      *segment.provided = nullptr;
      *segment.region = std::make_shared<frame::FailedRegion>(l->failure);
      landing_.reset();
    }
    return record.bytes;
  }
  try {
    CurrentDevice current(l->pool->device());
    // Taken before the copy: nothing between the copy and its completion's
    // hold on the ring may fail but the record itself.
    auto copied = l->pool->takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(
        cuMemcpyHtoDAsync,
        l->block->address + segment.filled,
        ring->slot(record.slot),
        record.bytes,
        l->stream);
    l->copied = true;
    counters_.chunks++;
    const uint32_t slot = record.slot;
    const int device = l->pool->device();
    // The slot goes back once the copy out of it has completed; a copy
    // that failed leaves a tensor that must not be used: the connection
    // closes (as the device's next use would fail anyway).
    recordOrHold(device, copied, l->stream, ring);
    std::weak_ptr<RingChannel> weak = shared_from_this();
    whenComplete(
        device,
        std::move(copied),
        [ring, slot, weak, device](const std::string& error) {
          ring->release(slot);
          auto self = weak.lock();
          if (!error.empty() && self) {
            self->failFromStagingThread(
                "copying a chunk onto cuda:" + std::to_string(device) +
                " failed: " + error);
          }
        });
    if (!last) {
      return record.bytes;
    }
    auto ready = l->pool->takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, ready.get(), l->stream);
    *segment.provided = reinterpret_cast<void*>(l->block->address);
    *segment.region = std::make_shared<PooledRegion>(
        *l->pool,
        std::move(l->block),
        std::move(ready),
        // The pool's stream lives as long as the process: not owned.
        std::shared_ptr<CUstream_st>(l->stream, [](CUstream_st*) {}));
  } catch (const std::exception& e) {
    abandonLanding();
    return reject(std::string("copying onto the device failed: ") + e.what());
  }
  landing_.reset();
  counters_.received++;
  counters_.receivedBytes += segment.size;
  return record.bytes;
}

void RingChannel::abandonLanding() {
  if (!landing_) {
    return;
  }
  auto l = std::move(landing_);
  if (!l->failure.empty() || !l->block) {
    return;
  }
  try {
    if (l->copied || l->block->used) {
      // Copies may still write the block.
      CurrentDevice current(l->pool->device());
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, l->block->lastUse, l->stream);
      l->block->used = true;
    }
    l->pool->giveBlock(std::move(l->block));
  } catch (const std::exception& e) {
    logWarning(
        std::string(
            "torch_rpc_ext: cuda_ring keeps a landing block it "
            "could not release: ") +
        e.what());
  }
}

bool RingChannel::acceptsControlFrame(
    frame::FrameKind kind,
    uint32_t headLength) const {
  switch (context().wireIds().offsetOf(kind)) {
    case kRingSetup:
      return headLength == sizeof(RingSetup);
    case kRingDrop:
      return headLength == sizeof(uint64_t);
    default:
      return false;
  }
}

bool RingChannel::onControlFrameFromLoop(
    frame::FrameKind kind,
    const std::string& head,
    std::vector<int>& fds) {
  auto host = host_.lock();
  if (!host) {
    return false;
  }
  if (context().wireIds().offsetOf(kind) == kRingDrop) {
    uint64_t generation;
    std::memcpy(&generation, head.data(), sizeof(generation));
    if (!ringIn_ || ringIn_->generation() != generation) {
      host->rejectFromLoop(
          "rejected frame: the peer dropped a cuda_ring it never set up");
      return false;
    }
    ringIn_.reset(); // copies still reading a slot hold it
    return true;
  }
  if (fds.size() < 2) {
    host->rejectFromLoop(
        "rejected frame: cuda_ring setup without its descriptors");
    return false;
  }
  RingSetup setup;
  std::memcpy(&setup, head.data(), sizeof(setup));
  int memFd = fds[0];
  int wakeFd = fds[1];
  fds.erase(fds.begin(), fds.begin() + 2);
  std::shared_ptr<RingMemory> ring;
  std::string why = RingMemory::attach(setup, memFd, wakeFd, &ring);
  if (!why.empty()) {
    host->rejectFromLoop("rejected cuda_ring: " + why);
    return false;
  }
  ringIn_ = std::move(ring); // every record naming the last one came before
  return true;
}

void RingChannel::onClosedFromLoop() {
  abandonLanding();
  if (watched_) {
    if (auto host = host_.lock()) {
      host->unwatchFromLoop(watched_->wakeFd());
    }
    watched_.reset();
  }
  // Both rings go now, not with the connection: a request still served for
  // the peer holds it as long as it runs, and the peer's ring (up to 256
  // MiB) is mapped and pinned here. A copy still running holds its ring;
  // the last holder frees it on the staging thread (ownedOffLoop).
  ringIn_.reset();
  std::lock_guard<std::mutex> lock(mutex_);
  out_.reset(); // its wake-up socket is not watched (above)
  announce_ = false;
  slots_.clear();
  sentCount_.clear();
}

// ---- The context ------------------------------------------------------------

namespace {

std::atomic<int64_t> idleMs{kRingIdleMs};

// $TORCH_RPC_EXT_CUDA_RING_IDLE_MS, or why it cannot be used ("" if unset or
// good).
std::string readIdleMs() {
  const char* v = std::getenv("TORCH_RPC_EXT_CUDA_RING_IDLE_MS");
  if (v == nullptr || *v == '\0') {
    return {};
  }
  char* end = nullptr;
  errno = 0;
  const long long ms = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || ms < 0 || ms > 600000) {
    return std::string("TORCH_RPC_EXT_CUDA_RING_IDLE_MS=") + v +
        " is not a whole number of milliseconds from 0 to 600000";
  }
  idleMs = ms;
  return {};
}

class RingContext final : public Context {
 public:
  explicit RingContext(WireIds ids) : Context(ids) {}

  std::string name() const override {
    return "cuda_ring";
  }
  DeviceKind device() const override {
    return DeviceKind::kCuda;
  }
  Channel::Mode mode() const override {
    return Channel::Mode::kChunks;
  }
  std::string unviableReason() const override {
    std::call_once(probed_, [this] {
      unviable_ = readIdleMs();
      if (unviable_.empty()) {
        unviable_ = noCudaDeviceReason();
      }
      if (unviable_.empty() && bootId().empty()) {
        unviable_ = "cannot identify this host's kernel (no boot id)";
      }
      if (unviable_.empty()) {
        try {
          shm::Slab::create(shm::kSlabPage); // memfds and their seals
        } catch (const std::exception& e) {
          unviable_ = e.what();
        }
      }
    });
    return unviable_;
  }
  // Two processes of one booted kernel: the ring is a memfd.
  std::string domainDescriptor() const override {
    return bootId();
  }
  bool needsDescriptorPassing() const override {
    return true;
  }
  std::shared_ptr<Channel> open(std::weak_ptr<Host> host, const std::string&)
      override {
    return std::make_shared<RingChannel>(
        shared_from_this(), std::move(host), counters_);
  }
  std::map<std::string, uint64_t> counters() const override {
    return {
        {"segments_sent", counters_.sent.load()},
        {"bytes_sent", counters_.sentBytes.load()},
        {"segments_received", counters_.received.load()},
        {"bytes_received", counters_.receivedBytes.load()},
        {"chunk_copies", counters_.chunks.load()},
        {"made", counters_.created.load()},
        {"dropped", counters_.dropped.load()},
        {"declined", counters_.declined.load()},
        {"slot_waits", counters_.slotWaits.load()},
    };
  }

 private:
  mutable std::once_flag probed_;
  mutable std::string unviable_;
  mutable SlotRingCounters counters_;
};

} // namespace

int64_t ringIdleMs() {
  return idleMs.load(std::memory_order_relaxed);
}

std::shared_ptr<Context> createRingChannel(WireIds ids) {
  return std::make_shared<RingContext>(ids);
}

} // namespace torch_rpc_ext::channel::cuda
