// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/resident_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <thread>
#include <vector>

namespace torch_rpc_ext {

namespace {

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 // Linux 5.14
#endif

uintptr_t pageSize() {
  static const uintptr_t size = [] {
    long s = ::sysconf(_SC_PAGESIZE);
    return s > 0 ? static_cast<uintptr_t>(s) : uintptr_t(4096);
  }();
  return size;
}

} // namespace

bool pagesResident(const void* data, uint64_t bytes) {
  if (bytes == 0) {
    return true;
  }
  const uintptr_t page = pageSize();
  const uintptr_t first = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
  const size_t pages = (end - first + page - 1) / page;
  thread_local std::vector<unsigned char> in;
  in.resize(pages);
  if (::mincore(reinterpret_cast<void*>(first), end - first, in.data()) != 0) {
    return true; // (not all mapped, or not asked: the read will say)
  }
  for (unsigned char c : in) {
    if ((c & 1) == 0) {
      return false;
    }
  }
  return true;
}

std::shared_ptr<PageRead> PageRead::start(
    const void* data,
    uint64_t bytes,
    std::shared_ptr<void> keepAlive) {
  auto read = std::make_shared<PageRead>();
  try {
    std::thread([read,
                 data,
                 bytes,
                 keepAlive = std::move(keepAlive)]() mutable {
      const uintptr_t page = pageSize();
      const uintptr_t first = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
      const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
      if (::madvise(
              reinterpret_cast<void*>(first),
              end - first,
              MADV_POPULATE_READ) != 0 &&
          errno == EINVAL) {
        // A kernel before 5.14 (or a mapping it does not populate so): each
        // page read once, a fault bringing it in. Not on other errors
        // (EFAULT, ENOMEM, EHWPOISON: a file truncated under its mapping,
        // memory gone): a read here would kill the process with SIGBUS or
        // SIGSEGV, where the caller's send fails with EFAULT.
        for (uintptr_t p = std::max(first, uintptr_t(data)); p < end;
             p = (p & ~(page - 1)) + page) {
          (void)*reinterpret_cast<const volatile char*>(p);
        }
      }
      std::lock_guard<std::mutex> lock(read->mutex_);
      if (read->abandoned_) {
        // Kept for good: its caller may have let go of the rest (class
        // comment). One per read that storage held past a close.
        static_cast<void>(new std::shared_ptr<void>(std::move(keepAlive)));
      } else {
        keepAlive.reset(); // (the caller still holds its own)
      }
      read->done_ = true;
      read->cv_.notify_all();
    }).detach();
  } catch (const std::exception&) {
    return nullptr;
  }
  return read;
}

bool PageRead::waitFor(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_for(lock, timeout, [&] { return done_; });
}

void PageRead::abandon() {
  std::lock_guard<std::mutex> lock(mutex_);
  abandoned_ = true; // (a read done already holds nothing)
}

} // namespace torch_rpc_ext
