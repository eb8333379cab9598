// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Shared by the targets that play a stream connection's peer (fuzz_stream,
// fuzz_frame_ring): frames to send, buffers for the frames the connection
// delivers, and the checks made on them.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/frame/frame.h"
#include "csrc/transport/stream/loop.h"
#include "csrc/transport/transport.h"
#include "tests/fuzz/fuzz_input.h"

namespace torch_rpc_ext::fuzz {

// The header of a frame of `kind` with a head of `headLength` bytes and no
// segments.
inline std::string frameHeader(frame::FrameKind kind, uint32_t headLength) {
  frame::FrameHeader h{
      frame::kFrameMagic,
      frame::kProtocolVersion,
      uint8_t(kind),
      0,
      headLength,
      0,
      0};
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// Host buffers for a frame's segments, owned by the result (keepAlive);
// nullptr where the peer provides the segment. Every segment on the host
// (devices -1).
inline frame::InboundBuffers ownedBuffers(
    const std::vector<uint64_t>& sizes,
    const std::vector<bool>& provided) {
  frame::InboundBuffers b;
  auto owned = std::make_shared<std::vector<std::vector<char>>>();
  for (size_t i = 0; i < sizes.size(); ++i) {
    bool byPeer = !provided.empty() && provided[i];
    owned->emplace_back(byPeer ? 0 : sizes[i]);
    b.segments.push_back(byPeer ? nullptr : owned->back().data());
    b.devices.push_back(-1);
  }
  b.keepAlive = owned;
  return b;
}

// A delivered frame: the segment count its head announced, and provided
// memory (a view of a mapped slab, a cuda_ipc block, a staged landing in
// the fake's device memory, which is host memory) readable end to end.
inline void checkDelivered(
    const frame::InboundBuffers& buffers,
    const std::vector<uint64_t>& announced,
    volatile char& sink) {
  FUZZ_CHECK(
      buffers.segments.size() == announced.size(),
      "frame delivered with another segment count than announced");
  for (size_t i = 0; i < buffers.provided.size(); ++i) {
    if (buffers.provided[i] != nullptr && announced[i] != 0) {
      const volatile char* p = static_cast<const char*>(buffers.provided[i]);
      sink = static_cast<char>(sink + p[0] + p[announced[i] - 1]);
    }
  }
}

// The offered channel of that name (the harness lists it).
inline const channel::Context& offeredChannel(
    const std::vector<channel::Offer>& offers,
    const std::string& name) {
  for (const auto& offer : offers) {
    if (offer.context->name() == name) {
      return *offer.context;
    }
  }
  FUZZ_CHECK(false, "the harness has no channel " + name);
  return *offers.front().context;
}

// What a target's harness holds across inputs: one loop (never destroyed:
// its threads keep running), the options its connections are made with
// (the group secret, no heartbeats), and the channels they negotiate with
// any peer, which the target fills in.
struct PeerHarness {
  PeerHarness() {
    options.secret = std::string(32, 's');
    options.heartbeatTimeout = std::chrono::milliseconds(0);
    options.channelsFor = [this](int32_t, bool) { return channels; };
  }
  PeerHarness(const PeerHarness&) = delete;
  PeerHarness& operator=(const PeerHarness&) = delete;
  const channel::Context& channel(const std::string& name) const {
    return offeredChannel(channels, name);
  }
  transport::stream::Loop loop;
  transport::TransportOptions options;
  std::vector<channel::Offer> channels;
};

} // namespace torch_rpc_ext::fuzz
