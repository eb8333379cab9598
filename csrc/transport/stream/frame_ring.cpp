// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/stream/frame_ring.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"
#include "csrc/common/signal_socket.h"

namespace torch_rpc_ext::transport::stream {

namespace {

bool validCapacity(uint64_t capacity) {
  return capacity >= kMinFrameRingBytes && capacity <= kMaxFrameRingBytes &&
      capacity % 4096 == 0;
}

} // namespace

std::unique_ptr<FrameRing> FrameRing::create(uint64_t capacity) {
  if (!validCapacity(capacity)) {
    throw std::invalid_argument(
        "frame ring capacity " + std::to_string(capacity) + " is out of range");
  }
  std::unique_ptr<FrameRing> r(new FrameRing());
  r->memFd_ =
      ::memfd_create("torch_rpc_ext-frames", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r->memFd_ < 0) {
    throw std::runtime_error(errnoText("memfd_create failed"));
  }
  SignalPair pair = makeSignalPair();
  r->signalFd_ = pair.ours;
  r->peerSignalFd_ = pair.theirs;
  r->mapped_ = kFrameRingHeaderBytes + capacity;
  if (::ftruncate(r->memFd_, static_cast<off_t>(r->mapped_)) != 0) {
    throw std::runtime_error(errnoText("ftruncate failed"));
  }
  // The receiver checks the seal: shrinking the file under its mapping
  // would turn its reads into SIGBUS.
  if (::fcntl(r->memFd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    throw std::runtime_error(errnoText("sealing the frame ring failed"));
  }
  void* p = ::mmap(
      nullptr,
      r->mapped_,
      PROT_READ | PROT_WRITE,
      MAP_SHARED | MAP_POPULATE,
      r->memFd_,
      0);
  if (p == MAP_FAILED) {
    throw std::runtime_error(errnoText("mmap failed"));
  }
  r->base_ = static_cast<char*>(p);
  r->capacity_ = capacity;
  auto* h = new (r->base_) FrameRingHeader{};
  h->magic = kFrameRingMagic;
  h->capacity = capacity;
  return r;
}

std::unique_ptr<FrameRing> FrameRing::attach(
    int memFd,
    int signalFd,
    uint64_t capacity,
    std::string* error) {
  std::unique_ptr<FrameRing> r(new FrameRing());
  r->memFd_ = memFd;
  r->signalFd_ = signalFd;
  if (!validCapacity(capacity)) {
    *error =
        "frame ring capacity " + std::to_string(capacity) + " is out of range";
    return nullptr;
  }
  r->mapped_ = kFrameRingHeaderBytes + capacity;
  // The seals first: they fail at once for anything but shared memory,
  // where fstat() would ask the file's filesystem.
  struct stat st{};
  int seals = ::fcntl(memFd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstat(memFd, &st) != 0 ||
      !S_ISREG(st.st_mode) || uint64_t(st.st_size) < r->mapped_) {
    *error = "the peer's frame ring is not a sealed shared-memory file of " +
        std::to_string(r->mapped_) + " bytes";
    return nullptr;
  }
  // The signal descriptor must be a Unix stream socket (one end of the
  // ring's pair): we write to it and read from it, never anything else.
  if (!isSignalSocket(signalFd)) {
    *error = "the peer's frame ring signal is not a Unix stream socket";
    return nullptr;
  }
  void* p = ::mmap(
      nullptr,
      r->mapped_,
      PROT_READ | PROT_WRITE,
      MAP_SHARED | MAP_POPULATE,
      memFd,
      0);
  if (p == MAP_FAILED) {
    *error = errnoText("mmap of the peer's frame ring failed");
    return nullptr;
  }
  r->base_ = static_cast<char*>(p);
  r->capacity_ = capacity;
  if (r->header()->magic != kFrameRingMagic ||
      r->header()->capacity != capacity) {
    *error = "the peer's frame ring has a bad header";
    return nullptr;
  }
  // Where the sender starts: a ring is handed over before its first byte.
  r->position_ = 0;
  r->closeHandedOver(); // the mapping keeps the memory
  return r;
}

FrameRing::~FrameRing() {
  if (base_ != nullptr) {
    ::munmap(base_, mapped_);
  }
  // An attached ring's descriptors are the peer's (fd_closer.h); ours go
  // the same way.
  for (int fd : {memFd_, signalFd_, peerSignalFd_}) {
    closeOffThread(fd);
  }
}

void FrameRing::closeHandedOver() {
  for (int* fd : {&memFd_, &peerSignalFd_}) {
    closeOffThread(std::exchange(*fd, -1));
  }
}

bool FrameRing::signal() {
  return sendSignal(signalFd_);
}

SignalDrain FrameRing::drainSignals() {
  return torch_rpc_ext::drainSignals(signalFd_);
}

size_t FrameRing::room(std::string* error) {
  uint64_t tail = header()->tail.load(std::memory_order_acquire);
  if (tail < peerTail_ || tail > position_) {
    *error = "the peer's frame ring position is impossible (consumed " +
        std::to_string(tail) + " of " + std::to_string(position_) + ")";
    return 0;
  }
  peerTail_ = tail;
  return static_cast<size_t>(capacity_ - (position_ - tail));
}

size_t FrameRing::write(const iovec* iov, int n, size_t max, bool piecewise) {
  const size_t step = piecewise ? kFrameRingPublishStep : capacity_;
  size_t done = 0, published = 0;
  for (int i = 0; i < n && done < max; ++i) {
    const char* src = static_cast<const char*>(iov[i].iov_base);
    size_t len = std::min(iov[i].iov_len, max - done);
    while (len > 0) {
      size_t at = static_cast<size_t>((position_ + done) % capacity_);
      size_t take = std::min({len, static_cast<size_t>(capacity_ - at), step});
      std::memcpy(data() + at, src, take);
      src += take;
      len -= take;
      done += take;
      if (piecewise && done - published >= step) {
        // A piece at a time: a receiver awake copies this one out while we
        // copy in the next (one copy's time for the two, not two), and one
        // that parked meanwhile is woken now, not at the end of the write.
        // (A flag missed here is seen after the last store, as always.)
        published = done;
        header()->head.store(position_ + done, std::memory_order_seq_cst);
        wakeReceiver();
      }
    }
  }
  position_ += done;
  header()->head.store(position_, std::memory_order_seq_cst);
  return done;
}

bool FrameRing::wakeIfParked(std::atomic<uint32_t>& parked) {
  // Pairs with parkReceiver() / parkSender(): our counter was stored
  // seq_cst before this load, their flag seq_cst before their load of our
  // counter, so one of the two sees the other.
  if (parked.load(std::memory_order_seq_cst) != 0 &&
      parked.exchange(0, std::memory_order_seq_cst) != 0) {
    signal();
    return true;
  }
  return false;
}

size_t FrameRing::spinForRoom(
    std::chrono::nanoseconds spin,
    std::string* error) {
  const auto until = std::chrono::steady_clock::now() + spin;
  // The peer's flag is a hint only: at worst we spin `spin` for nothing.
  while (header()->receiverParked.load(std::memory_order_relaxed) == 0) {
    // As the loop's busy poll: this core to a runnable thread meanwhile,
    // on a small host often the receiver itself.
    ::sched_yield();
    size_t got = room(error);
    if (got > 0 || !error->empty() ||
        std::chrono::steady_clock::now() >= until) {
      return got;
    }
  }
  return 0;
}

bool FrameRing::spinForBytes(std::chrono::nanoseconds spin) {
  const auto until = std::chrono::steady_clock::now() + spin;
  do {
    ::sched_yield();
    if (waiting() != 0) {
      return true;
    }
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

bool FrameRing::parkSender() {
  header()->senderParked.store(1, std::memory_order_seq_cst);
  uint64_t tail = header()->tail.load(std::memory_order_seq_cst);
  return tail > peerTail_ && tail <= position_;
}

int64_t FrameRing::waitingAfter(uint64_t head) const {
  if (head < position_ || head - position_ > capacity_) {
    return -1;
  }
  return static_cast<int64_t>(head - position_);
}

int64_t FrameRing::read(
    void* dst,
    size_t size,
    std::string* error,
    bool piecewise) {
  const size_t step = piecewise ? kFrameRingPublishStep : capacity_;
  int64_t avail = waiting();
  if (avail < 0) {
    *error = "the peer's frame ring position is impossible (published " +
        std::to_string(header()->head.load()) + " after " +
        std::to_string(position_) + " consumed, in a ring of " +
        std::to_string(capacity_) + ")";
    return -1;
  }
  size_t want = std::min(size, static_cast<size_t>(avail));
  char* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < want) {
    size_t at = static_cast<size_t>((position_ + done) % capacity_);
    size_t take =
        std::min({want - done, static_cast<size_t>(capacity_ - at), step});
    std::memcpy(out + done, data() + at, take);
    done += take;
    if (piecewise && done < want) {
      // As write(): the sender refills this piece while we take the next.
      header()->tail.store(position_ + done, std::memory_order_release);
    }
  }
  if (done > 0) {
    position_ += done;
    header()->tail.store(position_, std::memory_order_seq_cst);
  }
  return static_cast<int64_t>(done);
}

bool FrameRing::parkReceiver() {
  // Pairs with wakeReceiver(): both the store and this load sequentially
  // consistent, so either this load sees the sender's head or the sender's
  // load sees the flag.
  header()->receiverParked.store(1, std::memory_order_seq_cst);
  // Bytes, or an impossible head to report.
  return waitingAfter(header()->head.load(std::memory_order_seq_cst)) != 0;
}

} // namespace torch_rpc_ext::transport::stream
