// SPDX-License-Identifier: BSD-3-Clause
#pragma once

namespace torch_rpc_ext {

// Ends the OpenMP thread team the calling thread made by running torch's
// intra-op parallel work (a Python UDF's tensor ops), if the process's
// OpenMP is GNU libgomp (torch's Linux wheels bundle it). Returns whether a
// release was made.
//
// libgomp keeps a team of worker threads per thread that has started a
// parallel region, for that thread's life, and once it manages more
// threads than there are CPUs it stops spinning between regions and puts
// every worker to sleep on a futex after each one: an op then costs a
// wake-up. A transport loop thread that served a long request hands the
// loop on and parks as a spare; the next request is served by the new
// leader, which makes a team of its own, so two teams alternate and every
// op of a tensor-heavy UDF pays (`heavy` on 4 MB: 11 -> 18-23 ms a call
// on 2 CPUs, docs/performance.md). A thread parking calls this, so only the
// thread serving now has a team: libgomp's omp_pause_resource_all frees the
// calling thread's team only (as its exit would). Other runtimes' pause
// (LLVM's libomp, Intel's) is process-wide, so they are left alone.
//
// The cost: the next long request's server makes its team anew (threads
// for torch's intra-op count less one), as before spares a whole new loop
// thread and its team were made at every hand-off.
bool releaseOpenMpTeam();

} // namespace torch_rpc_ext
