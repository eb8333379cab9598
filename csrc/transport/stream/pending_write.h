// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/frame/frame.h"

namespace torch_rpc_ext::transport::stream {

// A frame a StreamConnection (connection.h) has queued for its socket, with
// how far it is written: the prefix, then each segment as bytes, as chunks a
// channel announces by records, or through the frame ring. Guarded by the
// connection's writeMutex_ once queued.
struct PendingWrite {
  std::string prefix; // header + segment lengths + head
  frame::OutboundFrame frame;
  size_t written = 0; // bytes of this frame already on the wire
  bool control = false; // handshake frame: may go before kReady
  // Descriptors sent with the frame's first byte (SCM_RIGHTS); owned by
  // whoever queued the frame, kept open until it is written or dropped.
  std::vector<int> passFds;
  // Per segment, the channel that carries it in chunks (its index in the
  // connection's channels_ plus one; 0: not in chunks; empty: none). Such a
  // frame is written piece by piece: the prefix, then each segment as
  // bytes or as chunks announced by records (produceChunkLocked()).
  std::vector<uint8_t> chunked;
  bool channelChecked = false; // prepareChunksLocked() has run
  // kFrameRing: the frames after it go through the ring (ringOut_).
  bool switchesToRing = false;
  // Through the ring: its flags are set (markForRingLocked()), and its
  // segments (or their records) go on the socket (kFlagBodyOnSocket).
  bool ringMarked = false;
  bool bodyOnSocket = false;
  size_t piece = 0; // 0: prefix; i + 1: segment i
  size_t pieceOffset = 0;
  std::string records; // SegmentRecords not yet on the socket
  size_t recordsWritten = 0;
  // What goes on the wire in place of region segments (the frame's
  // segments point here).
  std::vector<frame::SegmentRecord> regionRecords;
  // Per segment, the bytes a staging channel copies out of a device
  // (empty: none): written only as far as they are ready.
  std::vector<std::shared_ptr<channel::StagedOut>> staged;
  // Staged segments a host channel carries (tcp_lanes: their records go
  // in the stream): held, and the frame starts only once each has bytes
  // ready, as for `staged`.
  std::vector<std::shared_ptr<channel::StagedOut>> stagedElsewhere;
  // Partly on the wire: nothing may be sent before the rest of it.
  bool started() const {
    return written > 0 || piece > 0 || pieceOffset > 0;
  }
};

} // namespace torch_rpc_ext::transport::stream
