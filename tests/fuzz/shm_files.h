// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// What a hostile peer of the shm transport can hand us over SCM_RIGHTS, for
// the ring and slab targets: memfds of any size with any set of seals, and
// descriptors that are not shared-memory files at all.

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>

#include "csrc/common/fd_closer.h"
#include "tests/fuzz/fuzz_input.h"

namespace torch_rpc_ext::fuzz {

// Bounded so that every execution stays fast and small.
constexpr uint64_t kMaxFileBytes = (uint64_t(2) << 20) + 8192;

enum class FileKind : uint8_t {
  kSealedMemfd, // F_SEAL_SHRINK | F_SEAL_SEAL, as our own rings and slabs
  kShrinkSealOnly, // F_SEAL_SHRINK
  kSealSealOnly, // F_SEAL_SEAL: can still shrink
  kUnsealed,
  kGrowSealed, // F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
  kWriteSealed, // + F_SEAL_WRITE: no shared writable mapping possible
  kFutureWriteSealed, // + F_SEAL_FUTURE_WRITE
  kNoSealingMemfd, // created without MFD_ALLOW_SEALING
  kEventfd,
  kPipe,
  kClosed, // -1
  kCount,
};

inline bool hasSeal(int fd, int seal) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & seal) == seal;
}

// A descriptor of `kind`; a memfd is `size` bytes, filled with `contents`
// from offset 0 before any seal is applied. -1 for kClosed (or when the
// kernel refuses, which the target treats like a closed descriptor).
inline int makePeerFile(
    FileKind kind,
    uint64_t size,
    const std::string& contents) {
  switch (kind) {
    case FileKind::kEventfd:
      return ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    case FileKind::kPipe: {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) {
        return -1;
      }
      ::close(p[1]);
      return p[0];
    }
    case FileKind::kClosed:
    case FileKind::kCount:
      return -1;
    default:
      break;
  }
  unsigned flags = MFD_CLOEXEC;
  if (kind != FileKind::kNoSealingMemfd) {
    flags |= MFD_ALLOW_SEALING;
  }
  int fd = ::memfd_create("fuzz-peer-file", flags);
  if (fd < 0) {
    return -1;
  }
  if (::ftruncate(fd, off_t(size)) != 0) {
    ::close(fd);
    return -1;
  }
  if (!contents.empty()) {
    size_t n = std::min<uint64_t>(contents.size(), size);
    if (n > 0 && ::pwrite(fd, contents.data(), n, 0) != ssize_t(n)) {
      ::close(fd);
      return -1;
    }
  }
  int seals = 0;
  switch (kind) {
    case FileKind::kSealedMemfd:
      seals = F_SEAL_SHRINK | F_SEAL_SEAL;
      break;
    case FileKind::kShrinkSealOnly:
      seals = F_SEAL_SHRINK;
      break;
    case FileKind::kSealSealOnly:
      seals = F_SEAL_SEAL;
      break;
    case FileKind::kGrowSealed:
      seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
      break;
    case FileKind::kWriteSealed:
      seals = F_SEAL_SHRINK | F_SEAL_WRITE | F_SEAL_SEAL;
      break;
    case FileKind::kFutureWriteSealed:
      seals = F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
      break;
    default:
      break;
  }
  if (seals != 0 && ::fcntl(fd, F_ADD_SEALS, seals) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline bool isOpen(int fd) {
  return fd >= 0 && ::fcntl(fd, F_GETFD) != -1;
}

// The peer's descriptors are closed on a closer thread (fd_closer.h): true
// once it has closed all it was handed, so isOpen() can be asked.
inline bool closedOffThread() {
  return waitForFdClosers(std::chrono::seconds(10));
}

} // namespace torch_rpc_ext::fuzz
