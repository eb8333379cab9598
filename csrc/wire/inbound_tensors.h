// SPDX-License-Identifier: BSD-3-Clause
#pragma once
// A message head's tensor entries, read and made into tensors
// (inbound_tensors.cpp): the parts of InboundMessage's decoding that look
// at one tensor. Internal to wire/.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include "csrc/wire/codec.h"
#include "csrc/wire/head.h"

namespace torch_rpc_ext::wire::detail {

// A dense entry, checked: a known dtype, sizes and strides whose span lies
// inside its segment (overflow-checked). Throws std::invalid_argument.
InboundMessage::DenseMeta readDense(
    HeadReader& r,
    const std::vector<uint64_t>& segmentSizes);

// Whether `m` describes more elements than its segment holds. Zero strides
// let a few bytes stand for any number of elements: fine for a dense tensor
// (a broadcast view costs nothing to receive), not for sparse indices, which
// finish() reads one by one to validate them.
bool moreElementsThanSegment(
    const InboundMessage::DenseMeta& m,
    const std::vector<uint64_t>& segmentSizes);

// A quantized entry after its layout byte (codec.cpp, admitQuantized) into
// `t`, checked as far as the head tells.
void readQuantized(
    HeadReader& r,
    const std::vector<uint64_t>& segmentSizes,
    InboundMessage::TensorMeta& t);

// The tensor `m` describes, viewing its segment's storage.
at::Tensor buildDense(
    const InboundMessage::DenseMeta& m,
    const std::vector<c10::Storage>& storages,
    const std::vector<uint64_t>& storageOffsets);

// The quantized tensor `t` describes, made from its integers.
at::Tensor buildQuantized(
    const InboundMessage::TensorMeta& t,
    const std::vector<c10::Storage>& storages,
    const std::vector<uint64_t>& storageOffsets);

} // namespace torch_rpc_ext::wire::detail
