// SPDX-License-Identifier: BSD-3-Clause
// The agent's CUDA side: devices.h.
#include "csrc/agent/devices.h"

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <ATen/Context.h>
#include <ATen/ops/_neg_view.h>
#include <ATen/ops/empty.h>

#include <c10/core/Event.h>

#include <algorithm>
#include <optional>
#include <unordered_map>

#include "csrc/agent/landing_pool.h"
#include "csrc/channel/grants.h"
#include "csrc/channel/registry.h"
#include "csrc/common/logging.h"
#include "csrc/frame/landed_region.h"

namespace torch_rpc_ext {

namespace {

// Whether torch's CUDA allocator has its per-device tables (one that is
// not a DeviceAllocator is taken as ready).
bool torchCudaReady() {
  auto* a = dynamic_cast<c10::DeviceAllocator*>(c10::GetAllocator(c10::kCUDA));
  return a == nullptr || a->initialized();
}

// Torch's lazy CUDA init (what torch.cuda.init() runs, minus Python's own
// bookkeeping: no GIL needed, so any thread), once; throws naming the fix
// where this torch cannot run it from C++.
void initTorchCuda() {
  static std::atomic<bool> ready{false};
  if (ready.load(std::memory_order_acquire)) {
    return;
  }
  if (!torchCudaReady() && at::globalContext().hasCUDA()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  }
  TORCH_CHECK(
      torchCudaReady(),
      "torch's CUDA caching allocator is not initialized in this process "
      "(call torch.cuda.init() before init_rpc)");
  ready.store(true, std::memory_order_release);
}

} // namespace

rpc::DeviceMap AgentDevices::mapTo(const std::string& name) const {
  auto it = options_.deviceMaps.find(name);
  return it == options_.deviceMaps.end() ? rpc::DeviceMap{} : it->second;
}

void AgentDevices::recordCudaUse(const rpc::Message& message) {
  std::optional<c10::impl::VirtualGuardImpl> impl;
  for (const auto& t : message.tensors()) {
    if (t.is_cuda()) {
      if (!impl) {
        impl.emplace(c10::kCUDA);
      }
      impl->recordDataPtrOnStream(
          t.storage().data_ptr(), impl->getStream(t.device()));
    }
  }
}

void AgentDevices::useTorchForChannelMemory() const {
  // Process-wide: the last agent's options stand (one agent per process).
  channel::setCudaMemoryPolicy(options_.cudaIpcMemoryLimit, [](int) {
    // Torch's allocator frees every device's unused cached blocks (torch
    // has no per-device call); one that is not a DeviceAllocator has none.
    try {
      if (auto* a = dynamic_cast<c10::DeviceAllocator*>(
              c10::GetAllocator(c10::kCUDA))) {
        a->emptyCache();
      }
    } catch (const std::exception& e) {
      logWarning(
          std::string(
              "torch_rpc_ext: freeing torch's cached CUDA memory "
              "failed: ") +
          e.what());
    }
  });
}

void AgentDevices::prepare() const {
  // Landing memory granted to peers comes from the landing pools
  // (channel/grants.h); without them, cuda_ipc grants none (process-wide:
  // the last agent's stands).
  channel::setGrantSource(
      options_.devices.empty() || options_.landingPools.empty()
          ? nullptr
          : makePoolGrants(options_.landingPools));
  if (options_.devices.empty()) {
    return;
  }
  try {
    initTorchCuda();
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    for (const auto& d : options_.devices) {
      channel::warmCudaDevice(d.index());
      impl.getStreamFromGlobalPool(d); // torch makes a device's pool once
    }
  } catch (const std::exception& e) {
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    logWarning(
        "torch_rpc_ext: " + self_ +
        " could not prepare its CUDA devices, so CUDA tensors sent to it "
        "will fail their calls: " +
        (c10 ? c10->what_without_backtrace() : e.what()));
  }
}

AgentDevices::Landing& AgentDevices::landingFor(
    c10::DeviceIndex device,
    int32_t peer) const {
  const int slot = static_cast<int>(
      static_cast<uint32_t>(peer) % static_cast<uint32_t>(kLandingSlots));
  std::lock_guard<std::mutex> lock(landingMu_);
  for (auto& l : landingStreams_) {
    if (l->stream.device_index() == device && l->slot == slot) {
      return *l;
    }
  }
  // From torch's high-priority pool: never an arrival stream (those come
  // from the low-priority one), and the landing copies are short and gate
  // the user's work.
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  landingStreams_.push_back(
      std::make_unique<Landing>(
          slot,
          impl.getStreamFromGlobalPool(
              c10::Device(c10::kCUDA, device), /*isHighPriority=*/true)));
  return *landingStreams_.back();
}

wire::InboundMessage::Landed AgentDevices::land(
    Landing& landing,
    const c10::Stream& arrival,
    const std::vector<std::pair<uintptr_t, size_t>>& spans) {
  initTorchCuda(); // the backstop (prepare() ran it at init_rpc)
  const c10::Stream& stream = landing.stream;
  wire::InboundMessage::Landed out;
  out.places.reserve(spans.size());
  std::vector<channel::DeviceCopy> copies;
  copies.reserve(spans.size());
  // Where each span goes: small ones packed into shared allocations of up
  // to kLandPackBytes (each at a 256-byte-aligned offset), a larger one in
  // an allocation of its own.
  std::optional<uint32_t> pack; // the allocation small spans go into
  for (const auto& [address, size] : spans) {
    const uint64_t at = pack ? (out.sizes[*pack] + 255) / 256 * 256 : 0;
    if (size > kLandPackMaxSegment || !pack || at + size > kLandPackBytes) {
      if (size <= kLandPackMaxSegment) {
        pack = static_cast<uint32_t>(out.sizes.size());
      }
      out.places.emplace_back(static_cast<uint32_t>(out.sizes.size()), 0);
      out.sizes.push_back(size);
      continue;
    }
    out.places.emplace_back(*pack, at);
    out.sizes[*pack] = at + size;
  }
  uint64_t bytes = 0;
  {
    // Torch's caching allocator takes the current stream as the one the
    // memory is used on, and reuses a freed block at once only on that
    // stream. Every landing of a peer's slot allocates and copies on its
    // landing stream, so after the first messages the cache serves them
    // all (with a pool stream per message, early calls paid cudaMalloc and
    // up to 32 times the largest message sat cached per device); the copy
    // runs on the stream the memory is allocated for, so it is ordered
    // after the work of the block's last user there.
    // From torch's default pool, with a landing pool too: only grants need
    // segments of ours (landing_pool.h), and memory landed by copy is then
    // the user's cache as any other (empty_cache() returns it; out of
    // memory, torch frees its cache and retries, which it does not in a
    // pool's routing window).
    c10::StreamGuard guard(stream);
    c10::Allocator* allocator = c10::GetAllocator(c10::kCUDA);
    // Our thread, in relaxed capture mode: a user's global-mode capture
    // elsewhere stays valid.
    channel::withRelaxedCudaCapture([&] {
      for (uint64_t size : out.sizes) {
        out.allocations.push_back(allocator->allocate(size));
      }
    });
  }
  for (size_t k = 0; k < spans.size(); ++k) {
    const auto [a, offset] = out.places[k];
    copies.push_back(
        {reinterpret_cast<uintptr_t>(out.allocations[a].get()) + offset,
         spans[k].first,
         spans[k].second});
    bytes += spans[k].second;
  }
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  channel::copyOnCudaDevice(
      stream.device_index(),
      reinterpret_cast<uintptr_t>(impl.getStreamNativeHandle(stream)),
      copies);
  {
    // The message's work runs on its arrival stream, after the copies (one
    // event per landing stream, recorded and waited on under its lock: a
    // wait takes the record made just before it), and the allocator knows
    // that stream uses the memory (a block is reused only once it has
    // passed the free).
    std::lock_guard<std::mutex> lock(landing.mu);
    landing.copied.record(stream);
    landing.copied.block(arrival);
  }
  for (const auto& p : out.allocations) {
    impl.recordDataPtrOnStream(p, arrival);
  }
  landings_.fetch_add(1, std::memory_order_relaxed);
  landed_.fetch_add(spans.size(), std::memory_order_relaxed);
  landedBytes_.fetch_add(bytes, std::memory_order_relaxed);
  landedAllocations_.fetch_add(
      out.allocations.size(), std::memory_order_relaxed);
  return out;
}

std::vector<c10::DataPtr> AgentDevices::landFromHost(
    const c10::Stream& stream,
    const std::vector<c10::Storage>& hosts) {
  initTorchCuda();
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  const auto handle =
      reinterpret_cast<uintptr_t>(impl.getStreamNativeHandle(stream));
  std::vector<c10::DataPtr> out;
  out.reserve(hosts.size());
  c10::StreamGuard guard(stream); // allocated for, and copied on, `stream`
  c10::Allocator* allocator = c10::GetAllocator(c10::kCUDA);
  for (const auto& host : hosts) {
    c10::DataPtr p;
    channel::withRelaxedCudaCapture(
        [&] { p = allocator->allocate(host.nbytes()); });
    // The host storage (a pooled buffer, a shared slab) is held until the
    // stream has read it.
    channel::copyToDevice(
        stream.device_index(),
        handle,
        reinterpret_cast<uintptr_t>(p.get()),
        host.data(),
        host.nbytes(),
        [held = host]() mutable { held = c10::Storage(); });
    out.push_back(std::move(p));
  }
  fromHost_.fetch_add(hosts.size(), std::memory_order_relaxed);
  return out;
}

std::vector<at::Tensor> AgentDevices::toHost(
    const std::vector<at::Tensor>& ts) {
  // The byte span of each storage the tensors use, relative to its start.
  struct Span {
    int64_t lo;
    int64_t hi;
    c10::Device device;
    at::Tensor bytes;
  };
  std::unordered_map<c10::StorageImpl*, Span> spans;
  std::vector<c10::StorageImpl*> order;
  auto offsetOf = [](const at::Tensor& t) {
    return t.storage_offset() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& t : ts) {
    const int64_t extent = wire::extentBytes(t);
    const int64_t lo = offsetOf(t);
    auto* impl = t.storage().unsafeGetStorageImpl();
    auto [it, added] =
        spans.emplace(impl, Span{lo, lo + extent, t.device(), {}});
    if (added) {
      order.push_back(impl);
    } else {
      it->second.lo = std::min(it->second.lo, lo);
      it->second.hi = std::max(it->second.hi, lo + extent);
    }
  }
  for (const auto& t : ts) {
    // Each view's offset into the copy must be whole elements.
    auto& s = spans.at(t.storage().unsafeGetStorageImpl());
    if ((offsetOf(t) - s.lo) % static_cast<int64_t>(t.element_size()) != 0) {
      s.lo = 0;
    }
  }
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  std::vector<std::pair<c10::DeviceIndex, uintptr_t>> streams;
  for (auto* storage : order) {
    auto& s = spans.at(storage);
    s.bytes = at::empty({s.hi - s.lo}, at::TensorOptions().dtype(at::kByte));
    const auto stream = reinterpret_cast<uintptr_t>(
        impl.getStreamNativeHandle(impl.getStream(s.device)));
    channel::copyToHost(
        s.device.index(),
        stream,
        s.bytes.data_ptr(),
        reinterpret_cast<uintptr_t>(storage->data()) + s.lo,
        static_cast<size_t>(s.hi - s.lo));
    if (std::find(
            streams.begin(),
            streams.end(),
            std::make_pair(s.device.index(), stream)) == streams.end()) {
      streams.emplace_back(s.device.index(), stream);
    }
  }
  for (const auto& [device, stream] : streams) {
    channel::waitForStream(device, stream);
  }
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    const auto& s = spans.at(t.storage().unsafeGetStorageImpl());
    at::Tensor host =
        at::empty({0}, at::TensorOptions().dtype(t.scalar_type()));
    host.set_(
        s.bytes.storage(),
        (offsetOf(t) - s.lo) / static_cast<int64_t>(t.element_size()),
        t.sizes(),
        t.strides());
    if (t.requires_grad()) {
      host.requires_grad_(true);
    }
    // (A lazy conj or neg is a bit, not bytes: kept; the encoder resolves it.)
    if (t.is_conj()) {
      host = host.conj();
    }
    if (t.is_neg()) {
      host = at::_neg_view(host);
    }
    out.push_back(std::move(host));
  }
  return out;
}

std::vector<c10::Stream> AgentDevices::arrivalStreams() const {
  std::vector<c10::Stream> out;
  if (options_.devices.empty()) {
    return out; // (finish() then names the device no stream is for)
  }
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  for (const auto& d : options_.devices) {
    out.push_back(impl.getStreamFromGlobalPool(d));
  }
  return out;
}

wire::DeviceRoute AgentDevices::routeTo(
    const std::string& peer,
    const rpc::DeviceMap& map) const {
  wire::DeviceRoute route;
  route.map = map;
  route.peer = peer;
  // A tensor's bytes are read on the sender's current stream of its device,
  // after whatever it queued there (recordCudaUse() tells the caching
  // allocator, so a storage freed meanwhile is not reused before the copy
  // is done).
  route.toHost = [this](const std::vector<at::Tensor>& ts) {
    toHost_.fetch_add(ts.size(), std::memory_order_relaxed);
    return toHost(ts);
  };
  route.readyStream = [](c10::Device device) {
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    return reinterpret_cast<uintptr_t>(
        impl.getStreamNativeHandle(impl.getStream(device)));
  };
  return route;
}

void AgentDevices::addMetrics(
    std::unordered_map<std::string, std::string>& m) const {
  const auto d = channel::cudaMemoryStats();
  m["rpc_ext.cuda.ipc_block_bytes"] = std::to_string(d.ipcBlockBytes);
  m["rpc_ext.cuda.staging_block_bytes"] = std::to_string(d.stagingBlockBytes);
  m["rpc_ext.cuda.oom_retries"] = std::to_string(d.oomRetries);
  m["rpc_ext.cuda.ipc_declined_memory"] = std::to_string(d.ipcDeclined);
  m["rpc_ext.cuda.grant_bytes"] = std::to_string(d.grantBytes);
  m["rpc_ext.cuda.landing_launches"] = std::to_string(landings_.load());
  m["rpc_ext.cuda.landed_segments"] = std::to_string(landed_.load());
  m["rpc_ext.cuda.landed_bytes"] = std::to_string(landedBytes_.load());
  m["rpc_ext.cuda.landing_allocations"] =
      std::to_string(landedAllocations_.load());
  m["rpc_ext.cuda.landing_pool_allocations"] =
      std::to_string(landingPoolAllocations());
  m["rpc_ext.cuda.granted_segments"] = std::to_string(granted_.load());
  const auto segments = landingSegmentCounts();
  m["rpc_ext.cuda.landing_pool_segments"] = std::to_string(segments.live);
  m["rpc_ext.cuda.landing_pool_bytes"] = std::to_string(segments.liveBytes);
  m["rpc_ext.cuda.from_host_segments"] = std::to_string(fromHost_.load());
  m["rpc_ext.cuda.to_host_tensors"] = std::to_string(toHost_.load());
  m["rpc_ext.cuda.receive_failures"] = std::to_string(failures_.load());
}

} // namespace torch_rpc_ext
