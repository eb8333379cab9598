// SPDX-License-Identifier: BSD-3-Clause
// _C._scripting: registering remote functions (scripting/registry.h). A
// Python function becomes a registry Body here, since only this layer may
// touch Python: the Body takes the GIL, converts the call's values to Python
// objects and the result back, and turns a Python exception into the text
// its caller sees ("ValueError: ...").
#include <torch/csrc/jit/python/pybind_utils.h>

#include "csrc/bindings/bind.h"
#include "scripting/registry.h"

namespace torch_rpc_ext::bindings {

namespace {

using scripting::RemoteFunctions;

// "<type>: <message> (remote function '<name>' on <worker>)", from the
// Python exception being handled; GIL held.
std::string describe(const py::error_already_set& e, const std::string& name) {
  std::string type =
      py::handle(e.type()).attr("__qualname__").cast<std::string>();
  std::string message = py::str(e.value()).cast<std::string>();
  return type + ": " + message + " (remote function '" + name + "' on " +
      scripting::currentWorker() + ")";
}

scripting::Body pythonBody(py::function fn, std::string name) {
  // The function may be dropped on a thread without the GIL.
  std::shared_ptr<py::object> held(
      new py::object(std::move(fn)), [](py::object* o) {
        py::gil_scoped_acquire gil;
        delete o;
      });
  return [held, name](std::vector<c10::IValue>& args) -> c10::IValue {
    py::gil_scoped_acquire gil;
    try {
      py::tuple pyArgs(args.size());
      for (size_t i = 0; i < args.size(); ++i) {
        pyArgs[i] = torch::jit::toPyObject(std::move(args[i]));
      }
      py::object out = (*held)(*pyArgs);
      std::string why;
      try {
        // AnyType: the value's own type, inferred as TorchScript would.
        return torch::jit::toIValue(out, c10::AnyType::get());
      } catch (const c10::Error& e) {
        why = e.what_without_backtrace();
      } catch (const std::exception& e) {
        why = e.what();
      }
      throw std::runtime_error(
          c10::str(
              "TypeError: remote function '",
              name,
              "' on ",
              scripting::currentWorker(),
              " returned a value of type '",
              py::str(py::type::handle_of(out).attr("__name__"))
                  .cast<std::string>(),
              "', which TorchScript cannot represent (",
              why,
              ")"));
    } catch (py::error_already_set& e) {
      throw std::runtime_error(describe(e, name));
    }
  };
}

} // namespace

void bindScripting(py::module_& m) {
  m.def(
      "register_python",
      [](const std::string& name, py::function fn) {
        RemoteFunctions::instance().add(
            name, pythonBody(std::move(fn), name), "python");
      },
      py::arg("name"),
      py::arg("fn"));
  m.def(
      "register_script",
      [](const std::string& name, torch::jit::StrongFunctionPtr fn) {
        RemoteFunctions::instance().addScript(name, std::move(fn));
      },
      py::arg("name"),
      py::arg("fn"));
  m.def(
      "unregister",
      [](const std::string& name) {
        return RemoteFunctions::instance().remove(name);
      },
      py::arg("name"));
  m.def("registered", [] { return RemoteFunctions::instance().list(); });
  m.def("check_name", &scripting::checkName, py::arg("name"));
  m.def(
      "compiled_arguments",
      [](const std::vector<at::Tensor>& tensors, const std::string& constants) {
        py::list out;
        for (auto& v : scripting::compiledArguments(tensors, constants)) {
          out.append(torch::jit::toPyObject(std::move(v)));
        }
        return out;
      },
      py::arg("tensors"),
      py::arg("constants"));
}

} // namespace torch_rpc_ext::bindings
