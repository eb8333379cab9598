// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/shm/context.h"

#include "csrc/channel/shm/factory.h"
#include "csrc/channel/shm/ring_channel.h"
#include "csrc/channel/shm/slab_channel.h"
#include "csrc/common/host.h"

namespace torch_rpc_ext::channel::shm {

template <typename Probe>
ShmContext::ShmContext(WireIds ids, Probe probe)
    : Context(ids), domain_(bootId()) {
  if (domain_.empty()) {
    unviable_ = "cannot identify this host's kernel (no boot id)";
    return;
  }
  // Fail here, not on first use, if shared memory is unavailable (seccomp,
  // no memfd, no sealing).
  try {
    probe();
  } catch (const std::exception& e) {
    unviable_ = e.what();
  }
}

SlabContext::SlabContext(WireIds ids)
    : ShmContext(ids, [] { Slab::create(kSlabMinSegment); }) {}

std::string SlabContext::name() const {
  return "shm_slab";
}

std::shared_ptr<Channel> SlabContext::open(
    std::weak_ptr<Host> host,
    const std::string& /*peerDescriptor*/) {
  return std::make_shared<SlabChannel>(
      shared_from_this(), std::move(host), counters_);
}

std::map<std::string, uint64_t> SlabContext::counters() const {
  return {
      {"segments", counters_.segments.load()},
      {"copied_bytes", counters_.copiedBytes.load()},
      {"handbacks", counters_.handedBack.load()},
      {"slabs_created", counters_.created.load()},
      {"slabs_unmapped", counters_.unmapped.load()},
      {"declined", counters_.declined.load()},
      {"one_offs", counters_.oneOffs.load()},
  };
}

RingContext::RingContext(WireIds ids)
    : ShmContext(ids, [] { Ring::create(kMinRingBytes); }) {}

std::string RingContext::name() const {
  return "shm_ring";
}

std::shared_ptr<Channel> RingContext::open(
    std::weak_ptr<Host> host,
    const std::string& /*peerDescriptor*/) {
  return std::make_shared<RingChannel>(
      shared_from_this(), std::move(host), counters_);
}

std::map<std::string, uint64_t> RingContext::counters() const {
  return {
      {"segments", counters_.segments.load()},
      {"copied_bytes", counters_.bytes.load()},
      {"rings_created", counters_.created.load()},
      {"rings_dropped", counters_.dropped.load()},
      {"one_offs", counters_.oneOffs.load()},
      {"full_waits", counters_.fullWaits.load()},
  };
}

std::shared_ptr<Context> createSlabChannel(WireIds ids) {
  return std::make_shared<SlabContext>(ids);
}

std::shared_ptr<Context> createRingChannel(WireIds ids) {
  return std::make_shared<RingContext>(ids);
}

} // namespace torch_rpc_ext::channel::shm
