// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/bindings/bind.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_rpc_ext native core";
  torch_rpc_ext::bindings::installThreadHooks();
  torch_rpc_ext::bindings::bindOptions(m);
  torch_rpc_ext::bindings::bindAgent(m);
  auto testing = m.def_submodule("_testing", "hooks for tests only");
  torch_rpc_ext::bindings::bindTesting(testing);
}
