// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing.cuda.use_test_grants(): a GrantSource (channel/
// grants.h) of plain driver memory, so that cuda_ipc's grants can be driven
// by two Endpoints with no agent and no torch above them (tests/cuda_driver/
// ipc_worker.py), on the fake driver and on a GPU whose torch is too old for
// the landing pool. A segment per grant, made with cuMemAlloc; one freed
// while a peer may have it open is freed only once it may not, as the
// landing pool does (agent/landing_pool.cpp), and the fake poisons any use
// that would break that order.
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "csrc/bindings/bind.h"
#include "csrc/channel/grants.h"
#include "csrc/channel/registry.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::bindings {

namespace {

class TestGrants final : public channel::GrantSource,
                         public std::enable_shared_from_this<TestGrants> {
 public:
  struct Counts {
    uint64_t made = 0;
    uint64_t freed = 0;
    uint64_t live = 0;
  };

  channel::GrantMemory allocate(int device, uint64_t bytes) override {
    const uintptr_t p = channel::cudaMemAlloc(device, bytes);
    if (p == 0) {
      throw std::runtime_error("out of device memory for a test grant");
    }
    channel::GrantMemory g;
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t key = nextKey_++;
    segments_[key] = Segment{device, p, false, false};
    ++counts_.made;
    ++counts_.live;
    g.memory = std::make_unique<Memory>(shared_from_this(), key, p);
    g.stream = streamLocked(device);
    g.segmentBase = p;
    g.segmentSize = bytes;
    g.segmentKey = key;
    return g;
  }

  void segmentShared(uint64_t key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = segments_.find(key);
    if (it != segments_.end()) {
      it->second.shared = true;
    }
  }

  void segmentUnshared(uint64_t key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = segments_.find(key);
    if (it != segments_.end()) {
      it->second.shared = false;
      freeIfDoneLocked(it);
    }
  }

  Counts counts() {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }

 private:
  struct Segment {
    int device;
    uintptr_t address;
    bool shared; // a peer may have it open
    bool released; // its memory went back (the grant's end)
  };

  class Memory final : public frame::LandedMemory {
   public:
    Memory(std::shared_ptr<TestGrants> owner, uint64_t key, uintptr_t p)
        : owner_(std::move(owner)), key_(key), p_(p) {}
    ~Memory() override {
      owner_->release(key_);
    }
    void* data() const override {
      return reinterpret_cast<void*>(p_);
    }

   private:
    std::shared_ptr<TestGrants> owner_;
    uint64_t key_;
    uintptr_t p_;
  };

  void release(uint64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = segments_.find(key);
    if (it != segments_.end()) {
      it->second.released = true;
      freeIfDoneLocked(it);
    }
  }

  void freeIfDoneLocked(std::map<uint64_t, Segment>::iterator it) {
    if (!it->second.released || it->second.shared) {
      return;
    }
    std::string error;
    channel::cudaMemFree(it->second.device, it->second.address, &error);
    segments_.erase(it);
    ++counts_.freed;
    --counts_.live;
  }

  CUstream streamLocked(int device) {
    auto it = streams_.find(device);
    if (it == streams_.end()) {
      channel::CudaDeviceScope current(device);
      CUstream s = nullptr;
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
      it = streams_.emplace(device, s).first;
    }
    return it->second;
  }

  std::mutex mu_;
  std::map<uint64_t, Segment> segments_;
  std::map<int, CUstream> streams_; // for the process's life
  uint64_t nextKey_ = 1;
  Counts counts_;
};

std::shared_ptr<TestGrants>& installed() {
  static std::shared_ptr<TestGrants> g;
  return g;
}

} // namespace

void bindTestingGrants(py::module_& m) {
  m.def(
      "use_test_grants",
      [](uint64_t memoryLimit) {
        installed() = std::make_shared<TestGrants>();
        channel::setGrantSource(installed());
        // (An agent sets it from cuda_ipc_memory_limit; nothing to free.)
        channel::setCudaMemoryPolicy(memoryLimit, nullptr);
      },
      py::arg("memory_limit") = 0,
      "grants of plain driver memory (no agent, no torch); memory_limit: "
      "cuda_ipc's bound per device (0: none)");
  m.def(
      "set_grant_idle_ms",
      [](int64_t ms) { channel::setGrantIdleMs(ms); },
      "as $TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS, from now on (0: never)");
  m.def("test_grant_counts", [] {
    auto g = installed();
    if (!g) {
      throw std::runtime_error("use_test_grants() was not called");
    }
    auto c = g->counts();
    return std::map<std::string, uint64_t>{
        {"made", c.made},
        {"freed", c.freed},
        {"live", c.live},
        {"grant_bytes", channel::cudaMemoryStats().grantBytes}};
  });
}

} // namespace torch_rpc_ext::bindings
