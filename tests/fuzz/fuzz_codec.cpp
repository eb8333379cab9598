// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes the message decoder, wire::InboundMessage (csrc/wire/codec.h): the
// parser of every message head an authenticated peer sends, which turns it
// into an rpc::Message with tensors viewing the received segments. The
// harness plays the transport as csrc/transport/tcp does: it announces the
// segment sizes (some of them "provided", i.e. shared slabs, which the
// transport hands over as regions of exactly the announced size), lets
// prepare() check the head, fills the buffers it returns, and calls finish().
//
// Input: uint8 segment count (mod 17); per segment uint8 flags (bit 0:
// provided, bit 1: pool-sized, i.e. BufferPool::kMinPooledBytes more) and
// uint16 size; uint8 (bit 0: receive with a BufferPool); uint16 head length
// and the head; the rest is repeated over the segments' bytes in order
// (so a real frame's segments, concatenated, come back byte for byte).
//
// A finding: a sanitizer report; an exception other than std::exception
// (the transport catches std::exception and closes the connection); a
// message whose type, id or payload differ from what was sent; a tensor
// (dense, or a sparse tensor's indices or values) that reaches outside its
// storage; a sparse tensor with an index outside its size, with more
// indices than its indices' segment holds (validating them would take time
// unbounded by the frame; found as a timeout first), or one that crashes
// (rather than raises) when densified; a timeout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "csrc/common/buffer_pool.h"
#include "csrc/wire/codec.h"
#include "tests/fuzz/fuzz_input.h"

namespace torch_rpc_ext::fuzz {
namespace {

constexpr size_t kMaxSegments = 16;
constexpr int64_t kDensifyLimit = int64_t(1) << 16;

// A provided segment: memory the transport owns, as a shared slab would be.
struct FakeRegion : frame::SharedRegion {
  explicit FakeRegion(size_t n) : bytes(n) {}
  std::vector<char> bytes;
};

// Every byte `t` can reach lies in its storage; touch the first and last.
void checkInsideStorage(const at::Tensor& t, const char* what) {
  if (t.numel() == 0) {
    return;
  }
  using Wide = __int128;
  Wide last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    FUZZ_CHECK(t.stride(d) >= 0, std::string(what) + ": negative stride");
    last += Wide(t.size(d) - 1) * t.stride(d);
  }
  Wide item = t.element_size();
  Wide end = (last + 1) * item;
  Wide nbytes = Wide(t.storage().nbytes());
  FUZZ_CHECK(
      end <= nbytes,
      std::string(what) + " reaches byte " + std::to_string(int64_t(end)) +
          " of a storage of " + std::to_string(int64_t(nbytes)));
  const char* base = static_cast<const char*>(t.storage().data());
  volatile char sink;
  sink = base[t.storage_offset() * t.element_size()];
  sink = base[size_t(end) - 1];
  (void)sink;
}

void checkSparse(const at::Tensor& s) {
  at::Tensor indices = s._indices();
  at::Tensor values = s._values();
  checkInsideStorage(indices, "sparse indices");
  checkInsideStorage(values, "sparse values");
  FUZZ_CHECK(
      indices.dim() == 2 && indices.scalar_type() == at::kLong,
      "sparse indices of the wrong shape or dtype");
  // Validating them reads every index: they must be bytes received, not a
  // zero-stride view standing for any number of them.
  FUZZ_CHECK(
      __int128(indices.numel()) * 8 <= __int128(indices.storage().nbytes()),
      "sparse indices not backed by received bytes: " +
          std::to_string(indices.numel()) + " in a storage of " +
          std::to_string(indices.storage().nbytes()) + " bytes");
  int64_t sparseDims = indices.size(0);
  int64_t nnz = indices.size(1);
  FUZZ_CHECK(sparseDims <= s.dim(), "more sparse dims than dims");
  FUZZ_CHECK(values.size(0) == nnz, "values do not match the indices");
  auto ix = indices.accessor<int64_t, 2>();
  for (int64_t d = 0; d < sparseDims; ++d) {
    for (int64_t j = 0; j < nnz; ++j) {
      FUZZ_CHECK(
          ix[d][j] >= 0 && ix[d][j] < s.size(d),
          "sparse index " + std::to_string(ix[d][j]) + " outside size " +
              std::to_string(s.size(d)));
    }
  }
  // Small enough to densify: a later user of the tensor must not crash.
  int64_t dense = 1;
  for (int64_t d = 0; d < s.dim(); ++d) {
    if (s.size(d) != 0 && dense > kDensifyLimit / s.size(d)) {
      return;
    }
    dense *= s.size(d);
  }
  if (dense <= kDensifyLimit && values.numel() <= kDensifyLimit) {
    try {
      (void)s.to_dense();
    } catch (const std::exception&) {
      // Refusing is fine (e.g. no kernel for the dtype); crashing is not.
    }
  }
}

std::shared_ptr<BufferPool> pool() {
  static auto p = std::make_shared<BufferPool>(
      size_t(8) << 20, std::chrono::milliseconds(60000));
  return p;
}

int fuzzOne(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  size_t n = in.take<uint8_t>() % (kMaxSegments + 1);
  std::vector<uint64_t> sizes(n);
  std::vector<bool> provided(n);
  bool anyProvided = false;
  for (size_t i = 0; i < n; ++i) {
    uint8_t flags = in.take<uint8_t>();
    sizes[i] = in.take<uint16_t>();
    if ((flags & 2) != 0) {
      sizes[i] += BufferPool::kMinPooledBytes;
    }
    // The transport refuses an empty slab segment before the receiver
    // sees the frame.
    provided[i] = (flags & 1) != 0 && sizes[i] != 0;
    anyProvided = anyProvided || provided[i];
  }
  if (!anyProvided) {
    provided.clear();
  }
  bool usePool = (in.take<uint8_t>() & 1) != 0;
  std::string head = in.takeBytes(in.take<uint16_t>());
  std::string pattern = in.takeRest();

  std::shared_ptr<wire::InboundMessage> im;
  try {
    im = wire::InboundMessage::prepare(
        head, sizes, usePool ? pool() : nullptr, provided);
  } catch (const std::exception&) {
    return 0; // refused: the connection would close
  }
  FUZZ_CHECK(im != nullptr, "prepare returned nothing");
  frame::InboundBuffers buffers = im->buffers(im);
  FUZZ_CHECK(buffers.segments.size() == n, "wrong buffer count");
  if (anyProvided) {
    buffers.provided.assign(n, nullptr);
    buffers.regions.assign(n, nullptr);
  }
  // Fill the segments in order, as the stream would.
  std::string payload;
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    char* dst;
    if (anyProvided && provided[i]) {
      auto region = std::make_shared<FakeRegion>(sizes[i]);
      dst = region->bytes.data();
      buffers.provided[i] = dst;
      buffers.regions[i] = region;
    } else {
      dst = static_cast<char*>(buffers.segments[i]);
      FUZZ_CHECK(dst != nullptr || sizes[i] == 0, "no buffer for a segment");
    }
    if (sizes[i] != 0) {
      fillRepeating(dst, sizes[i], pattern, at);
    }
    if (i == 0) {
      payload.assign(dst == nullptr ? "" : dst, sizes[0]);
    }
  }
  c10::intrusive_ptr<torch::distributed::rpc::Message> message;
  try {
    message = im->finish(buffers);
  } catch (const std::exception&) {
    return 0;
  }
  FUZZ_CHECK(message->type() == im->type(), "message type changed");
  FUZZ_CHECK(message->id() == im->id(), "message id changed");
  const auto& p = message->payload();
  FUZZ_CHECK(
      p.size() == sizes[0] &&
          (p.empty() || std::memcmp(p.data(), payload.data(), p.size()) == 0),
      "payload differs from segment 0");
  for (const auto& t : message->tensors()) {
    if (t.is_sparse()) {
      checkSparse(t);
    } else {
      checkInsideStorage(t, "tensor");
    }
  }
  return 0;
}

} // namespace
} // namespace torch_rpc_ext::fuzz

// One core: torch's intra-op threads would only spin next to the fuzzer.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torch_rpc_ext::fuzz::fuzzOne(data, size);
}
