// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing: the hooks of bind_testing.cpp as a module of their
// own, linked against _C (whose symbols it uses), built for the source tree
// only (TORCH_RPC_EXT_BUILD_TESTING=1) and never shipped in a wheel.
#include "csrc/bindings/bind.h"

PYBIND11_MODULE(_testing, m) {
  m.doc() = "torch_rpc_ext test hooks (source tree only)";
  torch_rpc_ext::bindings::bindTesting(m);
  torch_rpc_ext::bindings::bindTestingCuda(m);
  torch_rpc_ext::bindings::bindTestingEndpoint(m);
  torch_rpc_ext::bindings::bindTestingCudaTorch(m);
  torch_rpc_ext::bindings::bindTestingAgent(m);
  torch_rpc_ext::bindings::bindTestingMembership(m);
}
