// SPDX-License-Identifier: BSD-3-Clause
// Python surface of AgentOptions and of csrc/common/option_defaults.h, in
// Python names and units (seconds, microseconds, None for "not given").
// torch's pattern: _RpcExtBackendOptionsBase is to RpcExtBackendOptions what
// _TensorPipeRpcBackendOptionsBase is to TensorPipeRpcBackendOptions. No
// logic: torch_rpc_ext/options.py validates against option_spec().
#include <chrono>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/agent/options.h"
#include "csrc/bindings/bind.h"
#include "csrc/channel/registry.h"
#include "csrc/common/source_strikes.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext::bindings {

namespace {

double toSeconds(std::chrono::milliseconds d) {
  return std::chrono::duration<double>(d).count();
}

std::chrono::milliseconds fromSeconds(double seconds) {
  return std::chrono::round<std::chrono::milliseconds>(
      std::chrono::duration<double>(seconds));
}

// Empty strings stand for "not given" in AgentOptions, None in Python.
py::object noneIfEmpty(const std::string& s, bool bytes) {
  if (s.empty()) {
    return py::none();
  }
  return bytes ? py::object(py::bytes(s)) : py::object(py::str(s));
}

// {name: (default, min, max)} of every option the core holds; None where
// there is no default or no limit. secret's min is a length in bytes.
py::dict optionSpec() {
  auto none = py::none();
  // Transports: the registry's names, in its (default preference) order.
  py::tuple transports(py::cast(transport::transportNames()));
  // Channels: the CPU ones but the opt-in ones (device channels serve
  // device_maps).
  py::tuple channels(
      py::cast(channel::defaultChannelNames(channel::DeviceKind::kCpu)));
  py::dict spec;
  spec["num_worker_threads"] =
      py::make_tuple(kDefaultNumWorkerThreads, kMinNumWorkerThreads, none);
  spec["rpc_timeout"] = py::make_tuple(
      rpc::kDefaultRpcTimeoutSeconds, kMinRpcTimeoutSeconds, none);
  spec["init_method"] =
      py::make_tuple(std::string(rpc::kDefaultInitMethod), none, none);
  spec["transports"] = py::make_tuple(transports, none, none);
  spec["channels"] = py::make_tuple(channels, none, none);
  spec["device_channels"] = py::make_tuple(
      py::tuple(py::cast(channel::channelNames(channel::DeviceKind::kCuda))),
      none,
      none);
  spec["address"] = py::make_tuple(none, none, none);
  spec["secret"] = py::make_tuple(none, kMinSecretBytes, none);
  spec["encryption"] = py::make_tuple(std::string("auto"), none, none);
  for (const char* file : {"tls_cert", "tls_key", "tls_ca"}) {
    spec[file] = py::make_tuple(none, none, none);
  }
  spec["max_frame_bytes"] =
      py::make_tuple(kDefaultMaxFrameBytes, kMinMaxFrameBytes, none);
  spec["handshake_timeout"] = py::make_tuple(
      toSeconds(kDefaultHandshakeTimeout),
      toSeconds(kMinHandshakeTimeout),
      none);
  spec["heartbeat_timeout"] = py::make_tuple(
      toSeconds(kDefaultHeartbeatTimeout),
      toSeconds(kMinHeartbeatTimeout),
      none);
  spec["busy_poll_us"] = py::make_tuple(
      kDefaultBusyPoll.count(), kMinBusyPoll.count(), kMaxBusyPoll.count());
  spec["poll_on_caller_cpu"] = py::make_tuple(none, none, none);
  spec["cuda_zero_copy"] = py::make_tuple(false, none, none);
  spec["shm_peers_any_user"] = py::make_tuple(false, none, none);
  spec["tls_peer_names"] = py::make_tuple(py::tuple(), none, none);
  spec["hold_off_exempt"] = py::make_tuple(py::tuple(), none, none);
  spec["cuda_ipc_memory_limit"] =
      py::make_tuple(kDefaultCudaIpcMemoryLimit, uint64_t(0), none);
  spec["max_cached_receive_bytes"] = py::make_tuple(
      kDefaultMaxCachedReceiveBytes, kMinMaxCachedReceiveBytes, none);
  spec["shm_frame_ring_bytes"] = py::make_tuple(
      kDefaultShmFrameRingBytes, kMinShmFrameRingBytes, kMaxShmFrameRingBytes);
  return spec;
}

} // namespace

void bindOptions(py::module_& m) {
  // RpcBackendOptions' Python type is registered by torch.
  py::module_::import("torch.distributed.rpc");

  using O = AgentOptions;
  py::class_<O, rpc::RpcBackendOptions, std::shared_ptr<O>>(
      m, "_RpcExtBackendOptionsBase")
      .def(py::init<>())
      .def(
          py::init<float, std::string>(),
          py::arg("rpc_timeout"),
          py::arg("init_method"))
      // A copy of the C++ part of any options (backend.py completes it).
      .def(py::init<const O&>(), py::arg("other"))
      .def_readwrite("num_worker_threads", &O::numWorkerThreads)
      .def_property(
          "transports",
          [](const O& o) { return py::tuple(py::cast(o.transports)); },
          [](O& o, std::vector<std::string> v) { o.transports = std::move(v); })
      .def_property(
          "channels",
          [](const O& o) { return py::tuple(py::cast(o.channels)); },
          [](O& o, std::vector<std::string> v) { o.channels = std::move(v); })
      // Whether tcp_lanes also serves encrypted connections though
      // `channels` leaves it out: set by RpcExtBackendOptions when
      // `channels` is left at its default.
      .def_readwrite("_lanes_when_encrypted", &O::lanesWhenEncrypted)
      .def_property(
          "device_channels",
          [](const O& o) { return py::tuple(py::cast(o.deviceChannels)); },
          [](O& o, std::vector<std::string> v) {
            o.deviceChannels = std::move(v);
          })
      .def_property(
          "address",
          [](const O& o) { return noneIfEmpty(o.address, false); },
          [](O& o, std::optional<std::string> v) {
            o.address = v.value_or("");
          })
      .def_property(
          "secret",
          [](const O& o) { return noneIfEmpty(o.secret, true); },
          [](O& o, std::optional<py::bytes> v) {
            o.secret = v ? std::string(*v) : std::string();
          })
      .def_readwrite("encryption", &O::encryption)
      .def_property(
          "tls_cert",
          [](const O& o) { return noneIfEmpty(o.tlsCert, false); },
          [](O& o, std::optional<std::string> v) {
            o.tlsCert = v.value_or("");
          })
      .def_property(
          "tls_key",
          [](const O& o) { return noneIfEmpty(o.tlsKey, false); },
          [](O& o, std::optional<std::string> v) { o.tlsKey = v.value_or(""); })
      .def_property(
          "tls_ca",
          [](const O& o) { return noneIfEmpty(o.tlsCa, false); },
          [](O& o, std::optional<std::string> v) { o.tlsCa = v.value_or(""); })
      .def_readwrite("max_frame_bytes", &O::maxFrameBytes)
      .def_readwrite("_devices", &O::devices)
      .def_readwrite("_device_maps", &O::deviceMaps)
      .def_readwrite("_reverse_device_maps", &O::reverseDeviceMaps)
      .def_property(
          "handshake_timeout",
          [](const O& o) { return toSeconds(o.handshakeTimeout); },
          [](O& o, double s) { o.handshakeTimeout = fromSeconds(s); })
      .def_property(
          "heartbeat_timeout",
          [](const O& o) { return toSeconds(o.heartbeatTimeout); },
          [](O& o, double s) { o.heartbeatTimeout = fromSeconds(s); })
      .def_property(
          "busy_poll_us",
          [](const O& o) { return o.busyPoll.count(); },
          [](O& o, int64_t us) { o.busyPoll = std::chrono::microseconds(us); })
      .def_readwrite("poll_on_caller_cpu", &O::pollOnCallerCpu)
      .def_readwrite("max_cached_receive_bytes", &O::maxCachedReceiveBytes)
      .def_readwrite("shm_frame_ring_bytes", &O::shmFrameRingBytes)
      .def_readwrite("cuda_zero_copy", &O::cudaZeroCopy)
      .def_readwrite("_landing_pools", &O::landingPools)
      .def_readwrite("shm_peers_any_user", &O::shmPeersAnyUser)
      .def_property(
          "tls_peer_names",
          [](const O& o) { return py::tuple(py::cast(o.tlsPeerNames)); },
          [](O& o, std::vector<std::string> v) {
            o.tlsPeerNames = std::move(v);
          })
      .def_property(
          "hold_off_exempt",
          [](const O& o) { return py::tuple(py::cast(o.holdOffExempt)); },
          [](O& o, std::vector<std::string> v) {
            try {
              AddressRanges::parse(v);
            } catch (const std::invalid_argument& e) {
              throw py::value_error(
                  std::string("hold_off_exempt: ") + e.what());
            }
            o.holdOffExempt = std::move(v);
          })
      .def_readwrite("cuda_ipc_memory_limit", &O::cudaIpcMemoryLimit)
      // Fault injection, set only by torch_rpc_ext.testing.
      .def_property(
          "_num_fail_sends",
          [](const O& o) { return o.faults.numFailSends; },
          [](O& o, int n) { o.faults.numFailSends = n; })
      .def_property(
          "_messages_to_fail",
          [](const O& o) { return o.faults.messagesToFail; },
          [](O& o, std::vector<std::string> v) {
            o.faults.messagesToFail = std::move(v);
          })
      .def_property(
          "_messages_to_delay",
          [](const O& o) { return o.faults.messagesToDelay; },
          [](O& o, std::unordered_map<std::string, float> v) {
            o.faults.messagesToDelay = std::move(v);
          });

  m.def("option_spec", &optionSpec);
}

} // namespace torch_rpc_ext::bindings
