// SPDX-License-Identifier: BSD-3-Clause
// The encoding half of the message codec (codec.h); inbound.cpp decodes.
#include "csrc/wire/codec.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "csrc/wire/head.h"
#include "csrc/wire/storage_reach.h"

namespace torch_rpc_ext::wire {

static_assert(
    kMaxHeadBytes == frame::FrameLimits{}.maxHeadBytes,
    "the head's limit is the frame's");
static_assert(
    kMaxStorages + 1 == frame::FrameLimits{}.maxSegments,
    "a storage per segment, less the payload's");

namespace {

using namespace detail;

// Views smaller than this are always sent with their span.
constexpr int64_t kCompactMinBytes = 64 * 1024;

// Keeps what a frame points into alive until the transport is done.
struct OutboundHold {
  c10::intrusive_ptr<rpc::Message> message;
  std::vector<at::Tensor> compacted;
};

// Collects strided tensors, deduplicating storages and tracking each
// storage's used byte span.
class StoragePlan {
 public:
  StoragePlan(OutboundHold& hold, const DeviceRoute* route, bool request)
      : hold_(hold), route_(route), request_(request) {}

  // The host copies of the message's CUDA tensors that the map sends to the
  // peer's CPU, made at once (one copy per storage, one wait per stream).
  void copyToHost(const std::vector<at::Tensor>& tensors) {
    if (route_ == nullptr || !route_->toHost) {
      return;
    }
    std::vector<at::Tensor> wanted;
    for (const auto& t : tensors) {
      if (t.layout() != at::kStrided || !t.is_cuda()) {
        continue;
      }
      auto to = route_->map.find(t.device());
      if (to != route_->map.end() && to->second.is_cpu()) {
        wanted.push_back(t);
      }
    }
    if (wanted.empty()) {
      return;
    }
    std::vector<at::Tensor> copies = route_->toHost(wanted);
    for (size_t i = 0; i < wanted.size(); ++i) {
      hosted_.emplace(wanted[i].unsafeGetTensorImpl(), std::move(copies[i]));
    }
  }

  // A tensor made for the message (nothing else holds it): held with the
  // frame until it is written.
  at::Tensor admitMade(at::Tensor t) {
    hold_.compacted.push_back(t);
    return admit(std::move(t), false, false);
  }

  // A tensor that can be sent as is: compact it first if its span would
  // waste more than half the bytes on the wire. `exclusive`: the message is
  // the tensor's only holder (reachableOnlyThrough, checked by the caller
  // before it took its own references).
  at::Tensor admit(at::Tensor t, bool exclusive = false, bool mapCpu = true) {
    // The peer's CUDA device of the tensor's bytes: >= 0 through a device
    // channel, hostToDevice(d) as host bytes landed there; -1: CPU.
    int8_t target = -1;
    if (t.is_cuda()) {
      TORCH_CHECK(
          route_ != nullptr && route_->map.count(t.device()) != 0,
          unmappedDeviceError(
              t.device(), route_ ? route_->peer : std::string(), request_));
      c10::Device to = route_->map.at(t.device());
      if (to.is_cpu()) {
        // Mapped to the peer's CPU: a host copy travels (TensorPipe's
        // cuda_basic does the same copy, in its channel).
        auto hosted = hosted_.find(t.unsafeGetTensorImpl());
        TORCH_CHECK(
            hosted != hosted_.end(),
            "no host copy of a CUDA tensor mapped to cpu");
        t = hosted->second;
        hold_.compacted.push_back(t);
        exclusive = false;
      } else {
        TORCH_CHECK(
            to.is_cuda(),
            "TORCH_RPC_EXT maps ",
            t.device(),
            " to ",
            to,
            ": a CUDA tensor lands on a CUDA device or the CPU");
        target = static_cast<int8_t>(to.index());
      }
    } else {
      TORCH_CHECK(
          t.device().is_cpu(),
          "TORCH_RPC_EXT sends CPU and CUDA tensors, got a tensor on ",
          t.device(),
          "; move it to CPU before sending it over RPC");
      auto it = route_ != nullptr && mapCpu
          ? route_->map.find(c10::Device(c10::kCPU))
          : decltype(route_->map)::const_iterator();
      if (route_ != nullptr && mapCpu && it != route_->map.end() &&
          it->second.is_cuda()) {
        // {"cpu": d}: the bytes travel as any CPU tensor's; the receiver
        // copies them onto its cuda:d.
        TORCH_CHECK(
            it->second.index() >= 0 && it->second.index() <= kMaxHostToDevice,
            "TORCH_RPC_EXT maps cpu to ",
            it->second,
            ": CPU tensors land on cuda:0 to cuda:",
            int(kMaxHostToDevice),
            " only");
        target = hostToDevice(static_cast<int8_t>(it->second.index()));
      }
    }
    TORCH_CHECK(
        t.layout() == at::kStrided,
        "TORCH_RPC_EXT cannot send tensors of layout ",
        t.layout());
    if (t.is_conj() || t.is_neg()) {
      // A lazy conjugate or negation (x.conj(), x.mH, x.conj().imag) is a
      // bit on the tensor, not in its bytes: the head carries no such bit,
      // so the values go resolved (the peer gets conj(x), not x), as
      // upstream's pickled tensors arrive equal.
      t = t.resolve_conj().resolve_neg();
      hold_.compacted.push_back(t);
      exclusive = false;
    }
    TORCH_CHECK(
        !t.is_quantized() && !c10::isQIntType(t.scalar_type()),
        "TORCH_RPC_EXT sends quantized tensors as tensors of their own "
        "only, not as a sparse tensor's values");
    TORCH_CHECK(t.dim() <= int64_t(kMaxDims), "tensor has too many dims");
    int64_t own = static_cast<int64_t>(t.numel() * t.element_size());
    int64_t span = extentBytes(t);
    // A CUDA view is packed as it is copied, at no cost of its own: past an
    // eighth of its span unused; a CPU one is cloned first: past half.
    const int64_t waste = t.is_cuda() ? own / 8 : own;
    if (span > own + waste && span >= kCompactMinBytes) {
      if (t.is_cuda()) {
        // A segment of its own, packed by the device channel as it copies
        // (no clone on the caller's stream): it arrives contiguous.
        if (packed_.emplace(t.unsafeGetTensorImpl(), Packed{t, 0, target})
                .second) {
          packedOrder_.push_back(t.unsafeGetTensorImpl());
        }
        return t;
      }
      t = t.contiguous(at::MemoryFormat::Contiguous).clone();
      hold_.compacted.push_back(t);
    }
    auto* impl = t.storage().unsafeGetStorageImpl();
    int64_t lo = t.storage_offset() * int64_t(t.element_size());
    int64_t hi = lo + extentBytes(t);
    if (Span* seen = findSpan(impl)) {
      seen->lo = std::min(seen->lo, lo);
      seen->hi = std::max(seen->hi, hi);
      // A storage two tensors share: exclusive only if a single tensor held it.
      seen->exclusive = false;
    } else {
      addSpan(impl, Span{lo, hi, t.storage(), 0, exclusive, target});
    }
    tensors_.push_back(t);
    return t;
  }

  // Finalise spans; must run after every admit() and before describe().
  void seal(frame::OutboundFrame& frame) {
    for (const auto& t : tensors_) {
      auto& s = spanOf(t.storage().unsafeGetStorageImpl());
      int64_t off = t.storage_offset() * int64_t(t.element_size());
      // Every tensor's offset must stay a whole number of elements.
      if ((off - s.lo) % int64_t(t.element_size()) != 0) {
        s.lo = 0;
      }
    }
    for (auto& [impl, s] : spans_) { // (in the order admitted)
      s.segment = static_cast<uint32_t>(frame.segments.size());
      const char* base = static_cast<const char*>(s.storage.data());
      frame::OutboundFrame::Segment seg{
          base == nullptr ? nullptr : base + s.lo, size_t(s.hi - s.lo)};
      seg.origin = regionOf(s.storage);
      seg.exclusive = seg.origin != nullptr && s.exclusive;
      if (s.target >= 0) { // (a CPU storage mapped to a GPU rides as CPU)
        const c10::Device device = s.storage.device();
        seg.device = static_cast<uint8_t>(c10::DeviceType::CUDA);
        seg.deviceIndex = device.index();
        seg.stream = route_->readyStream(device);
        seg.peerDevice = static_cast<int16_t>(s.target);
      }
      frame.segments.push_back(std::move(seg));
    }
    for (auto* impl : packedOrder_) {
      auto& p = packed_.at(impl);
      const at::Tensor& t = p.tensor;
      p.segment = static_cast<uint32_t>(frame.segments.size());
      auto view = std::make_shared<frame::StridedView>();
      view->sizes.assign(t.sizes().begin(), t.sizes().end());
      view->strides.assign(t.strides().begin(), t.strides().end());
      view->elementSize = static_cast<uint64_t>(t.element_size());
      frame::OutboundFrame::Segment seg{
          t.data_ptr(), size_t(t.numel() * t.element_size())};
      // A received storage read by the copy stays its owner's until then.
      seg.origin = regionOf(t.storage());
      const c10::Device device = t.device();
      seg.device = static_cast<uint8_t>(c10::DeviceType::CUDA);
      seg.deviceIndex = device.index();
      seg.stream = route_->readyStream(device);
      seg.peerDevice = static_cast<int16_t>(p.target);
      seg.view = std::move(view);
      frame.segments.push_back(std::move(seg));
    }
  }

  void describe(HeadWriter& w, const at::Tensor& t) const {
    auto packed = packed_.find(t.unsafeGetTensorImpl());
    if (packed != packed_.end()) {
      // Contiguous, at the start of a segment of its own.
      w.put<uint8_t>(static_cast<uint8_t>(t.scalar_type()));
      w.put<uint8_t>(t.requires_grad() ? 1 : 0);
      w.put<uint8_t>(static_cast<uint8_t>(t.dim()));
      for (int64_t d = 0; d < t.dim(); ++d) {
        w.put<int64_t>(t.size(d));
      }
      int64_t stride = 1;
      std::vector<int64_t> strides(t.dim());
      for (int64_t d = t.dim() - 1; d >= 0; --d) {
        strides[d] = stride;
        stride *= std::max<int64_t>(t.size(d), 1);
      }
      for (int64_t d = 0; d < t.dim(); ++d) {
        w.put<int64_t>(strides[d]);
      }
      w.put<int64_t>(0);
      w.put<uint32_t>(packed->second.segment);
      w.put<int8_t>(packed->second.target);
      return;
    }
    const auto& s = spanOf(t.storage().unsafeGetStorageImpl());
    w.put<uint8_t>(static_cast<uint8_t>(t.scalar_type()));
    w.put<uint8_t>(t.requires_grad() ? 1 : 0);
    w.put<uint8_t>(static_cast<uint8_t>(t.dim()));
    for (int64_t d = 0; d < t.dim(); ++d) {
      w.put<int64_t>(t.size(d));
    }
    for (int64_t d = 0; d < t.dim(); ++d) {
      w.put<int64_t>(t.stride(d));
    }
    int64_t off = t.storage_offset() * int64_t(t.element_size()) - s.lo;
    w.put<int64_t>(off / int64_t(t.element_size()));
    w.put<uint32_t>(s.segment);
    w.put<int8_t>(s.target);
  }

 private:
  struct Span {
    int64_t lo;
    int64_t hi;
    c10::Storage storage;
    uint32_t segment = 0;
    bool exclusive = false;
    int8_t target = -1; // the peer's CUDA device, or -1: CPU
  };
  // A CUDA view sent packed (admit()): its segment, its peer device.
  struct Packed {
    at::Tensor tensor;
    uint32_t segment = 0;
    int8_t target = -1;
  };
  OutboundHold& hold_;
  const DeviceRoute* route_;
  const bool request_; // for errors: TensorPipe's words differ
  std::unordered_map<c10::TensorImpl*, at::Tensor> hosted_; // copyToHost()
  std::unordered_map<c10::TensorImpl*, Packed> packed_;
  std::vector<c10::TensorImpl*> packedOrder_;
  // A message's storages in the order admitted, found by a look through a
  // few, by an index past kLinearSpans (built then): a small message makes
  // no allocation for them.
  static constexpr size_t kLinearSpans = 8;
  const Span* findSpan(c10::StorageImpl* impl) const {
    if (spanIndex_.empty()) {
      for (const auto& [k, s] : spans_) {
        if (k == impl) {
          return &s;
        }
      }
      return nullptr;
    }
    auto it = spanIndex_.find(impl);
    return it == spanIndex_.end() ? nullptr : &spans_[it->second].second;
  }
  Span* findSpan(c10::StorageImpl* impl) {
    return const_cast<Span*>(std::as_const(*this).findSpan(impl));
  }
  const Span& spanOf(c10::StorageImpl* impl) const {
    const Span* s = findSpan(impl);
    TORCH_INTERNAL_ASSERT(s != nullptr, "a tensor's storage was not admitted");
    return *s;
  }
  Span& spanOf(c10::StorageImpl* impl) {
    return const_cast<Span&>(std::as_const(*this).spanOf(impl));
  }
  void addSpan(c10::StorageImpl* impl, Span span) {
    spans_.emplace_back(impl, std::move(span));
    if (spanIndex_.empty() && spans_.size() > kLinearSpans) {
      for (size_t i = 0; i < spans_.size(); ++i) {
        spanIndex_.emplace(spans_[i].first, i);
      }
    } else if (!spanIndex_.empty()) {
      spanIndex_.emplace(impl, spans_.size() - 1);
    }
  }
  c10::SmallVector<std::pair<c10::StorageImpl*, Span>, 4> spans_;
  std::unordered_map<c10::StorageImpl*, size_t> spanIndex_;
  c10::SmallVector<at::Tensor, 4> tensors_;
};

// A message tensor as the head describes it.
struct Entry {
  uint8_t layout; // kLayout*
  at::Tensor dense; // tensor, or values, or a quantized one's integers
  at::Tensor indices; // sparse: its indices; quantized: per-channel scales
  at::Tensor original;
  at::Tensor zeroPoints; // quantized per channel
};

// A quantized tensor travels as its integers (int_repr(), a copy: quantized
// tensors are made anew on the receiver, which copies them too) with its
// quantizer's parameters, as torch's pickler keeps them: per tensor a scale
// and a zero point, per channel an axis and two tensors of them. CPU only,
// 8- and 32-bit ones (4x2 and 2x4 pack two or four values per byte).
Entry admitQuantized(StoragePlan& plan, const at::Tensor& t) {
  TORCH_CHECK(
      t.device().is_cpu(),
      "TORCH_RPC_EXT sends quantized tensors from CPU only, got one on ",
      t.device());
  const auto dtype = t.scalar_type();
  TORCH_CHECK(
      dtype == at::kQInt8 || dtype == at::kQUInt8 || dtype == at::kQInt32,
      "TORCH_RPC_EXT cannot send quantized tensors of dtype ",
      dtype,
      " (qint8, quint8 and qint32 it can)");
  const auto scheme = t.qscheme();
  Entry e{kLayoutQuantized, plan.admitMade(t.int_repr()), {}, t, {}};
  if (scheme == at::kPerTensorAffine) {
    return e;
  }
  TORCH_CHECK(
      scheme == at::kPerChannelAffine ||
          scheme == at::kPerChannelAffineFloatQParams,
      "TORCH_RPC_EXT cannot send quantized tensors of scheme ",
      c10::toString(scheme));
  // Copies: the quantizer's own tensors could also be among the message's
  // (a span they share would take that tensor's device route).
  at::Tensor scales =
      t.q_per_channel_scales().clone(at::MemoryFormat::Contiguous);
  at::Tensor zeroPoints =
      t.q_per_channel_zero_points().clone(at::MemoryFormat::Contiguous);
  const int64_t axis = t.q_per_channel_axis();
  // What the receiver checks (inbound_tensors.cpp), checked here: one made
  // with parameters torch took unchecked fails its own call, not the
  // connection.
  TORCH_CHECK(
      axis >= 0 && axis < t.dim() && scales.dim() == 1 &&
          zeroPoints.dim() == 1 && scales.numel() == t.size(axis) &&
          zeroPoints.numel() == t.size(axis),
      "TORCH_RPC_EXT cannot send a quantized tensor whose per-channel "
      "parameters do not fit it (axis ",
      axis,
      " of ",
      t.dim(),
      " dims, ",
      scales.numel(),
      " scales and ",
      zeroPoints.numel(),
      " zero points)");
  e.indices = plan.admitMade(std::move(scales));
  e.zeroPoints = plan.admitMade(std::move(zeroPoints));
  return e;
}

} // namespace

int64_t extentBytes(const at::Tensor& t) {
  if (t.numel() == 0) {
    return 0;
  }
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  return (last + 1) * static_cast<int64_t>(t.element_size());
}

std::string unmappedDeviceError(
    const c10::Device& device,
    const std::string& peer,
    bool request) {
  std::string to = peer.empty() ? std::string() : " to " + peer;
  return c10::str(
      "TORCH_RPC_EXT cannot send a tensor on ",
      device,
      to,
      ": no device map names ",
      device,
      " (set one with RpcExtBackendOptions.set_device_map, or move the "
      "tensor to CPU before sending it). In TensorPipe's words: TensorPipe "
      "RPC backend only supports CPU tensors by default, please move your "
      "tensors to CPU before sending them over RPC, or call "
      "`set_device_map` on `TensorPipeRpcBackendOptions` to explicitly "
      "configure device mapping. ",
      request ? "Request" : "Response",
      " device mapping is not available for destination ",
      peer.empty() ? std::string("this worker") : peer);
}

bool isTraceparent(const std::string& s) {
  // version "00": 2-32-16-2 hex digits, lowercase, ids not all zero.
  if (s.size() != 55 || s.compare(0, 3, "00-") != 0 || s[35] != '-' ||
      s[52] != '-') {
    return false;
  }
  auto hex = [&](size_t from, size_t n) {
    bool nonzero = false;
    for (size_t i = from; i < from + n; ++i) {
      const char c = s[i];
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
        return 0;
      }
      nonzero = nonzero || c != '0';
    }
    return nonzero ? 2 : 1;
  };
  return hex(3, 32) == 2 && hex(36, 16) == 2 && hex(53, 2) != 0;
}

frame::OutboundFrame encodeMessage(
    const c10::intrusive_ptr<rpc::Message>& message,
    int64_t id,
    const DeviceRoute* route,
    const std::string& trace) {
  auto hold = std::make_shared<OutboundHold>();
  hold->message = message;
  StoragePlan plan(*hold, route, message->isRequest());
  plan.copyToHost(message->tensors());

  c10::SmallVector<Entry, 4> entries;
  entries.reserve(message->tensors().size());
  // The head's bytes, bounded (a sparse or quantized tensor writes three
  // tensors' worth).
  size_t headBound = 32 + trace.size();
  for (const auto& t : message->tensors()) {
    headBound += 3 * (24 + 16 * size_t(t.dim()));
  }
  for (const auto& t : message->tensors()) {
    if (t.layout() == at::kSparse) {
      // (Its dims go in a byte; the peer takes at most kMaxDims.)
      TORCH_CHECK(
          t.dim() <= int64_t(kMaxDims),
          "TORCH_RPC_EXT cannot send a sparse tensor of ",
          t.dim(),
          " dims: at most ",
          int(kMaxDims));
      TORCH_CHECK(
          t.device().is_cpu(),
          "TORCH_RPC_EXT sends sparse tensors from CPU only, got one on ",
          t.device());
      TORCH_CHECK(
          route == nullptr || route->map.count(c10::Device(c10::kCPU)) == 0 ||
              route->map.at(c10::Device(c10::kCPU)).is_cpu(),
          "TORCH_RPC_EXT sends sparse tensors to a peer's CPU only, but the "
          "device map to ",
          route ? route->peer : std::string(),
          " sends CPU tensors to ",
          route ? route->map.at(c10::Device(c10::kCPU))
                : c10::Device(c10::kCPU),
          ": densify it, or send it to a worker with no such map");
      at::Tensor indices = plan.admit(t._indices(), false, false);
      at::Tensor values = plan.admit(t._values().detach(), false, false);
      entries.push_back({kLayoutSparseCoo, values, indices, t, {}});
    } else if (t.is_quantized()) {
      entries.push_back(admitQuantized(plan, t));
    } else {
      // (Before the storage is looked at: these have none to show.)
      TORCH_CHECK(
          !t.is_nested(),
          "TORCH_RPC_EXT cannot send nested tensors (send their components: "
          "t.unbind())");
      TORCH_CHECK(
          t.layout() == at::kStrided,
          "TORCH_RPC_EXT cannot send tensors of layout ",
          t.layout(),
          " (strided and sparse COO ones it can: t.to_dense() or "
          "t.to_sparse())");
      // Only a provided storage can be handed back: skip the check (atomics
      // and a look at the Python wrapper) for every other tensor.
      bool exclusive =
          viewsProvidedMemory(t.storage()) && reachableOnlyThrough(t);
      entries.push_back(
          {kLayoutStrided, plan.admit(t, exclusive), at::Tensor(), t, {}});
    }
  }

  frame::OutboundFrame frame;
  frame.kind = frame::FrameKind::kMessage;
  frame.segments.reserve(1 + entries.size());
  const auto& payload = message->payload();
  frame.segments.push_back({payload.data(), payload.size()});
  plan.seal(frame);

  HeadWriter w;
  w.out.reserve(headBound);
  const bool traced = !trace.empty() && trace.size() <= kMaxTraceContext;
  w.put<uint32_t>(
      static_cast<uint32_t>(message->type()) | (traced ? kTraceFlag : 0));
  w.put<int64_t>(id);
  w.put<uint32_t>(static_cast<uint32_t>(entries.size()));
  for (const auto& e : entries) {
    if (e.layout == kLayoutStrided) {
      w.put<uint8_t>(kLayoutStrided);
      plan.describe(w, e.dense);
      continue;
    }
    if (e.layout == kLayoutQuantized) {
      const at::Tensor& q = e.original;
      w.put<uint8_t>(kLayoutQuantized);
      w.put<uint8_t>(static_cast<uint8_t>(q.scalar_type()));
      w.put<uint8_t>(static_cast<uint8_t>(q.qscheme()));
      if (q.qscheme() == at::kPerTensorAffine) {
        w.put<double>(q.q_scale());
        w.put<int64_t>(q.q_zero_point());
      } else {
        w.put<uint8_t>(static_cast<uint8_t>(q.q_per_channel_axis()));
        plan.describe(w, e.indices);
        plan.describe(w, e.zeroPoints);
      }
      plan.describe(w, e.dense);
      continue;
    }
    w.put<uint8_t>(kLayoutSparseCoo);
    w.put<uint8_t>(e.original.requires_grad() ? 1 : 0);
    w.put<uint8_t>(e.original.is_coalesced() ? 1 : 0);
    w.put<uint8_t>(static_cast<uint8_t>(e.original.dim()));
    for (int64_t d = 0; d < e.original.dim(); ++d) {
      w.put<int64_t>(e.original.size(d));
    }
    plan.describe(w, e.indices);
    plan.describe(w, e.dense);
  }
  if (traced) {
    w.put<uint8_t>(static_cast<uint8_t>(trace.size()));
    w.out += trace;
  }
  frame.head = std::move(w.out);
  frame.keepAlive = hold;
  return frame;
}

} // namespace torch_rpc_ext::wire
