// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/held_gil.h"

#include <Python.h>
#include <pybind11/pybind11.h>

namespace torch_rpc_ext::held_gil {

namespace {
thread_local bool inHold = false;
} // namespace

Hold::Hold() : outer_(inHold) {
  inHold = true;
}

Hold::~Hold() {
  inHold = outer_;
}

std::shared_ptr<torch::distributed::rpc::TypeResolver> resolverFreeingTheGil(
    std::shared_ptr<torch::distributed::rpc::TypeResolver> inner) {
  if (!inner) {
    return inner;
  }
  return std::make_shared<torch::distributed::rpc::TypeResolver>(
      [inner](const c10::QualifiedName& name) {
        // (A callback in the hold may have let the GIL go already.)
        if (inHold && PyGILState_Check()) {
          pybind11::gil_scoped_release free;
          return (*inner)(name);
        }
        return (*inner)(name);
      });
}

} // namespace torch_rpc_ext::held_gil
