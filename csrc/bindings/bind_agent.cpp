// SPDX-License-Identifier: BSD-3-Clause
// Python surface of Agent: argument conversion, GIL policy, names. No logic.
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "csrc/agent/agent.h"
#include "csrc/agent/builtin_call.h"
#include "csrc/agent/call_trace.h"
#include "csrc/agent/invoke_rpc.h"
#include "csrc/agent/landing_pool.h"
#include "csrc/agent/latency.h"
#include "csrc/agent/tracing.h"
#include "csrc/bindings/bind.h"
#include "csrc/channel/registry.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext::bindings {

namespace {

// torch's frontend resolves an rpc_sync / rpc_async / remote destination
// given by name or rank with agent.get_worker_info() on every call.
// Upstream's binding makes a new Python WorkerInfo each time (a copy, its
// pybind11 registration and release) and hands the GIL over around a lookup
// that never blocks. This keeps one Python object per worker while the
// membership view it came from is current (a join, a leave or a death
// publishes a new view, and the cache starts again: a departed worker's
// lookup raises as before), and keeps the GIL. Used under the GIL only.
// Measured (session 40, pipelined rpc_async, six alternations): 1.01x to
// 1.24x the calls/s without it, 1.19x the median.
class WorkerInfoCache {
 public:
  template <typename Key>
  py::object get(const Agent& a, const Key& key) {
    auto view = a.group().view();
    if (agent_ != &a || view_.lock() != view) {
      byName_.clear();
      byId_.clear();
      agent_ = &a;
      view_ = view;
    }
    auto& map = table(key);
    auto it = map.find(key);
    if (it == map.end()) {
      // Throws for a worker the view does not hold (nothing cached then).
      it = map.emplace(key, py::cast(a.getWorkerInfo(key))).first;
    }
    return it->second;
  }

 private:
  std::unordered_map<std::string, py::object>& table(const std::string&) {
    return byName_;
  }
  std::unordered_map<rpc::worker_id_t, py::object>& table(rpc::worker_id_t) {
    return byId_;
  }

  const Agent* agent_ = nullptr;
  std::weak_ptr<const View> view_;
  std::unordered_map<std::string, py::object> byName_;
  std::unordered_map<rpc::worker_id_t, py::object> byId_;
};

// torch's _invoke_rpc_builtin (or whatever _invoke_rpc_builtin was before
// ours). Never destroyed, as workerInfoCache() below; used under the GIL.
py::object* builtinFallback() {
  static auto* fn = new py::object();
  return fn;
}

// Never destroyed: its objects must not be released after the interpreter.
WorkerInfoCache& workerInfoCache() {
  static auto* cache = new WorkerInfoCache();
  return *cache;
}

// A span of torch_rpc_ext.tracing's, ended (and let go) with the GIL.
class PyServeSpan final : public tracing::ServeSpan {
 public:
  PyServeSpan(const py::object* endFn, py::object span)
      : endFn_(endFn), span_(std::move(span)) {}
  ~PyServeSpan() override {
    if (span_) {
      py::gil_scoped_acquire gil;
      span_ = py::object();
    }
  }
  void end(const std::string& error) override {
    py::gil_scoped_acquire gil;
    try {
      (*endFn_)(span_, error);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("torch_rpc_ext tracing: ending a span");
    }
    span_ = py::object();
  }

 private:
  const py::object* endFn_;
  py::object span_;
};

} // namespace

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
      // (Every call's destination: workerInfoCache() above.)
      .def(
          "get_worker_info",
          [](const Agent& a, const std::string& name) {
            return workerInfoCache().get(a, name);
          })
      .def(
          "get_worker_info",
          [](const Agent& a, worker_id_t id) {
            return workerInfoCache().get(a, id);
          })
      // As TensorPipeAgent's (RemoteModule and dist autograd read the map).
      .def(
          "_get_device_map",
          [](const Agent& a, const rpc::WorkerInfo& dst) {
            return a.getDeviceMap(dst);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("_get_devices", &Agent::getDevices)
      .def_property_readonly(
          "is_dynamic", [](const Agent& a) { return a.group().isDynamic(); })
      .def(
          "_stop_membership",
          &Agent::stopMembership,
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "incarnation", [](const Agent& a) { return a.group().incarnation(); })
      .def(
          "_why_unreachable",
          [](Agent& a,
             const std::vector<std::string>& names,
             int64_t withinMs,
             bool dial) {
            return a.group().whyUnreachable(
                names,
                std::chrono::milliseconds(std::max<int64_t>(withinMs, 0)),
                dial);
          },
          py::arg("names"),
          py::arg("within_ms"),
          py::arg("dial") = true,
          py::call_guard<py::gil_scoped_release>())
      // (epoch, [(name, rank, incarnation)]) of the current view.
      .def(
          "_membership",
          [](const Agent& a) {
            auto v = a.group().view();
            std::vector<std::tuple<std::string, int64_t, uint64_t>> members;
            for (const auto& p : v->byId) {
              if (p) {
                members.emplace_back(
                    p->info.name_, p->info.id_, p->incarnation);
              }
            }
            return std::make_pair(v->epoch, members);
          },
          py::call_guard<py::gil_scoped_release>())
      // [(kind, epoch, name, rank, incarnation, reason)] applied since the
      // last call, waiting up to `timeout` s; None once shut down.
      .def(
          "_take_membership_events",
          [](Agent& a, float timeout) -> py::object {
            auto events = a.group().takeEvents(
                std::chrono::milliseconds(
                    static_cast<int64_t>(timeout * 1000)));
            py::gil_scoped_acquire gil; // (None is reference-counted too)
            if (!events) {
              return py::none();
            }
            std::vector<std::tuple<
                std::string,
                int64_t,
                std::string,
                int32_t,
                uint64_t,
                std::string>>
                out;
            for (const auto& ev : *events) {
              out.emplace_back(
                  eventKindName(ev.kind),
                  ev.epoch,
                  ev.member.name,
                  ev.member.rank,
                  ev.member.incarnation,
                  ev.reason);
            }
            return py::cast(out);
          },
          py::arg("timeout"),
          py::call_guard<py::gil_scoped_release>())
      // (why it does not serve calls, or "", [(transport, microseconds its
      // loop took to run a task, -1: not within `within` s)]):
      // torch_rpc_ext.metrics.health.
      .def(
          "_health",
          [](const Agent& a, double within) {
            // (Whole milliseconds, at least one; NaN as 0.)
            within = std::isnan(within) ? 0.0 : std::clamp(within, 0.0, 3600.0);
            auto h = a.health(
                std::chrono::milliseconds(
                    std::max<int64_t>(1, std::llround(within * 1000))));
            return std::make_pair(std::move(h.notServing), std::move(h.loops));
          },
          py::arg("within"),
          py::call_guard<py::gil_scoped_release>())
      // ([(id, callee, kind, seconds since sent, timeout in seconds: 0
      // never expires)], how many in flight in all): the `limit` calls in
      // flight sent first, oldest first (torch_rpc_ext.metrics.
      // calls_in_flight).
      .def(
          "_calls_in_flight",
          [](const Agent& a, size_t limit) {
            auto [oldest, total] = a.oldestCalls(limit);
            const auto now = std::chrono::steady_clock::now();
            std::vector<
                std::tuple<int64_t, std::string, std::string, double, double>>
                out;
            out.reserve(oldest.size());
            for (const auto& c : oldest) {
              out.emplace_back(
                  c.id,
                  c.peer->info.name_,
                  callKindName(c.kind),
                  std::chrono::duration<double>(now - c.sentAt).count(),
                  c.timeout.count() / 1000.0);
            }
            return std::make_pair(std::move(out), total);
          },
          py::arg("limit"),
          py::call_guard<py::gil_scoped_release>())
      // ([(id, caller, kind, seconds since read, stage, thread: 0 none)],
      // how many in all): the `limit` requests served longest, oldest first
      // (torch_rpc_ext.metrics.requests_being_served).
      .def(
          "_requests_being_served",
          [](const Agent& a, size_t limit) {
            auto [oldest, total] = a.oldestServed(limit);
            const auto now = std::chrono::steady_clock::now();
            std::vector<std::tuple<
                int64_t,
                std::string,
                std::string,
                double,
                std::string,
                int32_t>>
                out;
            out.reserve(oldest.size());
            for (const auto& r : oldest) {
              out.emplace_back(
                  r.id,
                  r.caller ? r.caller->info.name_ : std::string(),
                  callKindName(r.kind),
                  std::chrono::duration<double>(now - r.arrived).count(),
                  ServingTable::stageName(r.stage),
                  r.thread);
            }
            return std::make_pair(std::move(out), total);
          },
          py::arg("limit"),
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("address", &Agent::address)
      // [(peer, kind, metric, bounds, counts, sum)]: the call-cost
      // histograms with values (latency.h; torch_rpc_ext.metrics).
      .def(
          "_call_costs",
          [](const Agent& a) {
            std::vector<std::pair<std::string, const CallCosts*>> peers;
            const auto all = a.group().everyPeer();
            std::unordered_set<const CallCosts*> seen; // a name's, once
            for (const auto& p : all) {
              if (seen.insert(&p->stats.costs).second) {
                peers.emplace_back(p->info.name_, &p->stats.costs);
              }
            }
            std::vector<std::tuple<
                std::string,
                std::string,
                std::string,
                std::vector<double>,
                std::vector<uint64_t>,
                double>>
                out;
            for (auto& s : snapshotCosts(peers)) {
              out.emplace_back(
                  std::move(s.peer),
                  std::move(s.kind),
                  std::move(s.metric),
                  std::move(s.bounds),
                  std::move(s.counts),
                  s.sum);
            }
            return out;
          },
          py::call_guard<py::gil_scoped_release>());

  // torch_rpc_ext.tracing: what this thread's calls carry, and the trace
  // context of the request this thread serves (csrc/agent/tracing.h).
  m.def("_set_trace_outgoing", [](std::string traceparent) {
    tracing::setOutgoing(std::move(traceparent));
  });
  m.def("_trace_incoming", [] { return tracing::incoming(); });
  // TORCH_RPC_EXT_CALL_TRACE=1's stamps (call_trace.h): [(call id, point,
  // CLOCK_MONOTONIC ns)], taken; benchmarks/small_call_breakdown.py.
  m.def("_call_trace_take", [] { return call_trace::take(); });
  // When the served request's CUDA tensors landed: (start, end) ns since
  // the epoch, or None (tracing.h).
  m.def("_trace_incoming_landing", []() -> py::object {
    const auto& l = tracing::incomingLanding();
    if (l.start == 0) {
      return py::none();
    }
    return py::make_tuple(l.start, l.end);
  });
  // The phases of this thread's last traced send (tracing.h), taken:
  // (encode start, encode end, send end) in ns since the epoch, or None.
  m.def("_take_send_phases", []() -> py::object {
    auto p = tracing::takeSendPhases();
    if (p.encodeStart == 0) {
      return py::none();
    }
    return py::make_tuple(p.encodeStart, p.encodeEnd, p.sendEnd);
  });
  // The callee's spans where no Python runs: begin(traceparent, name) ->
  // span or None, end(span, error) (torch_rpc_ext.tracing); None, None
  // clears. The functions are kept for the life of the process (never
  // released: a static's destructor would run without the GIL).
  m.def("_set_trace_serve_hook", [](py::object begin, py::object end) {
    if (begin.is_none()) {
      tracing::setServeHook(nullptr);
      return;
    }
    auto* beginFn = new py::object(std::move(begin));
    auto* endFn = new py::object(std::move(end));
    tracing::setServeHook(
        [beginFn, endFn](
            const std::string& traceparent,
            const std::string& name) -> std::unique_ptr<tracing::ServeSpan> {
          py::gil_scoped_acquire gil;
          try {
            py::object span = (*beginFn)(traceparent, name);
            if (span.is_none()) {
              return nullptr;
            }
            return std::make_unique<PyServeSpan>(endFn, std::move(span));
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("torch_rpc_ext tracing: beginning a span");
            return nullptr;
          }
        });
  });
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
  m.def("default_address", &transport::defaultAdvertisedAddress);
  // How allocations reach a landing pool here (landing_pool.h): "torch"
  // (torch's caching allocator), "test" (the fake's), or "" (neither: this
  // torch has no CUDA allocator, or this build could not reach it).
  m.def("_pool_routing", [] {
    if (torchPoolRouting() != nullptr) {
      return std::string("torch");
    }
    return std::string(poolRouting() != nullptr ? "test" : "");
  });
  m.def("_landing_pool_segments", [] {
    const auto c = landingSegmentCounts();
    py::dict d;
    d["live"] = c.live;
    d["live_bytes"] = c.liveBytes;
    d["made"] = c.made;
    d["freed"] = c.freed;
    d["failed"] = c.failed;
    return d;
  });
  // torch.distributed.rpc.api._invoke_rpc_builtin while an agent of ours is
  // current (builtin_call.h); for any other agent, the function it replaced
  // (_torch_private.install_builtin_frontend sets it first).
  m.def("_set_invoke_rpc_builtin_fallback", [](py::object fn) {
    *builtinFallback() = std::move(fn);
  });
  // torch.distributed.rpc.api._invoke_rpc likewise (invoke_rpc.h).
  m.def("_set_invoke_rpc_fallback", [](py::object fn) {
    invoke_rpc::setFallback(std::move(fn));
  });
  m.def(
      "_invoke_rpc",
      &invoke_rpc::invoke,
      py::arg("to"),
      py::arg("func"),
      py::arg("rpc_type"),
      py::arg("args") = py::none(),
      py::arg("kwargs") = py::none(),
      py::arg("rpc_timeout") = rpc::kUnsetRpcTimeout);
  m.def(
      "_invoke_rpc_builtin",
      [](const rpc::WorkerInfo& dst,
         const std::string& opName,
         float rpcTimeoutSeconds,
         const py::args& args,
         const py::kwargs& kwargs) -> py::object {
        if (!rpc::RpcAgent::isCurrentRpcAgentSet() ||
            !dynamic_cast<Agent*>(rpc::RpcAgent::getCurrentRpcAgent().get())) {
          const py::object& fallback = *builtinFallback();
          if (!fallback) {
            throw std::runtime_error(
                "torch_rpc_ext: _invoke_rpc_builtin called with no fallback "
                "for another agent");
          }
          return fallback(dst, opName, rpcTimeoutSeconds, *args, **kwargs);
        }
        return torch::jit::toPyObject(
            c10::IValue(
                builtin_call::send(
                    dst, opName, args, kwargs, rpcTimeoutSeconds)));
      });
}

} // namespace torch_rpc_ext::bindings
