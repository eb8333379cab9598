// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing.cuda: the CUDA driver layer and the copy engine,
// reached directly so tests can drive them against the fake driver
// (tests/cuda_fake) on a machine without a GPU, and against the real one on
// a GPU. A test hook, like the rest of _testing: it may reach into a
// channel's folder, which nothing else outside the channel registry does.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "csrc/bindings/bind.h"
#include "csrc/channel/cuda/copy_engine.h"
#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/exported_memory.h"
#include "csrc/channel/cuda_ipc/block.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/cuda_ipc/ipc_lease.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::bindings {

namespace {

namespace cuda = channel::cuda;

CUstream asStream(uintptr_t s) {
  return reinterpret_cast<CUstream>(s);
}

// CopyEngine::pack and ::unpack, which take the same arguments, for Python.
template <auto method>
auto strided() {
  return [](cuda::CopyEngine& e,
            uintptr_t stream,
            uintptr_t dst,
            uintptr_t src,
            const std::vector<int64_t>& sizes,
            const std::vector<int64_t>& strides,
            size_t elemSize) {
    (e.*method)(asStream(stream), dst, src, sizes, strides, elemSize);
  };
}

// CopyEngine::copy and ::copyKernel, which take the same arguments.
template <auto method>
auto plain() {
  return [](cuda::CopyEngine& e,
            uintptr_t stream,
            uintptr_t dst,
            uintptr_t src,
            uint64_t n) { (e.*method)(asStream(stream), dst, src, n); };
}

// A gate a host function waits on: the stream it was launched on stops
// there (as one stuck behind work that never ends) until the gate opens.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
};

void CUDA_CB waitAtGate(void* data) {
  auto* gate = static_cast<Gate*>(data);
  std::unique_lock<std::mutex> lock(gate->mu);
  gate->cv.wait(lock, [gate] { return gate->open; });
}

} // namespace

void bindTestingCuda(py::module_& parent) {
  auto m = parent.def_submodule("cuda", "CUDA driver layer test hooks");
  m.def("libcuda_description", [] { return libcuda().description; });
  m.def("libcuda_load_attempted", &libcudaLoadAttempted);
  m.def("device_count", &cuda::deviceCount);
  m.def("device_uuid", &cuda::deviceUuid);
  m.def("multiprocessors", &cuda::multiprocessors);
  m.def("supports_fd_export", &cuda::supportsFdExport);
  m.def("granularity", [](int device) {
    return cuda::ExportedMemory::granularity(device);
  });
  // How cuda_ipc shares blocks of device `uuid` between two processes that
  // published these descriptors: "fd", "legacy" or None.
  m.def(
      "ipc_sharing",
      [](const std::string& local,
         const std::string& peer,
         const std::string& uuid) -> py::object {
        auto sharing = cuda::IpcDomain::parse(local).sharingWith(
            cuda::IpcDomain::parse(peer), uuid);
        if (!sharing) {
          return py::none();
        }
        return py::str(*sharing == cuda::Sharing::kFd ? "fd" : "legacy");
      });

  // A cuda_ipc descriptor as parsed: (formatted again, per device the
  // indices of the devices that reach it peer to peer).
  m.def("ipc_domain", [](const std::string& descriptor) {
    const auto domain = cuda::IpcDomain::parse(descriptor);
    std::vector<std::vector<int>> peers;
    for (const auto& d : domain.devices) {
      peers.push_back(d.peers);
    }
    return py::make_tuple(domain.format(), peers);
  });

  m.def("max_ptx_isa", &cuda::maxPtxIsa);
  m.def("ptx_isa", &cuda::ptxIsa);

  // Plain device memory and copies, for setting up and checking.
  m.def("mem_alloc", [](int device, size_t bytes) {
    cuda::CurrentDevice current(device);
    CUdeviceptr p = 0;
    TORCH_RPC_EXT_CUDA_CHECK(cuMemAlloc, &p, bytes);
    return static_cast<uintptr_t>(p);
  });
  m.def("mem_free", [](int device, uintptr_t p) {
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuMemFree, p);
  });
  m.def("write", [](int device, uintptr_t p, const py::bytes& data) {
    std::string s = data;
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuMemcpyHtoD, p, s.data(), s.size());
    // From pageable memory the call may return before the DMA is done, and
    // work on non-blocking streams is not ordered after it.
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamSynchronize, nullptr);
  });
  m.def("read", [](int device, uintptr_t p, size_t n) {
    std::string s(n, '\0');
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuMemcpyDtoH, s.data(), p, n);
    return py::bytes(s);
  });
  m.def("stream_create", [](int device) {
    cuda::CurrentDevice current(device);
    CUstream s = nullptr;
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    return reinterpret_cast<uintptr_t>(s);
  });
  m.def("stream_synchronize", [](int device, uintptr_t s) {
    py::gil_scoped_release unlocked;
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamSynchronize, asStream(s));
  });
  m.def("stream_destroy", [](int device, uintptr_t s) {
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamDestroy, asStream(s));
  });

  // Holds `stream` at a host function until open_gate(): a gate, leaked
  // (the stream may reach it after the test has moved on).
  m.def("gate_stream", [](int device, uintptr_t s) {
    auto* gate = new Gate();
    cuda::CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuLaunchHostFunc, asStream(s), &waitAtGate, gate);
    return reinterpret_cast<uintptr_t>(gate);
  });
  m.def("open_gate", [](uintptr_t g) {
    auto* gate = reinterpret_cast<Gate*>(g);
    std::lock_guard<std::mutex> lock(gate->mu);
    gate->open = true;
    gate->cv.notify_all();
  });
  // A cuda_ipc block of ours whose `released` event is recorded on
  // `stream` (as a peer records it after its last read), then let go: the
  // seconds the last reference's drop took (GIL released), where a block
  // teardown must not wait for the event (block.h).
  m.def(
      "drop_ipc_block_released_on",
      [](int device, uint64_t bytes, uintptr_t s) {
        auto block = cuda::Block::create(device, bytes, cuda::Sharing::kFd);
        if (!block) {
          throw std::runtime_error("no cuda_ipc block to be had");
        }
        {
          cuda::CurrentDevice current(device);
          TORCH_RPC_EXT_CUDA_CHECK(
              cuEventRecord, block->released(), asStream(s));
        }
        auto start = std::chrono::steady_clock::now();
        block.reset();
        return std::chrono::duration<double>(
                   std::chrono::steady_clock::now() - start)
            .count();
      },
      py::call_guard<py::gil_scoped_release>());
  // Two cuda_ipc leases on blocks of `device` read peer to peer from
  // `target`, as two connections' receivers make them: the first's use is
  // on `held` (a stream of `target` a test holds, as a peer's `ready` that
  // never completes holds the streams that waited on it), the second's on
  // a free stream; each lease's events are recorded after its use on its
  // join stream (`join_a`, `join_b`: streams of `device`). Both leases die;
  // then, within `wait_s`: whether each block's `released` completed.
  m.def(
      "peer_leases_released",
      [](int device,
         int target,
         uintptr_t held,
         uintptr_t joinA,
         uintptr_t joinB,
         double waitS) {
        auto borrowed = [](uintptr_t s) { // the test's to destroy
          return std::shared_ptr<CUstream_st>(asStream(s), [](CUstream_st*) {});
        };
        CUstream freeUse = nullptr;
        {
          cuda::CurrentDevice current(target);
          TORCH_RPC_EXT_CUDA_CHECK(
              cuStreamCreate, &freeUse, CU_STREAM_NON_BLOCKING);
        }
        std::vector<std::shared_ptr<cuda::Block>> blocks;
        const std::pair<uintptr_t, uintptr_t> uses[] = {
            {held, joinA}, {reinterpret_cast<uintptr_t>(freeUse), joinB}};
        for (const auto& [use, join] : uses) {
          auto block = cuda::Block::create(device, 2 << 20, cuda::Sharing::kFd);
          if (!block) {
            throw std::runtime_error("no cuda_ipc block to be had");
          }
          blocks.push_back(block);
          auto lease = std::make_shared<cuda::BlockLease>(
              std::weak_ptr<cuda::IpcChannel>(),
              block,
              static_cast<uint32_t>(blocks.size()),
              false,
              target,
              borrowed(join));
          lease->recordUse(use);
        }
        auto done = [&](size_t i) {
          return libcuda().cuEventQuery(blocks[i]->released()) == CUDA_SUCCESS;
        };
        const auto until = std::chrono::steady_clock::now() +
            std::chrono::duration<double>(waitS);
        while (!done(1) && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        std::pair<bool, bool> out{done(0), done(1)};
        {
          cuda::CurrentDevice current(target);
          libcuda().cuStreamDestroy(freeUse);
        }
        return out;
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<cuda::ExportedMemory>(m, "ExportedMemory")
      .def_static(
          "create",
          [](int device, size_t bytes) {
            return cuda::ExportedMemory::create(device, bytes);
          })
      .def_static(
          "create_legacy",
          [](int device, size_t bytes) {
            return cuda::ExportedMemory::create(
                device, bytes, cuda::Sharing::kLegacy);
          })
      .def_static("import_fd", &cuda::ExportedMemory::import)
      // A legacy handle's 64 bytes, and the memory it names opened as
      // `bytes` (the size a peer announced with it).
      .def(
          "legacy_handle",
          [](const cuda::ExportedMemory& e) {
            const CUipcMemHandle h = e.legacyHandle();
            return py::bytes(h.reserved, sizeof(h.reserved));
          })
      .def_static(
          "import_legacy",
          [](const py::bytes& handle, size_t bytes, int device) {
            const std::string raw = handle;
            CUipcMemHandle h{};
            TORCH_CHECK(
                raw.size() == sizeof(h.reserved), "not a legacy handle");
            memcpy(h.reserved, raw.data(), sizeof(h.reserved));
            return cuda::ExportedMemory::importLegacy(h, bytes, device);
          })
      .def("export_fd", &cuda::ExportedMemory::exportFd)
      .def_property_readonly(
          "address",
          [](const cuda::ExportedMemory& e) {
            return static_cast<uintptr_t>(e.address());
          })
      .def_property_readonly("size", &cuda::ExportedMemory::size)
      .def_property_readonly("device", &cuda::ExportedMemory::device);

  py::class_<cuda::CopyEngine>(m, "CopyEngine")
      .def(
          py::init([](int device,
                      const std::map<
                          std::string,
                          std::pair<std::string, std::string>>& images) {
            cuda::KernelImages k;
            for (const auto& [name, image] : images) {
              k[name] = {image.first, image.second};
            }
            return std::make_unique<cuda::CopyEngine>(device, k);
          }),
          py::arg("device"),
          py::arg("images"))
      .def("copy", plain<&cuda::CopyEngine::copy>())
      // copy_contiguous at any length (tools/gpu_probe.py sets it beside
      // the driver's copy that copy() makes from kDriverCopyMinBytes).
      .def("copy_kernel", plain<&cuda::CopyEngine::copyKernel>())
      .def(
          "copy_segments",
          [](cuda::CopyEngine& e,
             uintptr_t s,
             const std::vector<std::tuple<uintptr_t, uintptr_t, uint64_t>>&
                 rows) {
            std::vector<cuda::CopyEngine::Segment> segments;
            for (const auto& [d, src, n] : rows) {
              segments.push_back({d, src, n});
            }
            e.copySegments(asStream(s), segments);
          })
      .def("pack", strided<&cuda::CopyEngine::pack>())
      .def("unpack", strided<&cuda::CopyEngine::unpack>())
      .def("launches", &cuda::CopyEngine::launches)
      .def("staging_buffers", &cuda::CopyEngine::stagingBuffers)
      .def_static("merge_dims", &cuda::CopyEngine::mergeDims);
  bindTestingGrants(m);
}

} // namespace torch_rpc_ext::bindings
