// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes frame::validateHeader (csrc/frame/frame.h): the first thing
// every connection parses from a peer, before authentication, and the check
// that bounds every allocation made for a frame. The harness checks the
// verdict against its own statement of the rules (docs/wire-format.md),
// computed in 128-bit arithmetic so it cannot overflow.
//
// Input: a 24-byte FrameHeader; one byte choosing the limits (0: the
// defaults, 1: max_frame_bytes = 1 MiB as in benchmarks/fuzz_agent.py,
// otherwise a FrameLimits read from the input: uint64 maxFrameBytes, uint32
// maxHeadBytes, uint32 maxSegments).
//
// A finding: a sanitizer report, a header accepted although it breaks a rule
// (magic, version, flags, kind, head size, segment count, total frame bytes),
// or a header refused although it keeps all of them, or a refusal without a
// reason.

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/frame/frame.h"
#include "tests/fuzz/fuzz_input.h"

namespace torch_rpc_ext::fuzz {
namespace {

using frame::FrameHeader;
using frame::FrameKind;
using frame::FrameLimits;

bool keepsTheRules(const FrameHeader& h, const FrameLimits& limits) {
  if (h.magic != frame::kFrameMagic || h.version != frame::kProtocolVersion) {
    return false;
  }
  if (h.kind < uint8_t(FrameKind::kHello) ||
      (h.kind > uint8_t(FrameKind::kFrameRing) &&
       h.kind < frame::kFirstChannelFrameKind)) {
    return false;
  }
  bool message = h.kind == uint8_t(FrameKind::kMessage);
  bool flagsOk = h.flags == 0 || h.flags == frame::kFlagCarrier ||
      ((h.flags == frame::kFlagChunkedSegments ||
        h.flags == frame::kFlagBodyOnSocket) &&
       message);
  if (!flagsOk || h.headLength > limits.maxHeadBytes ||
      h.numSegments > limits.maxSegments) {
    return false;
  }
  using Wide = unsigned __int128;
  Wide total = Wide(sizeof(FrameHeader)) + Wide(h.numSegments) * 8 +
      Wide(h.headLength) + Wide(h.dataLength);
  return total <= Wide(limits.maxFrameBytes);
}

int fuzzOne(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  auto h = in.take<FrameHeader>();
  FrameLimits limits;
  uint8_t which = in.take<uint8_t>();
  if (which == 1) {
    limits.maxFrameBytes = uint64_t(1) << 20;
  } else if (which > 1) {
    limits.maxFrameBytes = in.take<uint64_t>();
    limits.maxHeadBytes = in.take<uint32_t>();
    limits.maxSegments = in.take<uint32_t>();
  }
  std::string why = frame::validateHeader(h, limits);
  bool expected = keepsTheRules(h, limits);
  FUZZ_CHECK(
      why.empty() == expected,
      why.empty() ? "accepted a header that breaks a rule"
                  : "refused a valid header: " + why);
  return 0;
}

} // namespace
} // namespace torch_rpc_ext::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torch_rpc_ext::fuzz::fuzzOne(data, size);
}
