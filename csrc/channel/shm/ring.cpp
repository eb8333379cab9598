// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/shm/ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"
#include "csrc/common/signal_socket.h"

namespace torch_rpc_ext::channel::shm {

Ring Ring::create(uint64_t capacity) {
  if (capacity < kMinRingBytes || capacity > kMaxRingBytes ||
      capacity % 4096 != 0) {
    throw std::invalid_argument(
        "ring capacity " + std::to_string(capacity) + " is out of range");
  }
  Ring r;
  r.fd_ = ::memfd_create("torch_rpc_ext-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r.fd_ < 0) {
    throw std::runtime_error(errnoText("memfd_create failed"));
  }
  SignalPair pair = makeSignalPair();
  r.wakeFd_ = pair.ours;
  r.peerWakeFd_ = pair.theirs;
  r.mapped_ = kRingHeaderBytes + capacity;
  if (::ftruncate(r.fd_, static_cast<off_t>(r.mapped_)) != 0) {
    throw std::runtime_error(errnoText("ftruncate failed"));
  }
  // The peer checks this seal: without it we could shrink the file under
  // its mapping later and turn its reads into SIGBUS.
  if (::fcntl(r.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    throw std::runtime_error(errnoText("sealing the ring failed"));
  }
  // Populated now, so the data path never takes a first-touch fault.
  void* p = ::mmap(
      nullptr,
      r.mapped_,
      PROT_READ | PROT_WRITE,
      MAP_SHARED | MAP_POPULATE,
      r.fd_,
      0);
  if (p == MAP_FAILED) {
    throw std::runtime_error(errnoText("mmap failed"));
  }
  r.base_ = static_cast<char*>(p);
  r.capacity_ = capacity;
  auto* h = new (r.base_) RingHeader{};
  h->magic = kRingMagic;
  h->capacity = capacity;
  h->consumed.store(0);
  h->writerWaiting.store(0);
  return r;
}

std::string Ring::attach(int fd, int wakeFd, uint64_t capacity, Ring* out) {
  Ring r;
  r.fd_ = fd;
  r.wakeFd_ = wakeFd;
  if (capacity < kMinRingBytes || capacity > kMaxRingBytes ||
      capacity % 4096 != 0) {
    return "ring capacity " + std::to_string(capacity) + " is out of range";
  }
  r.mapped_ = kRingHeaderBytes + capacity;
  // A smaller file would turn our reads past its end into SIGBUS, and so
  // would one the peer could shrink later: it must be sealed. The seals
  // first: they fail at once for anything but shared memory, where fstat()
  // would ask the file's filesystem (a FUSE one the peer serves could
  // leave it unanswered).
  struct stat st{};
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstat(fd, &st) != 0 ||
      !S_ISREG(st.st_mode) || uint64_t(st.st_size) < r.mapped_) {
    return "the peer's ring is not a sealed shared-memory file of " +
        std::to_string(r.mapped_) + " bytes";
  }
  // Its wake-up must be a Unix stream socket, which we signal with
  // MSG_DONTWAIT whatever its flags: a pipe or an eventfd would block our
  // write once the peer made it blocking and full.
  if (!isSignalSocket(wakeFd)) {
    return "the peer's ring wake-up is not a Unix stream socket";
  }
  void* p = ::mmap(
      nullptr,
      r.mapped_,
      PROT_READ | PROT_WRITE,
      MAP_SHARED | MAP_POPULATE,
      fd,
      0);
  if (p == MAP_FAILED) {
    return errnoText("mmap of the peer's ring failed");
  }
  r.base_ = static_cast<char*>(p);
  r.capacity_ = capacity;
  if (r.header()->magic != kRingMagic || r.header()->capacity != capacity) {
    return "the peer's ring has a bad header";
  }
  *out = std::move(r);
  return {};
}

Ring::Ring(Ring&& other) noexcept {
  *this = std::move(other);
}

Ring& Ring::operator=(Ring&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    wakeFd_ = std::exchange(other.wakeFd_, -1);
    peerWakeFd_ = std::exchange(other.peerWakeFd_, -1);
    base_ = std::exchange(other.base_, nullptr);
    mapped_ = std::exchange(other.mapped_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    position_ = std::exchange(other.position_, 0);
  }
  return *this;
}

Ring::~Ring() {
  release();
}

void Ring::release() {
  if (base_ != nullptr) {
    ::munmap(base_, mapped_);
    base_ = nullptr;
  }
  // An attached ring's descriptors are the peer's (fd_closer.h); ours go
  // the same way.
  for (int* fd : {&fd_, &wakeFd_, &peerWakeFd_}) {
    closeOffThread(std::exchange(*fd, -1));
  }
}

SignalDrain Ring::drainWakeups() {
  return drainSignals(wakeFd_);
}

bool Ring::drained() const {
  return header()->consumed.load(std::memory_order_acquire) == position_;
}

size_t Ring::produce(
    const void* src,
    size_t size,
    size_t maxChunk,
    ChunkRecord* record,
    std::string* error) {
  RingHeader* h = header();
  uint64_t consumed = h->consumed.load(std::memory_order_acquire);
  if (consumed > position_ || position_ - consumed > capacity_) {
    *error = "the peer corrupted the shared ring (consumed position " +
        std::to_string(consumed) + ", produced " + std::to_string(position_) +
        ")";
    return 0;
  }
  uint64_t space = capacity_ - (position_ - consumed);
  if (space == 0) {
    // Ask for a wake-up, then look again: the consumer may have released
    // space between our load and the flag (it clears the flag after
    // publishing its position, so one of us sees the other).
    h->writerWaiting.store(1, std::memory_order_seq_cst);
    consumed = h->consumed.load(std::memory_order_seq_cst);
    space = capacity_ - (position_ - consumed);
    if (space == 0) {
      return 0;
    }
  }
  uint64_t offset = position_ % capacity_;
  size_t n = static_cast<size_t>(std::min<uint64_t>(
      {space, capacity_ - offset, uint64_t(size), uint64_t(maxChunk)}));
  std::memcpy(data() + offset, src, n);
  position_ += n;
  record->offset = offset;
  record->length = n;
  return n;
}

std::string Ring::consume(
    const ChunkRecord& record,
    void* dst,
    size_t dstRoom) {
  uint64_t offset = position_ % capacity_;
  if (record.offset != offset || record.length == 0 ||
      record.length > capacity_ - offset || record.length > dstRoom) {
    return "bad ring chunk record (offset " + std::to_string(record.offset) +
        ", length " + std::to_string(record.length) + ")";
  }
  std::memcpy(dst, data() + offset, record.length);
  position_ += record.length;
  RingHeader* h = header();
  h->consumed.store(position_, std::memory_order_seq_cst);
  if (h->writerWaiting.exchange(0, std::memory_order_seq_cst) != 0) {
    // Never blocks (MSG_DONTWAIT, whatever the producer did to the end it
    // handed us). A producer that has closed its end has dropped the ring:
    // nobody is left to wake.
    (void)sendSignal(wakeFd_);
  }
  return {};
}

} // namespace torch_rpc_ext::channel::shm
