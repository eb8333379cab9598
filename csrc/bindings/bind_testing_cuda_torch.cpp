// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing.cuda, the torch side: what lets the agent's CUDA
// paths run with a CPU-only torch against the fake driver (tests/cuda_fake).
//
// c10 reaches a device's streams and events only through the device guard
// registered for its type; a CPU torch registers none for CUDA. This one
// implements the same interface with the driver table (csrc/common/
// libcuda.h): streams are CUstreams (id 0: the legacy default stream, then
// one per stream handed out), events CUevents, the current stream is per
// thread and device, as in c10::cuda. A CUDA tensor here is a view of
// device memory made with from_blob: torch can hold it, pass it around,
// pickle it into an RPC message, but runs no kernel on it. Installed only
// where torch has no CUDA guard of its own. A test hook.
//
// Beside it, the fake caching allocator (fake_caching_allocator.h).
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <atomic>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "csrc/bindings/bind.h"
#include "csrc/bindings/fake_caching_allocator.h"
#include "csrc/channel/cuda/device.h"
#include "csrc/channel/grants.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::bindings {

namespace {

namespace cuda = channel::cuda;

// Streams held by hold_stream() until release_stream(): the work queued
// on them after the hold waits (a busy stream, made on purpose).
struct StreamHolds {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, bool> open;
  uint64_t next = 1;
};

StreamHolds& holds() {
  static auto* h = new StreamHolds();
  return *h;
}

class FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override {
    return c10::kCUDA;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::kCUDA, current_);
  }
  void setDevice(c10::Device d) const override {
    cuda::primaryContext(d.index()); // throws for a device that is not there
    current_ = d.index();
    TORCH_RPC_EXT_CUDA_CHECK(cuCtxSetCurrent, cuda::primaryContext(d.index()));
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    try {
      setDevice(d);
    } catch (...) {
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    auto& m = currentStreams();
    auto it = m.find(d.index());
    return it == m.end() ? stream(d.index(), 0) : it->second;
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return stream(d.index(), 0);
  }
  // A fixed pool per device and priority, handed out in turn (as
  // c10::cuda's), so that a long test does not grow streams and their
  // threads without bound.
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    const auto key = std::make_pair(d.index(), high);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& pool = pools_[key];
      if (pool.streams.size() >= kPoolSize) {
        return pool.streams[pool.next++ % kPoolSize];
      }
    }
    c10::Stream s = getNewStream(d, 0); // takes mu_ itself
    std::lock_guard<std::mutex> lock(mu_);
    pools_[key].streams.push_back(s);
    return s;
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    cuda::CurrentDevice current(d.index());
    CUstream s = nullptr;
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.push_back(s);
    return stream(d.index(), static_cast<c10::StreamId>(streams_.size()));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    currentStreams().insert_or_assign(s.device_index(), s);
    return old;
  }
  void* getStreamNativeHandle(const c10::Stream s) const override {
    if (s.id() == 0) {
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(
        s.id() > 0 && size_t(s.id()) <= streams_.size(), "unknown stream");
    return streams_[s.id() - 1];
  }
  void destroyEvent(void* event, const c10::DeviceIndex d)
      const noexcept override {
    if (event != nullptr) {
      libcuda().cuEventDestroy(static_cast<CUevent>(event));
    }
  }
  void record(
      void** event,
      const c10::Stream& s,
      const c10::DeviceIndex d,
      const c10::EventFlag) const override {
    cuda::CurrentDevice current(s.device_index());
    if (*event == nullptr) {
      CUevent e = nullptr;
      TORCH_RPC_EXT_CUDA_CHECK(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
      *event = e;
    }
    TORCH_RPC_EXT_CUDA_CHECK(
        cuEventRecord, static_cast<CUevent>(*event), native(s));
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event == nullptr) {
      return;
    }
    cuda::CurrentDevice current(s.device_index());
    TORCH_RPC_EXT_CUDA_CHECK(
        cuStreamWaitEvent, native(s), static_cast<CUevent>(event), 0);
  }
  bool queryEvent(void* event) const override {
    return event == nullptr ||
        libcuda().cuEventQuery(static_cast<CUevent>(event)) == CUDA_SUCCESS;
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {
      TORCH_RPC_EXT_CUDA_CHECK(cuEventSynchronize, static_cast<CUevent>(event));
    }
  }
  void synchronizeStream(const c10::Stream& s) const override {
    cuda::CurrentDevice current(s.device_index());
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamSynchronize, native(s));
  }
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& s)
      const override {
    FakeCachingAllocator::instance().recordStream(ptr, s);
  }
  bool queryStream(const c10::Stream& s) const override {
    synchronizeStream(s);
    return true;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return static_cast<c10::DeviceIndex>(cuda::deviceCount());
    } catch (...) {
      return 0;
    }
  }

  CUstream native(const c10::Stream& s) const {
    return static_cast<CUstream>(getStreamNativeHandle(s));
  }

 private:
  static c10::Stream stream(c10::DeviceIndex d, c10::StreamId id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, d), id);
  }
  static std::map<c10::DeviceIndex, c10::Stream>& currentStreams() {
    thread_local std::map<c10::DeviceIndex, c10::Stream> m;
    return m;
  }
  static thread_local c10::DeviceIndex current_;
  static constexpr size_t kPoolSize = 4;
  struct Pool {
    std::vector<c10::Stream> streams;
    size_t next = 0;
  };
  mutable std::mutex mu_;
  mutable std::vector<CUstream> streams_; // never destroyed: ids stay valid
  mutable std::map<std::pair<c10::DeviceIndex, bool>, Pool> pools_;
};

thread_local c10::DeviceIndex FakeCudaGuard::current_ = 0;

FakeCudaGuard* fakeGuard() {
  static FakeCudaGuard* g = new FakeCudaGuard();
  return g;
}

} // namespace

void bindTestingCudaTorch(py::module_& parent) {
  auto m = parent.attr("cuda").cast<py::module_>();

  // Whether torch now has a CUDA device guard: its own, or this fake one
  // (installed only if it had none; returns which).
  m.def("install_fake_cuda_guard", [] {
    if (c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
      return c10::impl::getDeviceGuardImpl(c10::kCUDA) == fakeGuard()
          ? std::string("fake")
          : std::string("torch");
    }
    c10::impl::DeviceGuardImplRegistrar(c10::kCUDA, fakeGuard());
    c10::SetAllocator(c10::kCUDA, &FakeCachingAllocator::instance());
    setPoolRoutingForTests(&FakeCachingAllocator::instance().routing());
    return std::string("fake");
  });
  // torch.cuda.MemPool(allocator=CUDAPluggableAllocator(<_C>,
  // "torch_rpc_ext_landing_alloc", "torch_rpc_ext_landing_free")) on
  // `device`, as torch_rpc_ext._cuda.landing_pool makes one on a GPU: its
  // id; and the MemPool's end.
  m.def("make_landing_pool", [](int device) {
    return FakeCachingAllocator::instance().createPool(
        static_cast<c10::DeviceIndex>(device),
        &torch_rpc_ext_landing_alloc,
        &torch_rpc_ext_landing_free);
  });
  m.def("destroy_pool", [](PoolId id) {
    FakeCachingAllocator::instance().destroyPool(id);
  });
  // `n` bytes from pool `id` of `device` for the current stream, as the
  // agent's grants take them (LandingPools); a holder of the memory
  // (`.address`, `.free()`).
  struct PoolBlock {
    c10::DataPtr memory;
  };
  py::class_<PoolBlock>(m, "PoolBlock")
      .def_property_readonly(
          "address",
          [](const PoolBlock& b) {
            return reinterpret_cast<uintptr_t>(b.memory.get());
          })
      .def("free", [](PoolBlock& b) { b.memory.clear(); });
  m.def("pool_allocate", [](int device, PoolId id, size_t n) {
    const auto d = static_cast<c10::DeviceIndex>(device);
    LandingPools pools({{device, id}});
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    const auto before = impl.exchangeDevice(c10::Device(c10::kCUDA, d));
    const c10::Stream stream = impl.getStream(c10::Device(c10::kCUDA, d));
    PoolBlock b{pools.allocate(d, stream, n)};
    impl.exchangeDevice(before);
    return b;
  });
  m.def("allocate", [](int device, size_t n) {
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    const auto before = impl.exchangeDevice(c10::Device(c10::kCUDA, device));
    PoolBlock b{c10::GetAllocator(c10::kCUDA)->allocate(n)};
    impl.exchangeDevice(before);
    return b;
  });
  m.def("empty_cache", [] { FakeCachingAllocator::instance().emptyCache({}); });
  // The agent's grant source over pool `id` of `device` (makePoolGrants),
  // driven by hand: grants' memory, and the segments' sharing.
  struct PoolGrantsHook {
    std::shared_ptr<channel::GrantSource> source;
    std::map<uintptr_t, std::unique_ptr<frame::LandedMemory>> held;
  };
  py::class_<PoolGrantsHook>(m, "PoolGrants")
      .def(
          "allocate",
          [](PoolGrantsHook& h, int device, uint64_t bytes) {
            auto g = h.source->allocate(device, bytes);
            const auto address = reinterpret_cast<uintptr_t>(g.memory->data());
            h.held[address] = std::move(g.memory);
            return py::make_tuple(
                address, g.segmentKey, g.segmentBase, g.segmentSize);
          })
      .def("free", [](PoolGrantsHook& h, uintptr_t a) { h.held.erase(a); })
      .def(
          "shared",
          [](PoolGrantsHook& h, uint64_t key) { h.source->segmentShared(key); })
      .def("unshared", [](PoolGrantsHook& h, uint64_t key) {
        h.source->segmentUnshared(key);
      });
  m.def("pool_grants", [](int device, PoolId id) {
    return std::make_unique<PoolGrantsHook>(
        PoolGrantsHook{makePoolGrants({{device, id}}), {}});
  });
  m.def("begin_allocate_to_pool", [](int device, PoolId id) {
    FakeCachingAllocator::instance().beginAllocateToPool(
        static_cast<c10::DeviceIndex>(device), id, [](CUstream) {
          return true;
        });
  });
  m.def("end_allocate_to_pool", [](int device, PoolId id) {
    FakeCachingAllocator::instance().endAllocateToPool(
        static_cast<c10::DeviceIndex>(device), id);
  });
  // What torch's lazy CUDA init does for the fake allocator: the tests'
  // torch.cuda.init() on a CPU torch.
  m.def("torch_cuda_init", [] { FakeCachingAllocator::instance().init(); });
  // `bytes` of `device` through torch's CUDA allocator, freed at once: left
  // in its cache (as a training step leaves its activations).
  m.def("cache_bytes", [](int device, size_t bytes) {
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    const auto before = impl.exchangeDevice(c10::Device(c10::kCUDA, device));
    {
      c10::GetAllocator(c10::kCUDA)->allocate(bytes);
    }
    impl.exchangeDevice(before);
  });
  m.def("allocator_stats", [] {
    const auto s = FakeCachingAllocator::instance().stats();
    py::dict d;
    d["allocated"] = s.allocated;
    d["reused"] = s.reused;
    d["deferred"] = s.deferred;
    d["skipped_records"] = s.skippedRecords;
    d["emptied"] = s.emptied;
    d["pool_allocated"] = s.poolAllocated;
    d["pool_reused"] = s.poolReused;
    d["pool_released"] = s.poolReleased;
    d["windows"] = s.windows;
    return d;
  });

  // Streams as the Python side of a CPU torch can't reach them: a new one
  // of `device` (its id), made current on this thread; and the CUstream
  // behind an id.
  m.def("new_stream", [](int device) {
    return fakeGuard()->getNewStream(c10::Device(c10::kCUDA, device), 0).id();
  });
  m.def("use_stream", [](int device, int64_t id) {
    const c10::Stream s(
        c10::Stream::UNSAFE, c10::Device(c10::kCUDA, device), id);
    return fakeGuard()->exchangeStream(s).id();
  });
  m.def("stream_handle", [](int device, int64_t id) {
    return reinterpret_cast<uintptr_t>(fakeGuard()->getStreamNativeHandle(
        c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, device), id)));
  });
  // torch's Tensor.record_stream, which a CPU torch cannot dispatch for
  // CUDA: the same call into the allocator.
  m.def("record_stream", [](const at::Tensor& t, int64_t id) {
    fakeGuard()->recordDataPtrOnStream(
        t.storage().data_ptr(),
        c10::Stream(c10::Stream::UNSAFE, t.device(), id));
  });
  // A device-to-device copy of `n` bytes queued on stream `id`.
  m.def(
      "copy_async",
      [](uintptr_t dst, uintptr_t src, size_t n, int device, int64_t id) {
        cuda::CurrentDevice current(device);
        TORCH_RPC_EXT_CUDA_CHECK(
            cuMemcpyAsync,
            dst,
            src,
            n,
            static_cast<CUstream>(fakeGuard()->getStreamNativeHandle(
                c10::Stream(
                    c10::Stream::UNSAFE,
                    c10::Device(c10::kCUDA, device),
                    id))));
      });
  // Work queued on stream `id` from now on waits until release_stream(),
  // as behind a long kernel.
  m.def("hold_stream", [](int device, int64_t id) {
    auto& h = holds();
    uint64_t hold;
    {
      std::lock_guard<std::mutex> lock(h.mu);
      hold = h.next++;
      h.open[hold] = false;
    }
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuLaunchHostFunc,
        static_cast<CUstream>(fakeGuard()->getStreamNativeHandle(
            c10::Stream(
                c10::Stream::UNSAFE, c10::Device(c10::kCUDA, device), id))),
        [](void* arg) {
          auto& h = holds();
          const auto key = reinterpret_cast<uintptr_t>(arg);
          std::unique_lock<std::mutex> lock(h.mu);
          h.cv.wait(lock, [&] { return h.open[key]; });
        },
        reinterpret_cast<void*>(static_cast<uintptr_t>(hold)));
    return hold;
  });
  m.def("release_stream", [](uint64_t hold) {
    auto& h = holds();
    std::lock_guard<std::mutex> lock(h.mu);
    h.open[hold] = true;
    h.cv.notify_all();
  });

  // A CUDA tensor viewing `address` (device memory of `device`), as torch
  // would hold one; the memory stays the caller's.
  // (of `like`'s dtype)
  m.def(
      "device_tensor",
      [](uintptr_t address,
         const std::vector<int64_t>& sizes,
         const at::Tensor& like,
         int device,
         std::optional<std::vector<int64_t>> strides) {
        const auto options =
            at::TensorOptions()
                .dtype(like.scalar_type())
                .device(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
        const c10::Device target(
            c10::kCUDA, static_cast<c10::DeviceIndex>(device));
        auto* data = reinterpret_cast<void*>(address);
        if (strides) {
          // A view (the CPU torch has no CUDA as_strided to make one).
          return at::from_blob(
              data, sizes, *strides, [](void*) {}, options, target);
        }
        return at::from_blob(data, sizes, [](void*) {}, options, target);
      },
      py::arg("address"),
      py::arg("sizes"),
      py::arg("like"),
      py::arg("device"),
      py::arg("strides") = py::none());
  // torch.cuda.set_device and current_device, as a CPU torch can't reach
  // them: this thread's current device (the guard's).
  m.def("set_device", [](int device) {
    c10::impl::getDeviceGuardImpl(c10::kCUDA)
        ->setDevice(c10::Device(c10::kCUDA, device));
  });
  m.def("current_device", [] {
    return int(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
  });
  // The CUstream behind the current stream of `device` (0: the legacy
  // default stream).
  m.def("current_stream", [](int device) {
    auto* g = c10::impl::getDeviceGuardImpl(c10::kCUDA);
    return reinterpret_cast<uintptr_t>(g->getStreamNativeHandle(
        g->getStream(c10::Device(c10::kCUDA, device))));
  });

  // The bytes of a CUDA tensor's used span, read after the work queued on
  // the current stream of its device (a host wait: tests only).
  m.def("tensor_bytes", [](const at::Tensor& t) {
    TORCH_CHECK(t.is_cuda(), "not a CUDA tensor");
    TORCH_CHECK(t.is_contiguous(), "not contiguous");
    if (t.numel() == 0) {
      return py::bytes();
    }
    auto* g = c10::impl::getDeviceGuardImpl(c10::kCUDA);
    auto s = g->getStream(t.device());
    {
      cuda::CurrentDevice current(t.device().index());
      TORCH_RPC_EXT_CUDA_CHECK(
          cuStreamSynchronize,
          static_cast<CUstream>(g->getStreamNativeHandle(s)));
    }
    std::string out(t.numel() * t.element_size(), '\0');
    cuda::CurrentDevice current(t.device().index());
    TORCH_RPC_EXT_CUDA_CHECK(
        cuMemcpyDtoH,
        out.data(),
        reinterpret_cast<CUdeviceptr>(t.data_ptr()),
        out.size());
    return py::bytes(out);
  });
}

} // namespace torch_rpc_ext::bindings
