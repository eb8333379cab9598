// SPDX-License-Identifier: BSD-3-Clause
// The remote() creations an owner is serving, and the deletions that outran
// them.
//
// Torch registers a remote() call's fork with the owner's RRefContext only
// once the call has run (assignOwnerRRef, after the function returns). A
// caller whose remote() timed out, and which then dropped its RRef, sends
// its RRefUserDelete meanwhile: torch's owner finds no such fork and
// ignores the deletion (deletions are idempotent, to allow retries), and
// the fork registered afterwards is never deleted. Its OwnerRRef and value
// stay for the life of the process, and a graceful shutdown fails with
// "Leaking RRef" (upstream's test_rref_proxy_timeout, whose FIXME names the
// race for one of its cases, failed so in CI under load; TensorPipe has the
// same race). Here such a deletion is answered at once, kept, and applied
// as the creation ends.
//
// A creation counts from its request's decoding (ServeCallback's
// processMessage: plain, or wrapped for dist autograd or the legacy
// profiler) until torch's call returns. Not covered: a deletion served
// while its request is still being decoded (the caller timed out before
// the owner had even decoded it, and another loop thread took the
// deletion meanwhile), and, with the server-side process-global profiler
// on (upstream's path), one that arrives while the call waits for the
// RRefs among its arguments. A creation whose arguments are never
// confirmed keeps its entry (and deletions are then parsed twice).
#pragma once

#include <torch/csrc/distributed/rpc/types.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace torch_rpc_ext {

class RemoteCreations {
 public:
  // The creation of fork `forkId` of `rrefId` is being served, from its
  // decoding (a call waiting for the RRefs among its arguments included)
  // until torch's call returns, having registered the fork (an
  // @async_execution function's too, whose value comes later). Begins of
  // one fork nest (the decoding's, then the call's).
  void begin(
      const torch::distributed::rpc::RRefId& rrefId,
      const torch::distributed::rpc::ForkId& forkId);
  // One begin() of `forkId` ended. Once the last has, its fork is registered
  // if it ever will be: true if a deletion arrived meanwhile, for the caller
  // to apply now.
  bool end(const torch::distributed::rpc::ForkId& forkId);
  // A deletion of fork `forkId` of `rrefId` arrived: true if that creation
  // is being served, in which case it is kept for end(). (One naming
  // another RRef is served as usual: torch ignores it.)
  bool deferDeletion(
      const torch::distributed::rpc::RRefId& rrefId,
      const torch::distributed::rpc::ForkId& forkId);
  // Whether any creation is being served (a hint: deletions need not be
  // parsed otherwise).
  bool any() const {
    return serving_.load(std::memory_order_acquire) != 0;
  }
  // Deletions kept so far (rpc_ext.rref_deletions_before_creation).
  int64_t deferred() const {
    return deferred_.load(std::memory_order_relaxed);
  }

 private:
  struct Creation {
    torch::distributed::rpc::RRefId rrefId;
    int serving = 0;
    bool deleted = false;
  };
  std::mutex mutex_;
  std::unordered_map<
      torch::distributed::rpc::ForkId,
      Creation,
      torch::distributed::rpc::ForkId::Hash>
      creations_;
  std::atomic<size_t> serving_{0};
  std::atomic<int64_t> deferred_{0};
};

} // namespace torch_rpc_ext
