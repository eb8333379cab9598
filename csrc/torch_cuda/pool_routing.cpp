// SPDX-License-Identifier: BSD-3-Clause
// torch's own PoolRouting (landing_pool.h): beginAllocateToPool and its
// pair on torch's CUDA caching allocator.
//
// One build serves a CPU and a CUDA torch of one version, so nothing of
// libc10_cuda is linked: the allocator is found at run time as the data
// symbol c10::cuda::CUDACachingAllocator::allocator (exported by every
// torch of our range), in the libc10_cuda a CUDA torch has loaded, and
// called through its class as this torch's headers declare it (the layout
// changes between versions: a build is for one). Its own translation unit
// (alone in its folder, csrc/torch_cuda/, so outside the unity units and
// the agent's folder): c10/cuda's headers
// need the CUDA runtime's, crt/ included, which setup.py puts on the path
// where it finds them; without them this builds to no routing, and the
// landing pool is unavailable (the agent says so).
#include "csrc/agent/landing_pool.h"

#if __has_include(<crt/host_config.h>)
#include <dlfcn.h>

#include <c10/cuda/CUDACachingAllocator.h>

namespace torch_rpc_ext {

namespace {

using Allocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;

constexpr const char* kAllocatorSymbol =
    "_ZN3c104cuda20CUDACachingAllocator9allocatorE";

class TorchPoolRouting final : public PoolRouting {
 public:
  explicit TorchPoolRouting(std::atomic<Allocator*>* allocator)
      : allocator_(allocator) {}
  void begin(c10::DeviceIndex device, PoolId id, Filter filter) override {
    // cudaStream_t is CUstream.
    allocator_->load()->beginAllocateToPool(device, id, std::move(filter));
  }
  void end(c10::DeviceIndex device, PoolId id) override {
    Allocator* a = allocator_->load();
    // begin() raised the pool's use count: dropped whatever the first says.
    try {
      a->endAllocateToPool(device, id);
    } catch (...) {
      a->releasePool(device, id);
      throw;
    }
    a->releasePool(device, id);
  }

 private:
  std::atomic<Allocator*>* allocator_;
};

std::atomic<Allocator*>* findAllocator() {
  // Only if already loaded (a CUDA torch): never loads it.
  void* lib = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    return nullptr;
  }
  auto* symbol = dlsym(lib, kAllocatorSymbol);
  dlclose(lib); // torch holds it loaded
  return static_cast<std::atomic<Allocator*>*>(symbol);
}

} // namespace

PoolRouting* torchPoolRouting() {
  static PoolRouting* routing = []() -> PoolRouting* {
    auto* a = findAllocator();
    return a != nullptr && a->load() != nullptr ? new TorchPoolRouting(a)
                                                : nullptr;
  }();
  return routing;
}

} // namespace torch_rpc_ext

#else

namespace torch_rpc_ext {
PoolRouting* torchPoolRouting() {
  return nullptr;
}
} // namespace torch_rpc_ext

#endif
