// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"

namespace torch_rpc_ext::channel {

// What the channels that lend memory to their peer share (shm_slab's slabs,
// cuda_ipc's device blocks): three control frames, as offsets into the
// channel's kinds (WireIds::kind), and the ids they carry.
enum LendingFrame : uint8_t {
  kLendSetup = 0, // a new piece of memory (channel-specific head) + its fd
  kLendRelease = 1, // uint32 ids the receiver no longer uses
  kLendDrop = 2, // uint32 id: the owner unmaps an idle one
};

// A release frame names at most this many bytes of ids.
constexpr uint32_t kMaxReleaseHead = 4096;

inline std::string idHead(uint32_t id) {
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

// Whether a lending frame of `kind` with a head of `headLength` bytes is
// well formed, its setup heads being `setupLength` bytes.
inline bool lendingFrameFits(
    const WireIds& ids,
    frame::FrameKind kind,
    uint32_t headLength,
    uint32_t setupLength) {
  switch (ids.offsetOf(kind)) {
    case kLendSetup:
      return headLength == setupLength;
    case kLendRelease:
      return headLength >= sizeof(uint32_t) && headLength <= kMaxReleaseHead &&
          headLength % sizeof(uint32_t) == 0;
    case kLendDrop:
      return headLength == sizeof(uint32_t);
    default:
      return false;
  }
}

// The ids of a release or drop head whose length lendingFrameFits().
inline std::vector<uint32_t> idsOf(const std::string& head) {
  std::vector<uint32_t> ids(head.size() / sizeof(uint32_t));
  std::memcpy(ids.data(), head.data(), ids.size() * sizeof(uint32_t));
  return ids;
}

} // namespace torch_rpc_ext::channel
