// SPDX-License-Identifier: BSD-3-Clause
// remote_creations.h.
#include "csrc/agent/remote_creations.h"

namespace torch_rpc_ext {

void RemoteCreations::begin(
    const torch::distributed::rpc::RRefId& rrefId,
    const torch::distributed::rpc::ForkId& forkId) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, added] = creations_.try_emplace(forkId, Creation{rrefId});
  if (added) {
    serving_.fetch_add(1, std::memory_order_release);
  }
  ++it->second.serving;
}

bool RemoteCreations::end(const torch::distributed::rpc::ForkId& forkId) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = creations_.find(forkId);
  if (it == creations_.end() || --it->second.serving > 0) {
    return false;
  }
  const bool deleted = it->second.deleted;
  creations_.erase(it);
  serving_.fetch_sub(1, std::memory_order_release);
  return deleted;
}

bool RemoteCreations::deferDeletion(
    const torch::distributed::rpc::RRefId& rrefId,
    const torch::distributed::rpc::ForkId& forkId) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = creations_.find(forkId);
  if (it == creations_.end() || !(it->second.rrefId == rrefId)) {
    return false;
  }
  it->second.deleted = true;
  deferred_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

} // namespace torch_rpc_ext
