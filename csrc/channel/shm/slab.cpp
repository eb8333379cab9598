// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/shm/slab.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace torch_rpc_ext::channel::shm {

namespace {

constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_SEAL;

} // namespace

namespace {
std::atomic<uint64_t> g_slabBytesBound{kMaxSlabBytes};
} // namespace

uint64_t slabBytesBound() {
  return g_slabBytesBound.load(std::memory_order_relaxed);
}

void setSlabBytesBound(uint64_t bytes) {
  g_slabBytesBound.store(
      bytes == 0 ? kMaxSlabBytes : std::min(bytes, kMaxSlabBytes),
      std::memory_order_relaxed);
}

uint64_t slabCapacityFor(uint64_t segmentBytes) {
  if (segmentBytes > kSlabLargeGranule) {
    return (segmentBytes + kSlabLargeGranule - 1) / kSlabLargeGranule *
        kSlabLargeGranule;
  }
  uint64_t c = kSlabMinSegment;
  while (c < segmentBytes) {
    c *= 2;
  }
  return c;
}

std::shared_ptr<Slab> Slab::create(uint64_t capacity) {
  if (capacity == 0 || capacity % kSlabPage != 0) {
    throw std::invalid_argument(
        "slab capacity " + std::to_string(capacity) + " is not a multiple of " +
        std::to_string(kSlabPage));
  }
  std::shared_ptr<Slab> s(new Slab());
  const int fd =
      ::memfd_create("torch_rpc_ext-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  s->fd_.store(fd);
  if (fd < 0) {
    throw std::runtime_error(errnoText("memfd_create failed"));
  }
  if (::ftruncate(fd, static_cast<off_t>(capacity)) != 0) {
    throw std::runtime_error(errnoText("ftruncate of a slab failed"));
  }
  if (::fcntl(fd, F_ADD_SEALS, kRequiredSeals) != 0) {
    throw std::runtime_error(errnoText("sealing a slab failed"));
  }
  void* p =
      ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error(errnoText("mmap of a slab failed"));
  }
  s->base_ = static_cast<char*>(p);
  s->capacity_ = capacity;
  // One call allocates and maps every page: touching them one by one would
  // cost a fault each (shmem gets no huge pages here), 4x slower.
  if (::madvise(p, capacity, MADV_POPULATE_WRITE) != 0) {
    // Older kernels: the first copy takes the faults instead.
    logDebug(errnoText("MADV_POPULATE_WRITE on a slab failed"));
  }
  return s;
}

std::string Slab::attach(
    int fd,
    uint64_t capacity,
    std::shared_ptr<Slab>* out) {
  struct Closer {
    int fd;
    ~Closer() {
      closeOffThread(fd); // the peer's (fd_closer.h)
    }
  } closer{fd};
  if (capacity == 0 || capacity % kSlabPage != 0) {
    return "slab capacity " + std::to_string(capacity) +
        " is not a multiple of " + std::to_string(kSlabPage);
  }
  // Unsealed, the peer could shrink the file under our mapping later. The
  // seals first: they fail at once for anything but shared memory, where
  // fstat() would ask the file's filesystem.
  struct stat st{};
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kRequiredSeals) != kRequiredSeals ||
      ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      uint64_t(st.st_size) != capacity) {
    return "the peer's slab is not a sealed shared-memory file of " +
        std::to_string(capacity) + " bytes";
  }
  void* p =
      ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return errnoText("mmap of the peer's slab failed");
  }
  std::shared_ptr<Slab> s(new Slab());
  s->base_ = static_cast<char*>(p);
  s->capacity_ = capacity;
  *out = std::move(s);
  return {};
}

void Slab::closeFd() {
  const int fd = fd_.exchange(-1);
  if (fd >= 0) {
    ::close(fd);
  }
}

Slab::~Slab() {
  if (base_ != nullptr) {
    ::munmap(base_, capacity_);
  }
  closeFd();
}

} // namespace torch_rpc_ext::channel::shm
