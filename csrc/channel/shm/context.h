// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <map>
#include <memory>
#include <string>

#include "csrc/channel/channel.h"
#include "csrc/channel/shm/ring.h"
#include "csrc/channel/shm/slab.h"

namespace torch_rpc_ext::channel::shm {

// What the shm channels share: CPU memory in sealed memfds handed over the
// connection (so its transport must pass descriptors), viable where memfds
// can be made and sealed, and usable between two processes of one booted
// kernel (the domain descriptor: its boot id).
class ShmContext : public Context {
 public:
  DeviceKind device() const override {
    return DeviceKind::kCpu;
  }
  std::string unviableReason() const override {
    return unviable_;
  }
  std::string domainDescriptor() const override {
    return domain_;
  }
  bool needsDescriptorPassing() const override {
    return true;
  }

 protected:
  // `probe` makes (and drops) the smallest object of the channel, throwing
  // what is missing.
  template <typename Probe>
  ShmContext(WireIds ids, Probe probe);

 private:
  std::string domain_;
  std::string unviable_;
};

// shm_slab (slab_channel.h).
class SlabContext final : public ShmContext {
 public:
  explicit SlabContext(WireIds ids);
  std::string name() const override;
  Channel::Mode mode() const override {
    return Channel::Mode::kRegion;
  }
  std::shared_ptr<Channel> open(
      std::weak_ptr<Host> host,
      const std::string& peerDescriptor) override;
  std::map<std::string, uint64_t> counters() const override;

 private:
  mutable SlabCounters counters_;
};

// shm_ring (ring_channel.h).
class RingContext final : public ShmContext {
 public:
  explicit RingContext(WireIds ids);
  std::string name() const override;
  Channel::Mode mode() const override {
    return Channel::Mode::kChunks;
  }
  std::shared_ptr<Channel> open(
      std::weak_ptr<Host> host,
      const std::string& peerDescriptor) override;
  std::map<std::string, uint64_t> counters() const override;

 private:
  mutable RingCounters counters_;
};

} // namespace torch_rpc_ext::channel::shm
