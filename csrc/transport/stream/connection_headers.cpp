// SPDX-License-Identifier: BSD-3-Clause
// The read side of StreamConnection, continued (connection_reader.cpp): a
// frame's header, then its segment lengths and head, checked against the
// connection's state, its channels and its limits before anything behind
// them is allocated.
#include <algorithm>
#include <cstring>

#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

bool StreamConnection::onHeaderFromLoop() {
  std::string why = frame::validateHeader(header_, options_.limits);
  const auto* raw = reinterpret_cast<const unsigned char*>(&header_);
  if (!why.empty() && state_ == State::kHandshake && !tls_ &&
      ((raw[0] == 0x16 && raw[1] == 0x03) ||
       std::memcmp(raw, kExchangeTag, sizeof(kExchangeTag)) == 0)) {
    // A TLS handshake record (type 22, version 3.x), or the key exchange
    // before TLS under the group's key, where a hello belongs.
    rejectFromLoop(
        "the peer began a TLS handshake: it encrypts this connection and "
        "this end does not (set the same `encryption` on every worker; "
        "\"auto\" encrypts only peers whose address is not loopback)");
    return false;
  }
  auto kind = static_cast<frame::FrameKind>(header_.kind);
  if (why.empty()) {
    State s = state_;
    bool ok = false;
    if (s == State::kHandshake) {
      ok = kind == handshake_.expectedKind() &&
          header_.headLength == handshake_.expectedHeadBytes();
    } else if (s == State::kReady) {
      ok = kind == frame::FrameKind::kMessage ||
          kind == frame::FrameKind::kPing || kind == frame::FrameKind::kPong ||
          (kind == frame::FrameKind::kFrameRing && passesDescriptors() &&
           header_.headLength == sizeof(uint64_t)) ||
          (kind > frame::FrameKind::kPong &&
           std::any_of(channels_.begin(), channels_.end(), [&](const auto& c) {
             return c->acceptsControlFrame(kind, header_.headLength);
           }));
    }
    if (!ok) {
      why = "unexpected frame kind " + std::to_string(header_.kind) +
          " of head " + std::to_string(header_.headLength) +
          " bytes in this connection state";
    } else if (kind != frame::FrameKind::kMessage && header_.numSegments != 0) {
      why = "control frame with segments";
    } else if (
        (header_.flags == frame::kFlagCarrier ||
         header_.flags == frame::kFlagBodyOnSocket) &&
        !inRing_) {
      why = "a frame ring's flag on a connection without one";
    } else if (
        header_.flags == frame::kFlagChunkedSegments &&
        std::none_of(channels_.begin(), channels_.end(), [](const auto& c) {
          return c->context().mode() == channel::Channel::Mode::kChunks &&
              c->acceptsRecords();
        })) {
      why = "chunked segments on a connection without a chunk channel";
    }
  }
  if (!why.empty()) {
    rejectFromLoop("rejected frame: " + why);
    return false;
  }
  phaseFilled_ = 0;
  lengthsAndHead_.assign(
      size_t(header_.numSegments) * 8 + header_.headLength, '\0');
  phase_ = ReadPhase::kLengthsAndHead;
  if (lengthsAndHead_.empty()) {
    return onLengthsAndHeadFromLoop();
  }
  return true;
}

bool StreamConnection::onLengthsAndHeadFromLoop() {
  size_t n = header_.numSegments;
  segmentSizes_.resize(n);
  carried_.clear();
  std::vector<bool> provided; // empty unless a region segment is announced
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(&segmentSizes_[i], lengthsAndHead_.data() + 8 * i, 8);
    auto wireId =
        static_cast<uint8_t>(segmentSizes_[i] >> frame::kChannelIdShift);
    if (wireId != 0) {
      segmentSizes_[i] &= frame::kSegmentLengthMask;
      uint8_t slot = channelSlot(wireId);
      if (slot == 0) {
        rejectFromLoop(
            "rejected frame: segment " + std::to_string(i) + " names channel " +
            std::to_string(wireId) + ", which this connection does not use");
        return false;
      }
      auto& ch = *channels_[slot - 1];
      bool chunks = ch.context().mode() == channel::Channel::Mode::kChunks;
      if (segmentSizes_[i] == 0 || !ch.acceptsRecords() ||
          (chunks && header_.flags != frame::kFlagChunkedSegments)) {
        rejectFromLoop("rejected frame: bad record segment length");
        return false;
      }
      carried_.resize(n, 0);
      carried_[i] = slot;
      if (!chunks || ch.context().device() != channel::DeviceKind::kCpu) {
        // The channel provides the memory (a device channel's chunks land
        // in device memory of its own, as a region's bytes do).
        provided.resize(n);
        provided[i] = true;
      }
    }
    if (segmentSizes_[i] > header_.dataLength - sum) {
      rejectFromLoop("rejected frame: segment lengths exceed dataLength");
      return false;
    }
    sum += segmentSizes_[i];
  }
  if (sum != header_.dataLength) {
    rejectFromLoop("rejected frame: segment lengths do not sum to dataLength");
    return false;
  }
  head_ = lengthsAndHead_.substr(n * 8);
  lengthsAndHead_.clear();
  phaseFilled_ = 0;
  if (state_ != State::kReady) {
    phase_ = ReadPhase::kHeader;
    return onHandshakeFrameFromLoop(std::move(head_));
  }
  auto kind = static_cast<frame::FrameKind>(header_.kind);
  if (kind != frame::FrameKind::kMessage) {
    // A control frame is done once its head is in.
    phase_ = ReadPhase::kHeader;
    if (!takeCarrierFromLoop()) {
      return false;
    }
    if (kind == frame::FrameKind::kPing) {
      queueControl(uint8_t(frame::FrameKind::kPong), {});
      return state_ != State::kClosed;
    }
    if (kind == frame::FrameKind::kPong) {
      return true;
    }
    if (kind == frame::FrameKind::kFrameRing) {
      return onFrameRingFromLoop();
    }
    for (auto& ch : channels_) {
      if (ch->acceptsControlFrame(kind, header_.headLength)) {
        if (!ch->onControlFrameFromLoop(kind, head_, receivedFds_) &&
            state_ != State::kClosed) {
          rejectFromLoop("rejected frame: a control frame its channel refused");
        }
        return state_ != State::kClosed;
      }
    }
    return true; // unreachable: onHeaderFromLoop() let no other kind in
  }
  if (!takeCarrierFromLoop() ||
      (header_.flags == frame::kFlagBodyOnSocket &&
       !beginSocketBodyFromLoop())) {
    return false;
  }
  try {
    inbound_ = observer_->onFrameHead(*this, head_, segmentSizes_, provided);
  } catch (const std::exception& e) {
    rejectFromLoop(std::string("rejected frame: ") + e.what());
    return false;
  }
  if (inbound_.segments.size() != n) {
    rejectFromLoop("rejected frame: receiver gave wrong buffer count");
    return false;
  }
  if (!provided.empty()) {
    inbound_.provided.assign(n, nullptr);
    inbound_.regions.assign(n, nullptr);
  }
  recordFilled_ = 0;
  segmentIndex_ = 0;
  segmentFilled_ = 0;
  skipEmptySegments();
  if (segmentIndex_ == n) {
    finishFrameFromLoop();
  } else {
    phase_ = ReadPhase::kSegments;
  }
  return state_ != State::kClosed;
}

} // namespace torch_rpc_ext::transport::stream
