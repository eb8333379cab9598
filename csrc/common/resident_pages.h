// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
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
//
// The reader holds `keepAlive` (the memory's owner) while it reads. The
// caller holds its own reference until the read is done or it abandon()s
// the read; the reader's is then never the last, so the owner is never let
// go on the reader's thread: it drops its reference before it says done,
// and keeps it for good (a leak, by design) if the caller abandoned a read
// that storage still holds (the caller's owner may be gone by the time it
// ends, and what it owns may be let go only where that owner's rules say).
class PageRead {
 public:
  // Starts reading [data, data + bytes) in (MADV_POPULATE_READ; a read of
  // each page only where the kernel has no such advice). Null if no thread
  // could be made: the caller reads them itself.
  static std::shared_ptr<PageRead> start(
      const void* data,
      uint64_t bytes,
      std::shared_ptr<void> keepAlive);

  // Whether the read is done (in, or failed: the caller's own read then
  // says why), waiting up to `timeout` for it.
  bool waitFor(std::chrono::milliseconds timeout);
  // The caller stops waiting, and may let its reference to the memory go.
  void abandon();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  bool abandoned_ = false;
};

} // namespace torch_rpc_ext
