// SPDX-License-Identifier: BSD-3-Clause
// Python surface of Agent: argument conversion, GIL policy, names. No logic.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "csrc/agent/agent.h"
#include "csrc/bindings/bind.h"
#include "csrc/transport/registry.h"
#include "csrc/transport/stream/address.h"

namespace torch_rpc_ext::bindings {

void bindAgent(py::module_& m) {
  // RpcAgent's and Store's Python types are registered by torch.
  py::module_::import("torch.distributed.rpc");

  py::class_<AgentOptions>(m, "_AgentOptions")
      .def(py::init<>())
      .def_readwrite("rpc_timeout", &AgentOptions::rpcTimeoutSeconds)
      .def_readwrite("num_worker_threads", &AgentOptions::numWorkerThreads)
      .def_readwrite("transports", &AgentOptions::transports)
      .def_readwrite("address", &AgentOptions::address)
      .def_property(
          "secret",
          [](const AgentOptions& o) { return py::bytes(o.secret); },
          [](AgentOptions& o, const py::bytes& b) { o.secret = b; })
      .def_readwrite("max_frame_bytes", &AgentOptions::maxFrameBytes)
      .def_readwrite(
          "max_cached_receive_bytes", &AgentOptions::maxCachedReceiveBytes)
      .def_property(
          "handshake_timeout",
          [](const AgentOptions& o) {
            return o.handshakeTimeout.count() / 1000.0;
          },
          [](AgentOptions& o, double seconds) {
            o.handshakeTimeout =
                std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
          })
      .def_property(
          "num_fail_sends",
          [](const AgentOptions& o) { return o.faults.numFailSends; },
          [](AgentOptions& o, int n) { o.faults.numFailSends = n; })
      .def_property(
          "messages_to_fail",
          [](const AgentOptions& o) { return o.faults.messagesToFail; },
          [](AgentOptions& o, std::vector<std::string> v) {
            o.faults.messagesToFail = std::move(v);
          })
      .def_property(
          "messages_to_delay",
          [](const AgentOptions& o) { return o.faults.messagesToDelay; },
          [](AgentOptions& o, std::unordered_map<std::string, float> v) {
            o.faults.messagesToDelay = std::move(v);
          })
      .def_property(
          "heartbeat_timeout",
          [](const AgentOptions& o) {
            return o.heartbeatTimeout.count() / 1000.0;
          },
          [](AgentOptions& o, double seconds) {
            o.heartbeatTimeout =
                std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
          })
      .def_property(
          "busy_poll_us",
          [](const AgentOptions& o) { return o.busyPoll.count(); },
          [](AgentOptions& o, int64_t us) {
            o.busyPoll = std::chrono::microseconds(us);
          });

  using Base = torch::distributed::rpc::RpcAgent;
  using torch::distributed::rpc::WorkerInfo;
  using torch::distributed::rpc::worker_id_t;
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
      .def_property_readonly("address", &Agent::address);

  m.def("transport_names", &transport::transportNames);
  m.def("default_address", &transport::stream::defaultAdvertisedAddress);
}

} // namespace torch_rpc_ext::bindings
