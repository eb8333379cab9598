// SPDX-License-Identifier: BSD-3-Clause
// A message head's tensor entries (codec.h, InboundMessage): read and
// checked as far as the head tells, then made into tensors over the landed
// segments.
#include "csrc/wire/inbound_tensors.h"

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

#include <limits>
#include <stdexcept>

namespace torch_rpc_ext::wire::detail {

InboundMessage::DenseMeta readDense(
    HeadReader& r,
    const std::vector<uint64_t>& segmentSizes) {
  InboundMessage::DenseMeta m;
  auto dtype = r.get<uint8_t>("dtype");
  if (dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions)) {
    throw std::invalid_argument("unknown dtype " + std::to_string(dtype));
  }
  m.dtype = static_cast<c10::ScalarType>(dtype);
  if (c10::isQIntType(m.dtype) || m.dtype == c10::ScalarType::Undefined) {
    throw std::invalid_argument("unsupported dtype " + std::to_string(dtype));
  }
  m.requiresGrad = r.get<uint8_t>("requires_grad") != 0;
  if (m.requiresGrad &&
      !(c10::isFloatingType(m.dtype) || c10::isComplexType(m.dtype))) {
    throw std::invalid_argument("requires_grad on a non-floating dtype");
  }
  size_t ndim = r.get<uint8_t>("ndim");
  if (ndim > kMaxDims) {
    throw std::invalid_argument("too many dims: " + std::to_string(ndim));
  }
  m.sizes.resize(ndim);
  m.strides.resize(ndim);
  for (auto& s : m.sizes) {
    s = r.get<int64_t>("size");
  }
  for (auto& s : m.strides) {
    s = r.get<int64_t>("stride");
  }
  m.offset = r.get<int64_t>("offset");
  m.segment = r.get<uint32_t>("segment");
  const int8_t device = r.get<int8_t>("device");
  // hostToDevice(d) (head.h): host bytes that land on CUDA device d.
  m.hostCarried = device <= -2;
  m.device = m.hostCarried ? static_cast<int8_t>(-2 - device) : device;
  if (m.segment == 0 || m.segment >= segmentSizes.size()) {
    throw std::invalid_argument(
        "tensor refers to segment " + std::to_string(m.segment) + " of " +
        std::to_string(segmentSizes.size()));
  }
  // The span this tensor touches must lie inside its segment; check with
  // overflow-safe arithmetic.
  const int64_t kMax = std::numeric_limits<int64_t>::max() / 2;
  int64_t item = static_cast<int64_t>(c10::elementSize(m.dtype));
  if (m.offset < 0 || m.offset > kMax / item) {
    throw std::invalid_argument("bad storage offset");
  }
  bool empty = false;
  int64_t last = 0;
  for (size_t d = 0; d < ndim; ++d) {
    if (m.sizes[d] < 0 || m.strides[d] < 0 || m.sizes[d] > kMax ||
        m.strides[d] > kMax) {
      throw std::invalid_argument("negative or huge size/stride");
    }
    if (m.sizes[d] == 0) {
      empty = true;
      continue;
    }
    if (m.strides[d] != 0 && (m.sizes[d] - 1) > (kMax - last) / m.strides[d]) {
      throw std::invalid_argument("tensor extent overflows");
    }
    last += (m.sizes[d] - 1) * m.strides[d];
  }
  if (!empty) {
    if (last > kMax / item - m.offset - 1) {
      throw std::invalid_argument("tensor extent overflows");
    }
    uint64_t end = uint64_t(m.offset + last + 1) * uint64_t(item);
    if (end > segmentSizes[m.segment]) {
      throw std::invalid_argument(
          "tensor needs " + std::to_string(end) +
          " bytes but its segment has " +
          std::to_string(segmentSizes[m.segment]));
    }
  }
  return m;
}

bool moreElementsThanSegment(
    const InboundMessage::DenseMeta& m,
    const std::vector<uint64_t>& segmentSizes) {
  for (int64_t s : m.sizes) {
    if (s == 0) {
      return false;
    }
  }
  uint64_t room = segmentSizes[m.segment] / c10::elementSize(m.dtype);
  uint64_t n = 1;
  for (int64_t s : m.sizes) {
    if (uint64_t(s) > room / n) {
      return true;
    }
    n *= uint64_t(s);
  }
  return false;
}

at::Tensor buildDense(
    const InboundMessage::DenseMeta& m,
    const std::vector<c10::Storage>& storages,
    const std::vector<uint64_t>& storageOffsets) {
  // A view of the segment's storage, made directly as torch's empty()
  // makes a tensor (at::detail::empty_generic): at::empty() then set_()
  // went through the dispatcher twice and allocated a buffer only to drop
  // it (a sixth of a transport loop's time reading pipelined responses:
  // docs/performance.md). readDense() has already checked that the span
  // lies inside the segment, as set_() would.
  int64_t offset = m.offset;
  if (m.device >= 0 && !storageOffsets.empty()) {
    // A segment landed in a shared device storage starts at its offset
    // there (a multiple of 256 bytes: whole elements of any dtype).
    offset += static_cast<int64_t>(storageOffsets.at(m.segment - 1)) /
        static_cast<int64_t>(c10::elementSize(m.dtype));
  }
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storages.at(m.segment - 1)),
      c10::DispatchKeySet(
          m.device >= 0 ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU),
      caffe2::TypeMeta::fromScalarType(m.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(m.sizes, m.strides, offset);
  if (m.requiresGrad) {
    t.requires_grad_(true);
  }
  return t;
}

// A quantized tensor's head after its layout byte (codec.cpp,
// admitQuantized): its dtype and scheme, the scheme's parameters, its
// integers. Checked here as far as the head tells: torch's constructors
// trust them (a per-channel tensor with fewer scales than channels would
// be read past their end).
void readQuantized(
    HeadReader& r,
    const std::vector<uint64_t>& segmentSizes,
    InboundMessage::TensorMeta& t) {
  t.quantized = true;
  const uint8_t dtype = r.get<uint8_t>("quantized dtype");
  t.qdtype = static_cast<c10::ScalarType>(dtype);
  c10::ScalarType integers;
  if (dtype == static_cast<uint8_t>(c10::ScalarType::QInt8)) {
    integers = c10::ScalarType::Char;
  } else if (dtype == static_cast<uint8_t>(c10::ScalarType::QUInt8)) {
    integers = c10::ScalarType::Byte;
  } else if (dtype == static_cast<uint8_t>(c10::ScalarType::QInt32)) {
    integers = c10::ScalarType::Int;
  } else {
    throw std::invalid_argument(
        "unknown quantized dtype " + std::to_string(dtype));
  }
  const uint8_t scheme = r.get<uint8_t>("qscheme");
  t.qscheme = static_cast<c10::QScheme>(scheme);
  const bool perChannel =
      scheme == static_cast<uint8_t>(c10::kPerChannelAffine) ||
      scheme == static_cast<uint8_t>(c10::kPerChannelAffineFloatQParams);
  if (scheme == static_cast<uint8_t>(c10::kPerTensorAffine)) {
    t.scale = r.get<double>("scale");
    t.zeroPoint = r.get<int64_t>("zero point");
  } else if (perChannel) {
    t.axis = r.get<uint8_t>("axis");
    t.indices = readDense(r, segmentSizes);
    t.zeroPoints = readDense(r, segmentSizes);
  } else {
    throw std::invalid_argument("unknown qscheme " + std::to_string(scheme));
  }
  t.dense = readDense(r, segmentSizes);
  if (t.dense.dtype != integers || t.dense.requiresGrad) {
    throw std::invalid_argument(
        "a quantized tensor's integers are not of its dtype");
  }
  // Torch's constructors copy every element: zero strides must not let a
  // few bytes stand for gigabytes (our sender's are contiguous).
  for (const InboundMessage::DenseMeta* d :
       {&t.dense, &t.indices, &t.zeroPoints}) {
    if ((d == &t.dense || perChannel) &&
        moreElementsThanSegment(*d, segmentSizes)) {
      throw std::invalid_argument(
          "a quantized tensor has more elements than its segment holds");
    }
  }
  if (!perChannel) {
    return;
  }
  const bool floatParams = t.qscheme == c10::kPerChannelAffineFloatQParams;
  if (t.indices.requiresGrad || t.zeroPoints.requiresGrad ||
      t.axis >= static_cast<int64_t>(t.dense.sizes.size()) ||
      t.indices.sizes.size() != 1 || t.zeroPoints.sizes.size() != 1 ||
      t.indices.sizes[0] != t.dense.sizes[t.axis] ||
      t.zeroPoints.sizes[0] != t.dense.sizes[t.axis] ||
      t.indices.dtype !=
          (floatParams ? c10::ScalarType::Float : c10::ScalarType::Double) ||
      t.zeroPoints.dtype !=
          (floatParams ? c10::ScalarType::Float : c10::ScalarType::Long)) {
    throw std::invalid_argument(
        "a quantized tensor's per-channel parameters do not fit it");
  }
}

// The quantized tensor `t` describes, made from its integers (a copy, which
// also leaves memory the peer lent: a slab).
at::Tensor buildQuantized(
    const InboundMessage::TensorMeta& t,
    const std::vector<c10::Storage>& storages,
    const std::vector<uint64_t>& storageOffsets) {
  at::Tensor integers = buildDense(t.dense, storages, storageOffsets);
  if (t.qscheme == c10::kPerTensorAffine) {
    return at::_make_per_tensor_quantized_tensor(
        integers, t.scale, t.zeroPoint);
  }
  // Copies too: the quantizer keeps its parameters, and reads them as
  // contiguous arrays (a broadcast view would be read past its end).
  return at::_make_per_channel_quantized_tensor(
      integers,
      buildDense(t.indices, storages, storageOffsets)
          .clone(at::MemoryFormat::Contiguous),
      buildDense(t.zeroPoints, storages, storageOffsets)
          .clone(at::MemoryFormat::Contiguous),
      t.axis);
}

} // namespace torch_rpc_ext::wire::detail
