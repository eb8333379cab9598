// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_rpc_ext {
struct MembershipEvent;
} // namespace torch_rpc_ext

namespace torch_rpc_ext::bindings {

namespace py = pybind11;

// In this order: bindAgent's signatures use bindOptions' type.
void bindOptions(py::module_& m);
void bindAgent(py::module_& m);
void bindTesting(py::module_& m);
// _testing.cuda: the CUDA driver layer and copy engine (bind_testing_cuda.cpp).
void bindTestingCuda(py::module_& m);
// _testing.cuda's grant source of plain driver memory (testing_grants.cpp).
void bindTestingGrants(py::module_& m);
void bindTestingEndpoint(py::module_& m);
// _testing.cuda's torch side: a CUDA device guard for a CPU torch.
void bindTestingCudaTorch(py::module_& m);
// _testing.agent: the agent's parts driven alone (Group, RRefGuard).
void bindTestingAgent(py::module_& m);
// The membership log (bind_testing_membership.cpp).
void bindTestingMembership(py::module_& m);
// A membership event as Python sees it: (kind, epoch, name, rank, reason).
py::tuple eventTuple(const MembershipEvent& ev);
// _C._scripting: the remote-function registry (scripting/).
void bindScripting(py::module_& m);
// Give every thread the core starts a Python thread state for its life.
void installThreadHooks();

} // namespace torch_rpc_ext::bindings
