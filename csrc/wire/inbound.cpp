// SPDX-License-Identifier: BSD-3-Clause
// The decoding half of the message codec (codec.h): InboundMessage.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>

#include "csrc/frame/landed_region.h"
#include "csrc/wire/codec.h"
#include "csrc/wire/head.h"
#include "csrc/wire/inbound_tensors.h"

namespace torch_rpc_ext::wire {

namespace detail {

void releaseProvided(void* ctx) {
  delete static_cast<ProvidedRegion*>(ctx);
}

} // namespace detail

namespace {

using namespace detail;

// A pooled block owned by a storage: returned to its pool (which it keeps
// alive) when the last tensor viewing it dies, on whatever thread that is.
struct PooledBlock {
  std::shared_ptr<BufferPool> pool;
  BufferPool::Block block;
};

void releasePooled(void* ctx) {
  auto* owned = static_cast<PooledBlock*>(ctx);
  owned->pool->release(owned->block);
  delete owned;
}

c10::Storage allocateSegment(
    uint64_t size,
    const std::shared_ptr<BufferPool>& pool) {
  if (pool == nullptr || size < BufferPool::kMinPooledBytes) {
    return c10::Storage(
        c10::Storage::use_byte_size_t(),
        static_cast<int64_t>(size),
        c10::GetCPUAllocator(),
        /*resizable=*/false);
  }
  auto* owned = new PooledBlock{pool, pool->acquire(size)};
  c10::DataPtr data(
      owned->block.data, owned, &releasePooled, c10::Device(c10::kCPU));
  return c10::Storage(
      c10::Storage::use_byte_size_t(),
      static_cast<int64_t>(size),
      std::move(data),
      /*allocator=*/nullptr,
      /*resizable=*/false);
}

} // namespace

std::shared_ptr<InboundMessage> InboundMessage::prepare(
    const std::string& head,
    const std::vector<uint64_t>& segmentSizes,
    const std::shared_ptr<BufferPool>& pool,
    const std::vector<bool>& provided) {
  if (segmentSizes.empty()) {
    throw std::invalid_argument("message frame without a payload segment");
  }
  auto m = std::make_shared<InboundMessage>();
  HeadReader r(head);
  uint32_t type = r.get<uint32_t>("type");
  const bool traced = (type & kTraceFlag) != 0;
  type &= ~kTraceFlag;
  // rpc::MessageType has no fixed underlying type, so it can only hold the
  // values of its smallest bit-field, 0..0x3FF (the two flag bits and the
  // byte under them): casting anything larger to it is undefined behaviour.
  constexpr uint32_t kFlags = rpc::MessageTypeFlags::REQUEST_TYPE |
      rpc::MessageTypeFlags::RESPONSE_TYPE;
  if ((type & kFlags) == 0 || type > (kFlags | 0xFF)) {
    throw std::invalid_argument("bad message type " + std::to_string(type));
  }
  m->type_ = static_cast<rpc::MessageType>(type);
  m->id_ = r.get<int64_t>("id");
  uint32_t n = r.get<uint32_t>("tensor count");
  // Each tensor takes at least 17 head bytes (a 0-dim dense one: layout,
  // dtype, requires_grad, ndim, offset, segment, device); this bounds `n`
  // by the head. (20 refused six scalars, a message the head does hold.)
  if (n > head.size() / 17) {
    throw std::invalid_argument("tensor count exceeds what the head can hold");
  }
  m->tensors_.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    TensorMeta t{};
    uint8_t layout = r.get<uint8_t>("layout");
    if (layout == kLayoutStrided) {
      t.sparse = false;
      t.dense = readDense(r, segmentSizes);
    } else if (layout == kLayoutQuantized) {
      readQuantized(r, segmentSizes, t);
    } else if (layout == kLayoutSparseCoo) {
      t.sparse = true;
      t.requiresGrad = r.get<uint8_t>("requires_grad") != 0;
      t.coalesced = r.get<uint8_t>("coalesced") != 0;
      size_t ndim = r.get<uint8_t>("ndim");
      if (ndim > kMaxDims) {
        throw std::invalid_argument("too many sparse dims");
      }
      t.sparseSizes.resize(ndim);
      for (auto& s : t.sparseSizes) {
        s = r.get<int64_t>("sparse size");
        if (s < 0) {
          throw std::invalid_argument("negative sparse size");
        }
      }
      t.indices = readDense(r, segmentSizes);
      t.dense = readDense(r, segmentSizes);
      if (t.indices.dtype != c10::ScalarType::Long) {
        throw std::invalid_argument("sparse indices must be int64");
      }
      if (moreElementsThanSegment(t.indices, segmentSizes)) {
        throw std::invalid_argument(
            "sparse indices have more elements than their segment holds");
      }
    } else {
      throw std::invalid_argument("unknown layout " + std::to_string(layout));
    }
    m->tensors_.push_back(std::move(t));
  }
  if (traced) {
    // The caller's trace context: used only if it is a traceparent, else
    // ignored (and counted by the agent), never trusted further.
    const size_t n = r.get<uint8_t>("trace context length");
    std::string trace = r.bytes(n, "trace context");
    if (isTraceparent(trace)) {
      m->trace_ = std::move(trace);
    } else {
      m->traceIgnored_ = true;
    }
  }
  if (!r.done()) {
    throw std::invalid_argument("trailing bytes after the message head");
  }
  // Every tensor of a segment is on one device; a CUDA segment's bytes come
  // from a device channel (cuda_staged's through the stream, landed by the
  // channel), never as the stream's own bytes.
  // A segment of host bytes a CUDA tensor lands from ({"cpu": d} maps) is
  // a host segment, copied onto the device in finish().
  m->segmentDevices_.assign(segmentSizes.size() - 1, -2);
  m->segmentLandings_.assign(segmentSizes.size() - 1, -1);
  c10::SmallVector<int, 8> placed(segmentSizes.size() - 1, -2);
  auto place = [&](const DenseMeta& d) {
    const int code = d.hostCarried ? -3 - int(d.device) : int(d.device);
    int& seen = placed[d.segment - 1];
    if (seen != -2 && seen != code) {
      throw std::invalid_argument(
          "segment " + std::to_string(d.segment) +
          " holds tensors of two devices");
    }
    seen = code;
    m->segmentDevices_[d.segment - 1] = d.hostCarried ? -1 : d.device;
    if (d.hostCarried) {
      m->segmentLandings_[d.segment - 1] = d.device;
    }
    bool cameProvided = d.segment < provided.size() && provided[d.segment];
    // (An empty one has no bytes to carry: the stream takes it.)
    if (!d.hostCarried && d.device >= 0 && !cameProvided &&
        segmentSizes[d.segment] != 0) {
      throw std::invalid_argument(
          "a CUDA tensor's segment " + std::to_string(d.segment) +
          " came through the stream, not a device channel");
    }
    if (d.device >= 0 &&
        std::find(m->cudaDevices_.begin(), m->cudaDevices_.end(), d.device) ==
            m->cudaDevices_.end()) {
      m->cudaDevices_.push_back(d.device);
    }
  };
  for (const auto& t : m->tensors_) {
    place(t.dense);
    if (t.quantized) {
      for (const DenseMeta* d : {&t.dense, &t.indices, &t.zeroPoints}) {
        if (t.qscheme == c10::kPerTensorAffine && d != &t.dense) {
          continue;
        }
        if (d->device >= 0 || d->hostCarried) {
          throw std::invalid_argument("a quantized tensor on a CUDA device");
        }
        if (d != &t.dense) {
          place(*d);
        }
      }
    }
    if (t.sparse) {
      if (t.dense.device >= 0 || t.indices.device >= 0 || t.dense.hostCarried ||
          t.indices.hostCarried) {
        throw std::invalid_argument("a sparse tensor on a CUDA device");
      }
      place(t.indices);
    }
  }
  // Only now, with every length checked, allocate.
  for (auto n : segmentSizes) {
    m->bytes_ += n;
  }
  auto isProvided = [&](size_t i) {
    return i < provided.size() && provided[i];
  };
  if (!provided.empty()) {
    m->sizes_ = segmentSizes; // finish() sizes the provided segments
  }
  if (!isProvided(0)) {
    m->payload_.resize(segmentSizes[0]);
  }
  m->storages_.reserve(segmentSizes.size() - 1);
  for (size_t i = 1; i < segmentSizes.size(); ++i) {
    // A provided segment becomes a storage in finish(), around its memory.
    const int8_t device = m->segmentDevices_[i - 1];
    if (device >= 0 && !isProvided(i)) {
      // An empty CUDA storage (prepare() let no other through).
      m->storages_.push_back(
          c10::Storage(
              c10::Storage::use_byte_size_t(),
              0,
              c10::DataPtr(nullptr, c10::Device(c10::kCUDA, device)),
              /*allocator=*/nullptr,
              /*resizable=*/false));
      continue;
    }
    m->storages_.push_back(
        isProvided(i) ? c10::Storage()
                      : allocateSegment(segmentSizes[i], pool));
  }
  return m;
}

c10::intrusive_ptr<rpc::Message> InboundMessage::finish(
    const frame::InboundBuffers& buffers,
    const std::function<uintptr_t(c10::DeviceIndex)>& arrivalStream,
    const DeviceLanding& landing,
    const HostLanding& hostLanding,
    const AdoptLanded& adoptLanded) {
  // With `landing`: the device segments of each device, copied once all
  // are known (one call per device; the copies of many are one launch).
  struct Landing {
    uintptr_t stream = 0;
    std::vector<size_t> segments;
    std::vector<std::pair<uintptr_t, size_t>> spans;
  };
  std::map<c10::DeviceIndex, Landing> landings;
  // First: a failure below still leaves the payload in place (RRefGuard's
  // failRemote() reads a remote call's ids from it).
  adoptPayload(buffers);
  for (const auto& region : buffers.regions) {
    if (auto* failed = dynamic_cast<const frame::FailedRegion*>(region.get())) {
      throw LandingFailure(failed->why()); // before any work is queued
    }
  }
  for (size_t i = 0; i < buffers.regions.size() && i < sizes_.size(); ++i) {
    if (buffers.regions[i] == nullptr) {
      continue;
    }
    if (i == 0) {
      continue; // adoptPayload()
    }
    TORCH_CHECK(!storages_[i - 1], "segment ", i, " was provided twice");
    const int8_t want =
        i - 1 < segmentDevices_.size() ? segmentDevices_[i - 1] : -2;
    auto* onDevice =
        dynamic_cast<frame::DeviceRegion*>(buffers.regions[i].get());
    c10::Device device(c10::kCPU);
    if (onDevice != nullptr) {
      TORCH_CHECK(
          want >= 0 || want == -2,
          "segment ",
          i,
          " holds CPU tensors but arrived in device memory");
      TORCH_CHECK(
          want == -2 || want == onDevice->device(),
          "a tensor for cuda:",
          int(want),
          " arrived in memory of cuda:",
          onDevice->device());
      TORCH_CHECK(
          arrivalStream != nullptr,
          "a CUDA tensor arrived at an agent without devices");
      device = c10::Device(
          c10::kCUDA, static_cast<c10::DeviceIndex>(onDevice->device()));
      if (auto* landed = dynamic_cast<frame::LandedRegion*>(onDevice)) {
        TORCH_CHECK(
            adoptLanded != nullptr,
            "segment ",
            i,
            " arrived in granted landing memory at an agent that grants none");
        c10::DataPtr data = adoptLanded(device.index(), *landed);
        storages_[i - 1] = c10::Storage(
            c10::Storage::use_byte_size_t(),
            static_cast<int64_t>(sizes_[i]),
            std::move(data),
            /*allocator=*/nullptr,
            /*resizable=*/false);
        continue;
      }
      const uintptr_t stream = arrivalStream(device.index());
      try {
        onDevice->waitOn(stream);
      } catch (const LandingFailure&) {
        throw;
      } catch (const std::exception& e) {
        // Our driver's refusal (a broken context), not the peer's doing:
        // this message fails, not the connection.
        throw LandingFailure(
            std::string("waiting for a segment on cuda:") +
            std::to_string(int(device.index())) + " failed: " + e.what());
      }
      if (landing) {
        // The region goes back once `buffers` die, after the copy queued
        // on `stream` (waitOn() recorded that use).
        Landing& l = landings[device.index()];
        l.stream = stream;
        l.segments.push_back(i);
        l.spans.emplace_back(
            reinterpret_cast<uintptr_t>(buffers.provided[i]), sizes_[i]);
        continue;
      }
    } else if (want >= 0) {
      // A CUDA segment a host channel carried (tcp_lanes striping what
      // cuda_staged copied out): copied onto its device, as the host bytes
      // of a {"cpu": d} map are.
      segmentLandings_[i - 1] = want;
    }
    auto* owned = new ProvidedRegion{buffers.regions[i]};
    c10::DataPtr data(buffers.provided[i], owned, &releaseProvided, device);
    storages_[i - 1] = c10::Storage(
        c10::Storage::use_byte_size_t(),
        static_cast<int64_t>(sizes_[i]),
        std::move(data),
        /*allocator=*/nullptr,
        /*resizable=*/false);
  }
  for (auto& [device, l] : landings) {
    Landed landed = landing(device, l.stream, l.spans);
    TORCH_CHECK(
        landed.places.size() == l.segments.size() &&
            landed.sizes.size() == landed.allocations.size(),
        "CUDA landing placed ",
        landed.places.size(),
        " of ",
        l.segments.size(),
        " segments");
    std::vector<c10::Storage> made;
    made.reserve(landed.allocations.size());
    for (size_t a = 0; a < landed.allocations.size(); ++a) {
      made.emplace_back(
          c10::Storage::use_byte_size_t(),
          static_cast<int64_t>(landed.sizes[a]),
          std::move(landed.allocations[a]),
          /*allocator=*/nullptr,
          /*resizable=*/false);
    }
    for (size_t k = 0; k < l.segments.size(); ++k) {
      const size_t i = l.segments[k];
      const auto [a, offset] = landed.places[k];
      TORCH_CHECK(
          a < made.size() && offset % 256 == 0 &&
              offset + sizes_[i] <= landed.sizes[a],
          "CUDA landing placed segment ",
          i,
          " outside its allocation");
      storages_[i - 1] = made[a];
      if (offset != 0 || made[a].nbytes() != sizes_[i]) {
        storageOffsets_.resize(storages_.size(), 0);
        storageOffsets_[i - 1] = offset;
      }
    }
  }
  for (size_t i = 0; i < storages_.size(); ++i) {
    // Only a provided segment (never empty) can lack its storage here.
    TORCH_CHECK(
        storages_[i],
        "segment ",
        i + 1,
        " was announced as provided but never arrived");
  }
  // Host bytes of CUDA tensors ({"cpu": d} maps), copied onto their device.
  std::map<c10::DeviceIndex, std::vector<size_t>> fromHost;
  for (size_t i = 0; i < segmentLandings_.size(); ++i) {
    if (segmentLandings_[i] >= 0) {
      fromHost[segmentLandings_[i]].push_back(i);
    }
  }
  for (const auto& [device, segments] : fromHost) {
    TORCH_CHECK(
        arrivalStream != nullptr && hostLanding != nullptr,
        "host bytes of a tensor for cuda:",
        int(device),
        " arrived at an agent without devices");
    std::vector<c10::Storage> hosts;
    hosts.reserve(segments.size());
    for (size_t i : segments) {
      hosts.push_back(storages_[i]);
    }
    std::vector<c10::DataPtr> landed =
        hostLanding(device, arrivalStream(device), hosts);
    TORCH_CHECK(
        landed.size() == segments.size(),
        "CUDA landing returned ",
        landed.size(),
        " allocations for ",
        segments.size(),
        " host segments");
    for (size_t k = 0; k < landed.size(); ++k) {
      storages_[segments[k]] = c10::Storage(
          c10::Storage::use_byte_size_t(),
          static_cast<int64_t>(hosts[k].nbytes()),
          std::move(landed[k]),
          /*allocator=*/nullptr,
          /*resizable=*/false);
    }
  }
  std::vector<at::Tensor> tensors;
  tensors.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    if (t.quantized) {
      tensors.push_back(buildQuantized(t, storages_, storageOffsets_));
      continue;
    }
    if (!t.sparse) {
      tensors.push_back(buildDense(t.dense, storages_, storageOffsets_));
      continue;
    }
    at::Tensor indices = buildDense(t.indices, storages_, storageOffsets_);
    if (indices.is_cpu()) {
      // Landed in host memory the peer may still write (a slab it lent):
      // checked there, they could change after the check. Ours first.
      indices = indices.clone();
    }
    at::Tensor values = buildDense(t.dense, storages_, storageOffsets_);
    // Reject out-of-range indices here: a sparse tensor with bad indices
    // would crash the process later, far from the cause. A tensor announced
    // coalesced must be (sorted, no duplicates): kernels that trust the bit
    // give wrong sums otherwise.
    at::_validate_sparse_coo_tensor_args(
        indices,
        values,
        t.sparseSizes,
        t.coalesced ? std::optional<bool>(true) : std::nullopt);
    at::Tensor sparse =
        at::_sparse_coo_tensor_unsafe(indices, values, t.sparseSizes)
            ._coalesced_(t.coalesced);
    if (t.requiresGrad) {
      sparse.requires_grad_(true);
    }
    tensors.push_back(sparse);
  }
  return c10::make_intrusive<rpc::Message>(
      std::move(payload_), std::move(tensors), type_, id_);
}

} // namespace torch_rpc_ext::wire
