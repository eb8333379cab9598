// SPDX-License-Identifier: BSD-3-Clause
#include <cstdlib>

#include "csrc/bindings/bind.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/log_route.h"
#include "csrc/frame/frame.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_rpc_ext native core";
  torch_rpc_ext::bindings::installThreadHooks();
  // C's exit() (after Python's finalisation, or called directly) runs this
  // before the destructors of libtorch's statics, which were made before us.
  std::atexit([] { torch_rpc_ext::ExitGate::close(); });
  // Python's atexit runs before finalisation ends Python threads; see
  // torch_rpc_ext/__init__.py.
  m.def(
      "_close_exit_gate",
      [] { torch_rpc_ext::ExitGate::close(); },
      py::call_guard<py::gil_scoped_release>());
  // torch_rpc_ext.logs: lines routed to Python's logging (logging.h).
  m.def(
      "_logs_route",
      &torch_rpc_ext::routeLogs,
      py::arg("on"),
      py::arg("debug"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_logs_take",
      [](size_t max, int timeoutMs) {
        uint64_t dropped = 0;
        std::vector<torch_rpc_ext::LogLine> records;
        {
          py::gil_scoped_release release;
          records = torch_rpc_ext::takeLogs(max, timeoutMs, &dropped);
        }
        // Bytes a peer put in a line need not be UTF-8 ("replace"); only
        // memory running out makes the decode fail.
        auto text = [](const std::string& bytes) {
          PyObject* str = PyUnicode_DecodeUTF8(
              bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace");
          if (str == nullptr) {
            throw py::error_already_set();
          }
          return py::reinterpret_steal<py::str>(str);
        };
        py::list out;
        for (const auto& r : records) {
          out.append(
              py::make_tuple(
                  r.level, r.unixNs, text(r.worker), text(r.message)));
        }
        return py::make_tuple(out, dropped);
      },
      py::arg("max"),
      py::arg("timeout_ms"));
  m.def(
      "_log_line",
      [](int level, int64_t unixNs, std::string worker, std::string message) {
        return torch_rpc_ext::formatLogLine(
            {level, unixNs, std::move(worker), std::move(message)});
      },
      py::arg("level"),
      py::arg("unix_ns"),
      py::arg("worker"),
      py::arg("message"));
  m.def("_log_settings_error", &torch_rpc_ext::logSettingsError);
  m.def(
      "_log",
      &torch_rpc_ext::logLineOf,
      py::arg("level"),
      py::arg("worker"),
      py::arg("line"),
      py::call_guard<py::gil_scoped_release>());
  torch_rpc_ext::bindings::bindOptions(m);
  torch_rpc_ext::bindings::bindAgent(m);
  auto scripting = m.def_submodule(
      "_scripting", "the remote-function registry (torch_rpc_ext.scripting)");
  torch_rpc_ext::bindings::bindScripting(scripting);
  // The wire's identity, for torch_rpc_ext.testing's raw client. The test
  // hooks are a module of their own (testing_module.cpp).
  m.attr("FRAME_MAGIC") = torch_rpc_ext::frame::kFrameMagic;
  m.attr("PROTOCOL_VERSION") = torch_rpc_ext::frame::kProtocolVersion;
  // Channel i of channel_names() has the control-frame kinds from
  // FIRST_CHANNEL_FRAME_KIND + i * FRAME_KINDS_PER_CHANNEL (frame.h).
  m.attr("FIRST_CHANNEL_FRAME_KIND") =
      torch_rpc_ext::frame::kFirstChannelFrameKind;
  m.attr("FRAME_KINDS_PER_CHANNEL") =
      torch_rpc_ext::frame::kFrameKindsPerChannel;
}
