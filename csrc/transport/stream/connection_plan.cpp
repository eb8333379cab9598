// SPDX-License-Identifier: BSD-3-Clause
// How StreamConnection::write() sends a frame's segments: which channel
// carries each (the region channels' copies and the staged copies out of a
// device start here, on the caller's thread), what a frame that cannot be
// sent gives back, and how the channels hear of the regions a queued frame
// names (announceRegionsLocked).
#include <algorithm>
#include <stdexcept>

#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

void StreamConnection::planSegments(
    frame::OutboundFrame& frame,
    PendingWrite& w,
    std::vector<uint8_t>& slots,
    std::vector<channel::ControlFrame>& before) {
  // Every segment must have a way to travel before any channel takes one
  // (taking may lend a slab or hand one back). The stream carries CPU
  // memory; other devices need a channel of theirs.
  for (const auto& segment : frame.segments) {
    if (segment.device == uint8_t(channel::DeviceKind::kCpu) ||
        segment.size == 0) {
      continue;
    }
    bool carried =
        std::any_of(channels_.begin(), channels_.end(), [&](const auto& c) {
          return uint8_t(c->context().device()) == segment.device;
        });
    if (!carried) {
      std::string names;
      for (const auto& c : channels_) {
        names += (names.empty() ? "" : ", ") + c->context().name();
      }
      const bool cuda = segment.device == uint8_t(channel::DeviceKind::kCuda);
      throw std::invalid_argument(
          "no channel of " + describe() + " carries " +
          (cuda ? std::string("CUDA memory")
                : "memory of device type " + std::to_string(segment.device)) +
          " (its channels: " + (names.empty() ? "none" : names) + ")" +
          (cuda ? "; RpcExtBackendOptions.device_channels names those a "
                  "connection may use: a worker's calls to itself take "
                  "cuda_self, calls to another process cuda_ipc, cuda_ring "
                  "or cuda_staged"
                : ""));
    }
  }
  if (channels_.empty()) {
    return;
  }
  // Channels in order of preference; each is offered the segments of its
  // device that none before it took (a region channel all at once).
  const size_t n = frame.segments.size();
  std::vector<bool> taken(n, false);
  for (size_t i = 0; i < n; ++i) {
    taken[i] = frame.segments[i].size == 0;
  }
  std::vector<size_t> offered;
  for (size_t k = 0; k < channels_.size(); ++k) {
    auto& ch = *channels_[k];
    const auto& ctx = ch.context();
    offered.clear();
    for (size_t i = 0; i < n; ++i) {
      if (!taken[i] && frame.segments[i].device == uint8_t(ctx.device())) {
        offered.push_back(i);
      }
    }
    if (offered.empty()) {
      continue;
    }
    const auto slot = static_cast<uint8_t>(k + 1);
    if (ctx.mode() == channel::Channel::Mode::kRegion) {
      std::vector<channel::Channel::TakenRegion> took;
      auto mark = [&] {
        for (const auto& t : took) {
          if (w.regionRecords.empty()) {
            // Sized once: the frame's segments will point into it.
            w.regionRecords.resize(n);
          }
          slots.resize(n);
          slots[t.segment] = slot;
          w.regionRecords[t.segment] = t.record;
          taken[t.segment] = true;
        }
      };
      try {
        ch.takeRegions(
            frame.segments, offered, &took, &before, frame.keepAlive);
      } catch (...) {
        mark(); // for abandonPlan to give back
        throw;
      }
      mark();
      continue;
    }
    if (ctx.mode() == channel::Channel::Mode::kStaged) {
      std::vector<std::shared_ptr<channel::StagedOut>> staged(n);
      auto mark = [&] {
        for (size_t i : offered) {
          if (staged[i]) {
            slots.resize(n);
            w.staged.resize(n);
            slots[i] = slot;
            w.staged[i] = std::move(staged[i]);
            taken[i] = true;
          }
        }
      };
      try {
        ch.stageOutAll(frame.segments, offered, staged);
        // Large staged segments may leave the stream for a host channel
        // that writes them as their bytes come out of the device
        // (tcp_lanes).
        for (size_t i : offered) {
          if (staged[i] &&
              offerStagedToHostChannels(frame, i, staged[i], w, slots)) {
            taken[i] = true;
          }
        }
      } catch (...) {
        mark(); // released with `w`, once their copies are done
        throw;
      }
      mark();
      continue;
    }
    for (size_t i : offered) {
      const auto& segment = frame.segments[i];
      std::shared_ptr<channel::StagedOut> staged;
      if (ch.takeChunks(segment, &staged)) {
        w.chunked.resize(n);
        w.chunked[i] = slot;
        taken[i] = true;
        if (staged) {
          // Copied out of a device as the stream needs it (cuda_ring).
          w.staged.resize(n);
          w.staged[i] = std::move(staged);
        }
      }
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const auto& segment = frame.segments[i];
    if (!taken[i] && segment.device != uint8_t(channel::DeviceKind::kCpu)) {
      // Its channels declined it: nothing else can carry device memory.
      throw std::runtime_error(
          "every channel of " + describe() + " for device type " +
          std::to_string(segment.device) + " declined a segment of " +
          std::to_string(segment.size) + " bytes");
    }
  }
}

bool StreamConnection::offerStagedToHostChannels(
    const frame::OutboundFrame& frame,
    size_t i,
    std::shared_ptr<channel::StagedOut>& staged,
    PendingWrite& w,
    std::vector<uint8_t>& slots) {
  for (size_t k = 0; k < channels_.size(); ++k) {
    auto& ch = *channels_[k];
    if (ch.context().mode() != channel::Channel::Mode::kRegion ||
        ch.context().device() != channel::DeviceKind::kCpu) {
      continue;
    }
    frame::SegmentRecord record{};
    if (ch.takeStaged(frame.segments[i], staged, &record, frame.keepAlive)) {
      const size_t n = frame.segments.size();
      if (w.regionRecords.empty()) {
        w.regionRecords.resize(n); // the frame's segments will point into it
      }
      slots.resize(n);
      slots[i] = static_cast<uint8_t>(k + 1);
      w.regionRecords[i] = record;
      // The stream writes a record; the frame still starts only once the
      // first bytes are out of the device (stagedStartable).
      w.stagedElsewhere.push_back(std::move(staged));
      return true;
    }
  }
  return false;
}

void StreamConnection::abandonPlan(
    const frame::OutboundFrame& frame,
    const PendingWrite& w,
    const std::vector<uint8_t>& slots,
    std::vector<channel::ControlFrame> before) {
  // The peer must still hear of regions made meanwhile: they are in our
  // pools now, and a later record may name them. Queued first: what goes
  // back below may be used by another frame at once, whose records may
  // lean on these (a grant's event, docs/cuda.md, "Grants").
  if (!before.empty()) {
    std::string error;
    bool open = false;
    {
      std::lock_guard<std::mutex> lock(writeMutex_);
      open = state_ != State::kClosed;
      if (open) {
        bool wasEmpty = writes_.empty();
        for (auto& b : before) {
          writes_.push_back(controlFrame(std::move(b)));
        }
        if (state_ == State::kReady && wasEmpty) {
          error = flushLocked();
        }
      }
    }
    if (open) {
      afterFlush(error);
    }
  }
  // What the region channels took for the earlier segments goes back (the
  // staged copies go back with `w`, once they are done).
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] == 0 || (!w.staged.empty() && w.staged[i])) {
      continue;
    }
    try {
      channels_[slots[i] - 1]->abandonRegion(
          frame.segments[i], w.regionRecords.at(i));
    } catch (const std::exception& e) {
      logWarning(
          "torch_rpc_ext: " + describe() +
          " could not give back a region of an unsent frame: " + e.what());
    }
  }
}

void StreamConnection::announceRegionsLocked(
    PendingWrite& w,
    const std::vector<uint8_t>& slots) {
  if (w.regionRecords.empty()) {
    return;
  }
  std::vector<frame::SegmentRecord*> records;
  for (size_t k = 0; k < channels_.size(); ++k) {
    records.clear();
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] == k + 1 && (w.staged.empty() || !w.staged[i])) {
        records.push_back(&w.regionRecords[i]);
      }
    }
    if (!records.empty()) {
      channels_[k]->onRegionsQueuedLocked(records);
    }
  }
}

} // namespace torch_rpc_ext::transport::stream
