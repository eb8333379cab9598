// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The torch internals a dynamic group must reach and torch offers no
// accessor for (docs/elastic.md, "Incarnations"). Each member is named in
// torch_private.cpp through an explicit template instantiation, where access
// is not checked: a torch that renames or retypes one fails to build; none
// depends on a layout guessed here.

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/rpc/rref_impl.h>
#include <torch/csrc/distributed/rpc/types.h>

namespace torch_rpc_ext::torch_private {

// How many incarnations of one rank fit in its id space (below).
constexpr int64_t kMaxGenerations = 4096;

// Make this process mint RRef, fork, autograd context and autograd message
// ids from the range of the `generation`-th holder of `rank` (1-based):
// torch derives them from the rank alone, so a new process on a reused rank
// would otherwise reissue its predecessor's ids, and an owner would hand it
// the predecessor's values. Counters only move forward.
void reserveIdRange(int rank, int64_t generation);

// The first RRef local id of `generation`'s range.
int64_t idRangeStart(int64_t generation);

// As the owner: forget the forks for which `heldBy(rrefId, forkId)` is true,
// as if their holder had deleted them; OwnerRRefs left with no fork are
// released. Called as a holder departs, before any later holder of its id
// can be admitted.
// OwnerRRefs holding Python values are handed to `releasePython`, which must
// drop them with the GIL held. Returns how many forks were dropped.
size_t dropForks(
    const std::function<bool(
        const torch::distributed::rpc::RRefId&,
        const torch::distributed::rpc::ForkId&)>& heldBy,
    const std::function<void(
        c10::intrusive_ptr<torch::distributed::rpc::RRef>)>& releasePython);

// As the owner: the forks of our RRefs that `forker` made (its own
// remote() calls, or, for us, our RRefs pickled into messages), with their
// RRef ids.
std::vector<
    std::pair<torch::distributed::rpc::RRefId, torch::distributed::rpc::ForkId>>
forksOf(torch::distributed::rpc::worker_id_t forker);

// The ids of the RRefs this process uses (UserRRefs, confirmed or not)
// that `owner` owns. The confirmed ones are read through weak references:
// each one found alive (any owner's) is kept in `held`, for the caller to
// drop outside the lock this reads under (the last reference deletes a
// user RRef, whose deletion takes that lock, and tells its owner).
std::vector<torch::distributed::rpc::RRefId> userRRefsOwnedBy(
    torch::distributed::rpc::worker_id_t owner,
    std::vector<c10::intrusive_ptr<torch::distributed::rpc::RRef>>& held);

// Forget the distributed autograd contexts whose id `drop` picks, as
// releasing them would, but without telling other workers (each releases
// its own). Returns how many were dropped.
size_t dropAutogradContexts(const std::function<bool(int64_t)>& drop);

} // namespace torch_rpc_ext::torch_private
