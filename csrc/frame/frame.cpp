// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/frame/frame.h"

namespace torch_rpc_ext::frame {

std::string validateHeader(const FrameHeader& h, const FrameLimits& limits) {
  if (h.magic != kFrameMagic) {
    return "bad magic (not a torch_rpc_ext peer)";
  }
  if (h.version != kProtocolVersion) {
    return "unsupported protocol version " + std::to_string(h.version) +
        " (this build speaks " + std::to_string(kProtocolVersion) + ")";
  }
  // One flag at most; the two of them that say how a message's segments
  // travel on a message only. (Whether a ring's flags fit the connection
  // is the connection's to check.)
  bool message = h.kind == uint8_t(FrameKind::kMessage);
  if (h.flags != 0 && h.flags != kFlagCarrier &&
      !((h.flags == kFlagChunkedSegments || h.flags == kFlagBodyOnSocket) &&
        message)) {
    return "reserved flags set";
  }
  if (h.kind < uint8_t(FrameKind::kHello) ||
      (h.kind > uint8_t(FrameKind::kFrameRing) &&
       h.kind < kFirstChannelFrameKind)) {
    return "unknown frame kind " + std::to_string(h.kind);
  }
  if (h.headLength > limits.maxHeadBytes) {
    return "head of " + std::to_string(h.headLength) + " bytes exceeds " +
        std::to_string(limits.maxHeadBytes);
  }
  if (h.numSegments > limits.maxSegments) {
    return std::to_string(h.numSegments) + " segments exceed " +
        std::to_string(limits.maxSegments);
  }
  uint64_t fixed =
      sizeof(FrameHeader) + uint64_t(h.numSegments) * 8 + h.headLength;
  if (h.dataLength > limits.maxFrameBytes ||
      fixed > limits.maxFrameBytes - h.dataLength) {
    return "frame of " + std::to_string(h.dataLength + fixed) +
        " bytes exceeds max_frame_bytes=" +
        std::to_string(limits.maxFrameBytes);
  }
  return {};
}

uint64_t OutboundFrame::wireSize() const {
  uint64_t n = sizeof(FrameHeader) + 8 * segments.size() + head.size();
  for (const auto& s : segments) {
    n += s.size;
  }
  return n;
}

} // namespace torch_rpc_ext::frame
