// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Where the torch versions torch_rpc_ext builds against differ in the C++
// API it uses, and nowhere else: each difference is one inline function
// here, keyed on torch's own version macros, so the agent reads the same on
// every torch. The tested range is setup.py's TORCH_REQUIREMENT
// (docs/development.md, "Other torch versions").

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

#include <torch/csrc/profiler/orchestration/observer.h>

// True for torch `major.minor` and later.
#define TORCH_RPC_EXT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||                \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace torch_rpc_ext::torch_version {

// Whether a process-wide (global) profiler is running, as opposed to a
// thread-local one. torch 2.14 replaced ProfilerStateBase::get(global) with
// getGlobal(), which returns a shared_ptr.
inline bool globalProfilerActive() {
#if TORCH_RPC_EXT_TORCH_AT_LEAST(2, 14)
  return torch::profiler::impl::ProfilerStateBase::getGlobal() != nullptr;
#else
  return torch::profiler::impl::ProfilerStateBase::get(/*global=*/true) !=
      nullptr;
#endif
}

} // namespace torch_rpc_ext::torch_version
