// SPDX-License-Identifier: BSD-3-Clause
// Python surface of Agent: argument conversion, GIL policy, names. No logic.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "csrc/agent/agent.h"
#include "csrc/bindings/bind.h"
#include "csrc/channel/registry.h"
#include "csrc/transport/registry.h"
#include "csrc/transport/stream/address.h"

namespace torch_rpc_ext::bindings {

void bindAgent(py::module_& m) {
  // RpcAgent's and Store's Python types are registered by torch.
  py::module_::import("torch.distributed.rpc");

  using Base = torch::distributed::rpc::RpcAgent;
  using torch::distributed::rpc::worker_id_t;
  using torch::distributed::rpc::WorkerInfo;
  // Without the GIL: an agent dropped without shutdown() joins its threads,
  // and they take the GIL on their way out (python_threads.cpp).
  py::class_<Agent, Base, std::shared_ptr<Agent>>(
      m, "Agent", py::release_gil_before_calling_cpp_dtor())
      .def(
          py::init(&Agent::create),
          py::arg("store"),
          py::arg("name"),
          py::arg("rank"),
          py::arg("world_size"),
          py::arg("options"),
          py::call_guard<py::gil_scoped_release>())
      // Re-bind all three: a def on this class hides the base overloads,
      // and the by-id one exists only on TensorPipeAgent upstream.
      .def(
          "get_worker_info",
          [](const Agent& a) { return a.getWorkerInfo(); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "get_worker_info",
          [](const Agent& a, const std::string& name) {
            return a.getWorkerInfo(name);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "get_worker_info",
          [](const Agent& a, worker_id_t id) { return a.getWorkerInfo(id); },
          py::call_guard<py::gil_scoped_release>())
      // As TensorPipeAgent's (RemoteModule and dist autograd read the map).
      .def(
          "_get_device_map",
          [](const Agent& a, const rpc::WorkerInfo& dst) {
            return a.getDeviceMap(dst);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("_get_devices", &Agent::getDevices)
      .def_property_readonly("address", &Agent::address);

  m.def("transport_names", &transport::transportNames);
  // All channels, or those of one device type ("cpu", "cuda").
  m.def(
      "channel_names",
      [](const std::optional<std::string>& device) {
        if (!device) {
          return channel::channelNames();
        }
        if (*device != "cpu" && *device != "cuda") {
          throw py::value_error("device must be 'cpu' or 'cuda'");
        }
        return channel::channelNames(
            *device == "cpu" ? channel::DeviceKind::kCpu
                             : channel::DeviceKind::kCuda);
      },
      py::arg("device") = py::none());
  // The CUDA copy kernels' PTX for the engines of this process
  // (torch_rpc_ext._cuda.load_kernels): {name: (entry, ptx)}.
  m.def(
      "_set_cuda_kernel_images",
      [](const std::map<std::string, std::pair<std::string, std::string>>&
             images) { channel::setCudaKernels(images); });
  m.def("default_address", &transport::stream::defaultAdvertisedAddress);
}

} // namespace torch_rpc_ext::bindings
