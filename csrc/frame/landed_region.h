// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>

#include "csrc/frame/frame.h"

namespace torch_rpc_ext::frame {

// Memory that already is the receiver's tensor memory, of whoever made it
// (the agent: torch's, a grant of its landing pool; channel/grants.h).
class LandedMemory {
 public:
  virtual ~LandedMemory() = default;
  virtual void* data() const = 0;
};

// A device region whose memory is LandedMemory (cuda_ipc's grants): the
// tensor's storage takes it, and no landing copy is made. waitOn() orders
// the stream after the bytes, as for any device region.
class LandedRegion : public DeviceRegion {
 public:
  // The memory, handed over once.
  virtual std::unique_ptr<LandedMemory> take() = 0;
};

} // namespace torch_rpc_ext::frame
