// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/torch_private.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/autograd/context/container.h>
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/distributed/rpc/rref_context.h>

namespace torch_rpc_ext::torch_private {

namespace {

namespace rpc = torch::distributed::rpc;
using torch::distributed::autograd::DistAutogradContainer;

// The access idiom: an explicit instantiation may name private members, and
// the friend it defines hands the pointer out. One tag per member.
template <typename Tag, typename Tag::type Member>
struct Reach {
  friend typename Tag::type reach(Tag) {
    return Member;
  }
};

struct NextLocalId {
  using type = std::atomic<rpc::local_id_t>*;
  friend type reach(NextLocalId);
};
template struct Reach<NextLocalId, &rpc::RRefContext::nextLocalId_>;

struct Forks {
  using type = std::unordered_map<
      rpc::RRefId,
      std::unordered_set<rpc::ForkId, rpc::ForkId::Hash>,
      rpc::RRefId::Hash>
      rpc::RRefContext::*;
  friend type reach(Forks);
};
template struct Reach<Forks, &rpc::RRefContext::forks_>;

struct ContextMutex {
  using type = std::mutex rpc::RRefContext::*;
  friend type reach(ContextMutex);
};
template struct Reach<ContextMutex, &rpc::RRefContext::mutex_>;

struct NextContextId {
  using type = std::atomic<int64_t> DistAutogradContainer::*;
  friend type reach(NextContextId);
};
template struct Reach<NextContextId, &DistAutogradContainer::next_context_id_>;

struct NextMessageId {
  using type = std::atomic<int64_t> DistAutogradContainer::*;
  friend type reach(NextMessageId);
};
template struct Reach<
    NextMessageId,
    &DistAutogradContainer::next_autograd_message_id_>;

// The container's shards of contexts: their type is private too, so this
// one is reached through a deduced type rather than named.
template <typename Tag, auto Member>
struct ReachDeduced {
  friend auto reachDeduced(Tag) {
    return Member;
  }
};

struct Contexts {
  friend auto reachDeduced(Contexts);
};
template struct ReachDeduced<
    Contexts,
    &DistAutogradContainer::autograd_contexts_>;

struct PendingUsers {
  friend auto reachDeduced(PendingUsers);
};
template struct ReachDeduced<PendingUsers, &rpc::RRefContext::pendingUsers_>;

struct ConfirmedUsers {
  friend auto reachDeduced(ConfirmedUsers);
};
template struct ReachDeduced<
    ConfirmedUsers,
    &rpc::RRefContext::confirmedUsers_>;

// Ids below 2^36 per generation: 68 billion RRefs, forks and autograd
// contexts per process lifetime, 4096 generations in torch's 48 bits.
constexpr int kGenerationShift = 36;

void advanceTo(std::atomic<int64_t>& counter, int64_t floor) {
  int64_t cur = counter.load();
  while (cur < floor && !counter.compare_exchange_weak(cur, floor)) {
  }
}

} // namespace

int64_t idRangeStart(int64_t generation) {
  return generation << kGenerationShift;
}

void reserveIdRange(int rank, int64_t generation) {
  TORCH_CHECK(
      generation >= 1 && generation < kMaxGenerations,
      "rank ",
      rank,
      " has been taken ",
      generation,
      " times in this group, more than the ",
      kMaxGenerations - 1,
      " whose ids torch_rpc_ext can keep apart");
  advanceTo(*reach(NextLocalId{}), idRangeStart(generation));
  // Autograd ids are (worker id << 48) + a counter; this holder's counter
  // starts at its generation's range.
  auto& container = DistAutogradContainer::getInstance();
  const int64_t floor =
      (static_cast<int64_t>(rank) << 48) + idRangeStart(generation);
  advanceTo(container.*reach(NextContextId{}), floor);
  advanceTo(container.*reach(NextMessageId{}), floor);
}

std::vector<std::pair<rpc::RRefId, rpc::ForkId>> forksOf(
    rpc::worker_id_t forker) {
  auto& ctx = rpc::RRefContext::getInstance();
  std::vector<std::pair<rpc::RRefId, rpc::ForkId>> out;
  std::lock_guard<std::mutex> lock(ctx.*reach(ContextMutex{}));
  for (const auto& [rrefId, forks] : ctx.*reach(Forks{})) {
    for (const auto& forkId : forks) {
      if (forkId.createdOn_ == forker) {
        out.emplace_back(rrefId, forkId);
      }
    }
  }
  return out;
}

size_t dropForks(
    const std::function<bool(const rpc::RRefId&, const rpc::ForkId&)>& heldBy,
    const std::function<void(c10::intrusive_ptr<rpc::RRef>)>& releasePython) {
  auto& ctx = rpc::RRefContext::getInstance();
  std::vector<std::pair<rpc::RRefId, rpc::ForkId>> held;
  {
    std::lock_guard<std::mutex> lock(ctx.*reach(ContextMutex{}));
    for (const auto& [rrefId, forks] : ctx.*reach(Forks{})) {
      for (const auto& forkId : forks) {
        if (heldBy(rrefId, forkId)) {
          held.emplace_back(rrefId, forkId);
        }
      }
    }
  }
  for (const auto& [rrefId, forkId] : held) {
    // As the owner does when a RRefUserDelete arrives (idempotent).
    auto owner = ctx.delForkOfOwner(rrefId, forkId);
    if (owner && owner->isPyObj()) {
      releasePython(std::move(owner));
    }
  }
  return held.size();
}

} // namespace torch_rpc_ext::torch_private

namespace torch_rpc_ext::torch_private {

size_t dropAutogradContexts(const std::function<bool(int64_t)>& drop) {
  auto& container = DistAutogradContainer::getInstance();
  auto& shards = container.*reachDeduced(Contexts{});
  size_t n = 0;
  for (auto& shard : shards) {
    // Destroyed outside the shard's lock: a context's destructor may take
    // locks of its own.
    std::vector<torch::distributed::autograd::ContextPtr> dropped;
    {
      std::lock_guard<std::mutex> lock(shard.lock);
      for (auto it = shard.contexts.begin(); it != shard.contexts.end();) {
        if (drop(it->first)) {
          dropped.push_back(std::move(it->second));
          it = shard.contexts.erase(it);
        } else {
          ++it;
        }
      }
    }
    n += dropped.size();
  }
  return n;
}

} // namespace torch_rpc_ext::torch_private

namespace torch_rpc_ext::torch_private {

namespace {

// Tests only (tests/rpc/test_elastic.py): TORCH_RPC_EXT_TEST_STALE_SCAN_PAUSE
// = "<ms>:<path>": userRRefsOwnedBy, holding a user RRef it found, creates
// <path> and waits <ms> before it goes on (once per process), so that a
// test can drop its own last reference meanwhile.
void pauseInScanForTesting() {
  static std::atomic<bool> paused{false};
  const char* spec = std::getenv("TORCH_RPC_EXT_TEST_STALE_SCAN_PAUSE");
  if (spec == nullptr || paused.exchange(true)) {
    return;
  }
  const std::string text(spec);
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    return;
  }
  std::ofstream(text.substr(colon + 1)) << "paused\n";
  std::this_thread::sleep_for(
      std::chrono::milliseconds(std::atoi(text.substr(0, colon).c_str())));
}

} // namespace

std::vector<rpc::RRefId> userRRefsOwnedBy(
    rpc::worker_id_t owner,
    std::vector<c10::intrusive_ptr<rpc::RRef>>& held) {
  auto& ctx = rpc::RRefContext::getInstance();
  std::vector<rpc::RRefId> ids;
  std::lock_guard<std::mutex> lock(ctx.*reach(ContextMutex{}));
  for (const auto& [forkId, state] : ctx.*reachDeduced(PendingUsers{})) {
    if (state && state->rref_ && state->rref_->owner() == owner) {
      ids.push_back(state->rref_->rrefId());
    }
  }
  for (const auto& [forkId, weak] : ctx.*reachDeduced(ConfirmedUsers{})) {
    // Every reference locked here, whoever owns the RRef, is kept until
    // the lock is let go: a user thread may drop its last reference while
    // we hold this one, and ours would then delete the RRef under this
    // lock, which torch's delUser takes again once its delete message is
    // sent: a deadlock of every RRef call of the process, for an RRef of a
    // live owner (the departed owner's send throws first). Found by
    // helpers' readings in session 94; torch's own destroyInstance moves
    // such references out of its lock likewise.
    auto rref = weak.lock();
    if (!rref) {
      continue;
    }
    pauseInScanForTesting();
    if (rref->owner() == owner) {
      ids.push_back(rref->rrefId());
    }
    held.push_back(std::move(rref));
  }
  return ids;
}

} // namespace torch_rpc_ext::torch_private
