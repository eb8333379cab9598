// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace torch_rpc_ext {

// Whether every page of [data, data + bytes) is in memory now (mincore); a
// page that is not would fault in from its file or swap, or be made, when
// read. True where the kernel cannot say (the caller just reads).
bool pagesResident(const void* data, uint64_t bytes);

// Pages read into memory on a thread of its own, so that the thread that
// needs them can do something else meanwhile (tcp_lanes: say it is alive
// while a memory-mapped tensor's pages come in from slow storage).
class PageRead {
 public:
  // Starts reading [data, data + bytes) in (MADV_POPULATE_READ, else a read
  // of each page), holding `keepAlive` (the memory's owner) until done, then
  // handing it to `letGo` on that thread (the owner may want it released
  // elsewhere). Null if no thread could be made: the caller reads them.
  static std::shared_ptr<PageRead> start(
      const void* data,
      uint64_t bytes,
      std::shared_ptr<void> keepAlive,
      std::function<void(std::shared_ptr<void>)> letGo);

  // Whether the pages are in, waiting up to `timeout` for them.
  bool waitFor(std::chrono::milliseconds timeout);

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
};

} // namespace torch_rpc_ext
