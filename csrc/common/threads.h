// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <thread>
#include <unordered_map>
#include <vector>

namespace torch_rpc_ext {

// Threads by id, as the thread pool and the transport loop keep them.
using ThreadsById = std::unordered_map<std::thread::id, std::thread>;

// Join and forget the threads listed in `finished` (each has left its work
// for good, so joining is prompt), then clear the list.
inline void reapFinished(ThreadsById& threads, std::vector<std::thread::id>& finished) {
  for (auto id : finished) {
    auto it = threads.find(id);
    if (it != threads.end()) {
      it->second.join();
      threads.erase(it);
    }
  }
  finished.clear();
}

} // namespace torch_rpc_ext
