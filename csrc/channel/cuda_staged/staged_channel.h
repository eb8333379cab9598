// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "csrc/channel/channel.h"
#include "csrc/channel/cuda/staging_thread.h"

namespace torch_rpc_ext::channel::cuda {

// cuda_staged: CUDA tensors to any peer, through host memory (docs/cuda.md,
// "The cuda_staged channel"). What carries them to another host, to a peer
// cuda_ipc cannot reach, and between different devices of one host.
//
// Sender: the segment is copied out of its device into pinned host memory,
// in chunks of kStagedChunkBytes, on the stream its bytes are ready on (so
// after whatever the caller queued there). The stream writes each chunk as
// soon as its copy has completed, while the next ones are still copying: a
// staging thread polls each chunk's event (never the caller's thread, never
// the connection's loop) and lets the connection go on. A frame starts only
// once each of its staged segments has its first chunk, so a stream busy
// with the caller's work holds no pings behind a started frame.
//
// Receiver: the bytes land in pinned host memory as the stream reads them;
// each whole chunk is copied onto the receiving device (the one the message
// head names, after the sender's device map) on a stream of the channel's,
// while the next chunk is still arriving. The receiver's tensor views the
// device memory, which is ready once the last copy's event has completed:
// frame::DeviceRegion::waitOn orders the receiver's work after it, with no
// host wait. When the tensor dies, the memory goes back to a pool of the
// device once the work queued on the streams it was used on has finished.
//
// Memory: pinned buffers and device blocks are pooled per device and
// process, shared by every connection, and freed after kStagedIdleMs unused.
// At most kMaxPinnedBytes of pinned memory per device are in use at once
// (both directions); a segment past that fails (sending: stageOut throws,
// naming the limit) or is refused (receiving: the connection closes naming
// it). A received segment takes its whole pinned buffer and device block at
// its first byte, on the loop thread.

constexpr uint64_t kStagedChunkBytes = uint64_t(4) << 20;
// Segments up to this size, of one frame, device and stream, are gathered
// into one buffer (each at an offset aligned to kStagedAlign).
constexpr uint64_t kGatherMaxBytes = uint64_t(1) << 20;
constexpr uint64_t kStagedAlign = 256;

struct StagedCounters {
  std::atomic<uint64_t> sent{0}; // segments
  std::atomic<uint64_t> sentBytes{0};
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> receivedBytes{0};
  std::atomic<uint64_t> chunks{0}; // copies either way
  // Segments refused: to send, over the pinned limit; received, for want of
  // pinned or device memory here (their messages' calls failed).
  std::atomic<uint64_t> declined{0};
  std::atomic<uint64_t> packed{0}; // strided views packed on the device
  std::atomic<uint64_t> gathered{0}; // small segments sent in a group
};

class StagedChannel final : public Channel {
 public:
  StagedChannel(
      std::shared_ptr<const Context> context,
      std::weak_ptr<Host> host,
      StagedCounters& counters);
  ~StagedChannel() override;

  std::shared_ptr<StagedOut> stageOut(
      const frame::OutboundFrame::Segment& segment) override;
  void stageOutAll(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& offered,
      std::vector<std::shared_ptr<StagedOut>>& staged) override;

  int64_t onRecordFromLoop(
      const frame::SegmentRecord& record,
      InboundSegment& segment) override;
  char* landFromLoop(InboundSegment& segment) override;
  bool landedFromLoop(InboundSegment& segment, uint64_t filled) override;
  void onClosedFromLoop() override;

 private:
  // The small segments `group` (of one device and stream) into one pinned
  // buffer: one launch gathers them into a device block, then copies out
  // of it chunk by chunk.
  void gatherOut(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& group,
      std::vector<std::shared_ptr<StagedOut>>& staged);
  struct Landing;
  // Gives back what a landing holds once its copies are done.
  void abandonLanding();

  std::weak_ptr<Host> host_;
  StagedCounters& counters_;
  // The segment being received (loop thread).
  std::unique_ptr<Landing> landing_;
};

// The process's cuda_staged (registry.cpp). Loads the driver only when asked
// whether it is viable.
std::shared_ptr<Context> createStagedChannel(WireIds ids);

} // namespace torch_rpc_ext::channel::cuda
