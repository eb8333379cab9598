// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes the shm_ring channel's ring, shm::Ring (csrc/channel/shm/ring.h),
// from the side a hostile peer reaches. Two modes:
//  * attach: Ring::attach on a descriptor the peer chose (a memfd of any
//    size with any seals and any header contents, or no shared-memory file
//    at all), an announced capacity and a wake-up descriptor (one end of a
//    socket pair, its other end open or closed or made blocking and full,
//    an eventfd, a saturated eventfd, a pipe, or none);
//  * loopback: a ring of ours (Ring::create) with a consumer attached to it,
//    the producer side included, so produce() meets a `consumed` position
//    the peer rewrote.
// Once attached, a sequence of operations: consume() of the next honest
// chunk record or of a fuzzed one, the peer rewriting the shared header
// (magic, capacity, consumed, writerWaiting) or data, growing or trying to
// shrink the file, and (loopback) produce().
//
// Input: uint8 mode (bit 0: loopback); attach mode: uint8 file kind, uint8
// wake-up kind, capacity (uint8 selector and operand), file size (uint8
// selector and operand), header (uint8 selector, then the fields it leaves
// to the input); loopback: uint8 capacity selector. Then up to kMaxOps
// operations, a uint8 op and its operands each (see the switch below).
//
// A finding: a sanitizer report or a crash (SIGBUS included); attach
// accepting a file that is not a sealed memfd of at least header + capacity
// bytes with the right magic and capacity, or a wake-up that is not a Unix
// stream socket (an eventfd or a pipe shares its flags and fill with the
// peer, who could make our write block), or refusing one that is; consume
// accepting a record that does not start at the consumer's position, is
// empty or does not fit (the ring or the destination), or refusing an
// honest one; copied bytes that differ from the ring's; a consumer position
// or wake-up flag not published, a waiting producer not signalled, a
// producer's drain that blocks, leaves signals behind or misses a consumer
// that shut its end down (loopback); produce()
// writing outside the data area, past the space the consumer released, or on
// from an impossible consumer position without an error; a descriptor left open
// after the ring is gone.

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "csrc/channel/shm/ring.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/shm_files.h"

namespace torch_rpc_ext::fuzz {
namespace {

using channel::shm::ChunkRecord;
using channel::shm::kMaxRingBytes;
using channel::shm::kMinRingBytes;
using channel::shm::kRingHeaderBytes;
using channel::shm::kRingMagic;
using channel::shm::Ring;
using channel::shm::RingHeader;

constexpr size_t kMaxOps = 64;
constexpr uint64_t kCapacities[] = {
    kMinRingBytes,
    kMinRingBytes + 4096,
    2 * kMinRingBytes,
    4 * kMinRingBytes,
    uint64_t(1) << 20};

enum class WakeKind : uint8_t {
  kSocket, // one end of a socket pair (the only kind attach takes)
  kSocketPeerGone, // ... whose other end is closed: a signal finds no one
  kSocketBlockingFull, // ... made blocking by the peer, its buffer full
  kEventfd,
  kSaturatedEventfd, // counter at its maximum: a write would block
  kPipe, // the read end: writing fails
  kClosed,
  kCount,
};

uint64_t capacityFrom(FuzzInput& in) {
  uint8_t sel = in.take<uint8_t>();
  uint64_t table = kCapacities[(sel >> 2) % std::size(kCapacities)];
  switch (sel & 3) {
    case 0:
      return table;
    case 1:
      return in.take<uint64_t>();
    case 2:
      return uint64_t(4096) * in.take<uint16_t>();
    default:
      return table + uint64_t(int64_t(in.take<int16_t>()));
  }
}

uint64_t fileSizeFrom(FuzzInput& in, uint64_t capacity) {
  uint64_t exact =
      capacity > kMaxFileBytes ? kMaxFileBytes : kRingHeaderBytes + capacity;
  uint8_t sel = in.take<uint8_t>();
  uint64_t size;
  switch (sel & 3) {
    case 0:
      size = exact;
      break;
    case 1: {
      uint64_t d = in.take<uint16_t>();
      size = d > exact ? 0 : exact - d;
      break;
    }
    case 2:
      size = exact + in.take<uint16_t>();
      break;
    default:
      size = in.take<uint32_t>();
      break;
  }
  return std::min(size, kMaxFileBytes);
}

// The peer's view of a ring file: its own writable mapping, when it can
// have one.
struct PeerMapping {
  int fd = -1;
  char* base = nullptr;
  size_t size = 0;

  void map(int f) {
    fd = f;
    struct stat st{};
    if (f < 0 || ::fstat(f, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_size < off_t(sizeof(RingHeader))) {
      return;
    }
    void* p = ::mmap(
        nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    if (p != MAP_FAILED) {
      base = static_cast<char*>(p);
      size = size_t(st.st_size);
    }
  }
  ~PeerMapping() {
    if (base != nullptr) {
      ::munmap(base, size);
    }
  }
  RingHeader* header() const {
    return reinterpret_cast<RingHeader*>(base);
  }
  // The data byte at `offset`, if mapped.
  const char* data(uint64_t offset, uint64_t n) const {
    if (base == nullptr || kRingHeaderBytes + offset + n > size) {
      return nullptr;
    }
    return base + kRingHeaderBytes + offset;
  }
};

struct Consumer {
  Ring ring;
  uint64_t capacity = 0;
  uint64_t position = 0; // what the ring must have consumed so far
  int memFd = -1;
  int wakeFd = -1;
  WakeKind wakeKind = WakeKind::kSocket;
  int wakeDup = -1; // the producer's end of the wake-up pair, when open
};

// The signals waiting at the producer's end (read, so the next counts anew).
size_t signalCount(int fd) {
  char bytes[256];
  ssize_t n = fd < 0 ? -1 : ::recv(fd, bytes, sizeof(bytes), MSG_DONTWAIT);
  return n > 0 ? size_t(n) : 0;
}

// Returns false when the connection would close.
bool consume(
    Consumer& c,
    const PeerMapping& peer,
    const ChunkRecord& record,
    size_t dstRoom) {
  std::unique_ptr<char[]> dst(new char[std::max<size_t>(dstRoom, 1)]);
  uint32_t waiting =
      peer.base != nullptr ? peer.header()->writerWaiting.load() : 0;
  uint64_t offset = c.position % c.capacity;
  bool honest = record.offset == offset && record.length != 0 &&
      record.length <= c.capacity - offset && record.length <= dstRoom;
  std::string why = c.ring.consume(record, dst.get(), dstRoom);
  if (!honest) {
    FUZZ_CHECK(!why.empty(), "consume accepted a bad record");
    return false;
  }
  // (A wake-up never fails a consume: the producer gone is nobody to wake.)
  FUZZ_CHECK(why.empty(), "consume refused an honest record: " + why);
  c.position += record.length;
  if (const char* mine = peer.data(record.offset, record.length)) {
    FUZZ_CHECK(
        std::memcmp(mine, dst.get(), record.length) == 0,
        "consume copied other bytes than the ring's");
  }
  if (peer.base != nullptr) {
    FUZZ_CHECK(
        peer.header()->consumed.load() == c.position,
        "consumer position not published");
    FUZZ_CHECK(
        peer.header()->writerWaiting.load() == 0, "writerWaiting not cleared");
  }
  if (waiting != 0 && c.wakeKind == WakeKind::kSocket) {
    FUZZ_CHECK(signalCount(c.wakeDup) >= 1, "a waiting producer was not woken");
  }
  return true;
}

struct Producer {
  Ring* ring = nullptr;
  uint64_t produced = 0;
  std::deque<ChunkRecord> pending;
};

bool produce(Producer& p, const PeerMapping& peer, FuzzInput& in) {
  uint64_t cap = p.ring->capacity();
  // As the connection's writer calls it: something to send, a chunk bound.
  size_t size = std::max<size_t>(1, in.take<uint16_t>());
  size_t maxChunk = std::max<size_t>(1, in.take<uint16_t>());
  std::vector<char> bytes(size);
  size_t phase = 0;
  fillRepeating(bytes.data(), size, in.takeBytes(16), phase);
  uint64_t consumed = peer.header()->consumed.load();
  bool impossible = consumed > p.produced || p.produced - consumed > cap;
  ChunkRecord record{~uint64_t(0), ~uint64_t(0)};
  std::string error;
  size_t n = p.ring->produce(bytes.data(), size, maxChunk, &record, &error);
  if (impossible) {
    FUZZ_CHECK(
        n == 0 && !error.empty(),
        "produce went on from an impossible consumer position");
    return false;
  }
  FUZZ_CHECK(error.empty(), "produce failed on a possible position: " + error);
  uint64_t space = cap - (p.produced - consumed);
  uint64_t offset = p.produced % cap;
  uint64_t expected = std::min<uint64_t>(
      {space, cap - offset, uint64_t(size), uint64_t(maxChunk)});
  FUZZ_CHECK(
      n == expected,
      "produce copied " + std::to_string(n) + " bytes, expected " +
          std::to_string(expected));
  if (space == 0) {
    FUZZ_CHECK(
        peer.header()->writerWaiting.load() != 0,
        "a full ring did not ask for a wake-up");
  }
  if (n == 0) {
    return true;
  }
  FUZZ_CHECK(
      record.offset == offset && record.length == n,
      "produce described its chunk wrongly");
  const char* mine = peer.data(record.offset, n);
  FUZZ_CHECK(
      mine != nullptr && std::memcmp(mine, bytes.data(), n) == 0,
      "produce put other bytes in the ring");
  p.produced += n;
  p.pending.push_back(record);
  return true;
}

void runOps(FuzzInput& in, Consumer& c, PeerMapping& peer, Producer* producer) {
  for (size_t i = 0; i < kMaxOps && !in.empty(); ++i) {
    uint8_t op = in.take<uint8_t>();
    switch (op % 6) {
      case 0: { // the next honest record
        ChunkRecord r;
        if (producer != nullptr && !producer->pending.empty()) {
          r = producer->pending.front();
          producer->pending.pop_front();
        } else {
          uint64_t offset = c.position % c.capacity;
          r = {offset, 1 + in.take<uint16_t>() % (c.capacity - offset)};
        }
        if (!consume(c, peer, r, size_t(r.length) + (op >> 4))) {
          return;
        }
        break;
      }
      case 1: { // a fuzzed record
        ChunkRecord r;
        r.offset = (op & 8) != 0 ? c.position % c.capacity + in.take<int8_t>()
                                 : in.take<uint64_t>();
        r.length = (op & 16) != 0 ? in.take<uint16_t>() : in.take<uint64_t>();
        size_t room = (op & 32) != 0 ? c.capacity : in.take<uint16_t>();
        if (!consume(c, peer, r, room)) {
          return;
        }
        break;
      }
      case 2: { // the peer rewrites a header field
        if (peer.base == nullptr) {
          break;
        }
        uint64_t v = in.take<uint64_t>();
        RingHeader* h = peer.header();
        switch ((op >> 3) % 4) {
          case 0:
            h->magic = v;
            break;
          case 1:
            h->capacity = v;
            break;
          case 2:
            h->consumed.store(v);
            break;
          default:
            h->writerWaiting.store(uint32_t(v));
            break;
        }
        break;
      }
      case 3: { // the peer writes data
        uint64_t at = in.take<uint32_t>() % c.capacity;
        std::string bytes = in.takeBytes(in.take<uint8_t>());
        if (char* d = const_cast<char*>(peer.data(at, bytes.size()))) {
          std::memcpy(d, bytes.data(), bytes.size());
        }
        break;
      }
      case 4: { // the peer grows the file or tries to shrink it
        struct stat st{};
        if (peer.fd < 0 || ::fstat(peer.fd, &st) != 0) {
          break;
        }
        uint64_t size = uint64_t(st.st_size);
        uint64_t delta = in.take<uint16_t>();
        uint64_t want = (op & 8) != 0
            ? size + delta
            : size - std::min<uint64_t>(size, 1 + delta);
        if (want <= kMaxFileBytes) {
          int rv = ::ftruncate(peer.fd, off_t(want));
          FUZZ_CHECK(
              want >= size || rv != 0,
              "the peer shrank a ring the consumer had accepted");
        }
        break;
      }
      default: // produce (loopback)
        if (producer != nullptr && !produce(*producer, peer, in)) {
          return;
        }
        break;
    }
  }
}

bool attachShouldSucceed(
    FileKind kind,
    uint64_t capacity,
    uint64_t size,
    const std::string& header) {
  bool memfd = kind != FileKind::kEventfd && kind != FileKind::kPipe &&
      kind != FileKind::kClosed;
  bool shrinkSealed = kind == FileKind::kSealedMemfd ||
      kind == FileKind::kShrinkSealOnly || kind == FileKind::kGrowSealed ||
      kind == FileKind::kWriteSealed || kind == FileKind::kFutureWriteSealed;
  if (capacity < kMinRingBytes || capacity > kMaxRingBytes ||
      capacity % 4096 != 0 || !memfd || !shrinkSealed ||
      size < kRingHeaderBytes + capacity) {
    return false;
  }
  uint64_t magic, cap;
  std::memcpy(&magic, header.data(), 8);
  std::memcpy(&cap, header.data() + 8, 8);
  return magic == kRingMagic && cap == capacity;
}

void fuzzAttach(FuzzInput& in) {
  auto kind = FileKind(in.take<uint8_t>() % uint8_t(FileKind::kCount));
  auto wakeKind = WakeKind(in.take<uint8_t>() % uint8_t(WakeKind::kCount));
  uint64_t capacity = capacityFrom(in);
  uint64_t size = fileSizeFrom(in, capacity);
  uint8_t sel = in.take<uint8_t>();
  uint64_t magic = (sel & 1) != 0 ? in.take<uint64_t>() : kRingMagic;
  uint64_t cap = (sel & 2) != 0 ? in.take<uint64_t>() : capacity;
  uint64_t consumed = in.take<uint64_t>();
  uint32_t waiting = in.take<uint32_t>();
  std::string header(sizeof(RingHeader), '\0');
  std::memcpy(header.data(), &magic, 8);
  std::memcpy(header.data() + 8, &cap, 8);
  std::memcpy(header.data() + 16, &consumed, 8);
  std::memcpy(header.data() + 24, &waiting, 4);

  int peerFd = makePeerFile(kind, size, header);
  if (peerFd < 0) {
    kind = FileKind::kClosed;
  }
  Consumer c;
  c.capacity = capacity;
  c.wakeKind = wakeKind;
  int wake = -1;
  int theirs = -1; // the producer's end of a pair
  switch (wakeKind) {
    case WakeKind::kSocket:
    case WakeKind::kSocketPeerGone:
    case WakeKind::kSocketBlockingFull: {
      int pair[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0) {
        wake = pair[0];
        theirs = pair[1];
        if (wakeKind == WakeKind::kSocketPeerGone) {
          ::close(theirs);
          theirs = -1;
        } else if (wakeKind == WakeKind::kSocketBlockingFull) {
          // (Blocking already: made without SOCK_NONBLOCK. Filled until
          // the kernel takes no more; a signal must still return.)
          char junk[4096] = {};
          while (::send(wake, junk, sizeof(junk), MSG_DONTWAIT) > 0) {
          }
        }
      }
      break;
    }
    case WakeKind::kEventfd:
    case WakeKind::kSaturatedEventfd:
      wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (wake >= 0 && wakeKind == WakeKind::kSaturatedEventfd) {
        uint64_t most = ~uint64_t(0) - 1;
        (void)::write(wake, &most, sizeof(most));
      }
      break;
    case WakeKind::kPipe:
      wake = makePeerFile(FileKind::kPipe, 0, "");
      break;
    default:
      break;
  }
  c.wakeDup = theirs;
  c.memFd = peerFd >= 0 ? ::dup(peerFd) : -1;
  c.wakeFd = wake;
  const bool socket = wake >= 0 &&
      (wakeKind == WakeKind::kSocket || wakeKind == WakeKind::kSocketPeerGone ||
       wakeKind == WakeKind::kSocketBlockingFull);
  bool expected = attachShouldSucceed(kind, capacity, size, header) && socket;
  std::string why = Ring::attach(c.memFd, c.wakeFd, capacity, &c.ring);
  if (!why.empty()) {
    FUZZ_CHECK(
        !expected || kind == FileKind::kWriteSealed ||
            kind == FileKind::kFutureWriteSealed,
        "attach refused a good ring: " + why);
    FUZZ_CHECK(
        socket || why.find("wake-up") != std::string::npos ||
            !attachShouldSucceed(kind, capacity, size, header),
        "attach refused a wake-up that is no socket for another reason: " +
            why);
    FUZZ_CHECK(!c.ring.valid(), "a failed attach left a ring");
    FUZZ_CHECK(
        closedOffThread(), "the closer did not close what it was handed");
    FUZZ_CHECK(
        !isOpen(c.memFd) && !isOpen(c.wakeFd),
        "a failed attach left a descriptor open");
  } else {
    FUZZ_CHECK(expected, "attach accepted a bad ring");
    FUZZ_CHECK(
        c.ring.valid() && c.ring.capacity() == capacity &&
            c.ring.fd() == c.memFd && c.ring.wakeFd() == c.wakeFd,
        "attached ring does not match");
    PeerMapping peer;
    peer.map(peerFd);
    runOps(in, c, peer, nullptr);
    c.ring = Ring();
    FUZZ_CHECK(
        closedOffThread(), "the closer did not close what it was handed");
    FUZZ_CHECK(
        !isOpen(c.memFd) && !isOpen(c.wakeFd),
        "a released ring left a descriptor open");
  }
  if (peerFd >= 0) {
    ::close(peerFd);
  }
  if (c.wakeDup >= 0) {
    ::close(c.wakeDup);
  }
}

// The producer's side of the wake-up against a consumer that makes its
// own end blocking (as it may: the descriptor is its): the producer's
// drain must still return with nothing pending. (With an eventfd, whose
// flags both sides share, it blocked its loop thread for good: a hang.)
bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

void blockingConsumerEnd(Ring& mine, int consumerEnd) {
  const int flags = ::fcntl(consumerEnd, F_GETFL);
  FUZZ_CHECK(
      flags >= 0 && ::fcntl(consumerEnd, F_SETFL, flags & ~O_NONBLOCK) == 0,
      "fcntl of the consumer's wake-up");
  FUZZ_CHECK(
      mine.drainWakeups() == SignalDrain::kOpen,
      "an empty wake-up read as ended");
  // A flood (more than one drain's worth would take: the kernel queues
  // what it will) is read in one drain.
  std::vector<char> flood(64 << 10, 1);
  for (int i = 0; i < 8; ++i) {
    (void)::send(consumerEnd, flood.data(), flood.size(), MSG_DONTWAIT);
  }
  FUZZ_CHECK(
      mine.drainWakeups() == SignalDrain::kOpen,
      "a flooded wake-up read as ended");
  FUZZ_CHECK(!readable(mine.wakeFd()), "a drain left signals behind");
  FUZZ_CHECK(
      mine.drainWakeups() == SignalDrain::kOpen,
      "a drained wake-up read as ended");
}

// The consumer shuts its end down (its process holds the same socket we
// keep open for it): our end reads as ended for good, which the drain must
// report, or the loop watching it would spin.
void shutDownConsumerEnd(Ring& mine, int consumerEnd) {
  FUZZ_CHECK(::shutdown(consumerEnd, SHUT_WR) == 0, "shutdown");
  FUZZ_CHECK(
      mine.drainWakeups() == SignalDrain::kEnded,
      "a shut-down wake-up was not reported");
}

// The consumer passes a descriptor with a wake-up byte: the drain reports
// it, and the descriptor is closed on a closer thread (read with recv(),
// the kernel would have closed it on the loop thread: fd_closer.h). The
// one passed is a pipe's write end whose only other copy is closed here,
// so its read end reads as ended once the closer has closed ours.
void descriptorOnConsumerEnd(Ring& mine, int consumerEnd) {
  int pipeFds[2];
  FUZZ_CHECK(::pipe2(pipeFds, O_CLOEXEC | O_NONBLOCK) == 0, "pipe2");
  char byte = 1;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &pipeFds[1], sizeof(int));
  FUZZ_CHECK(::sendmsg(consumerEnd, &msg, MSG_DONTWAIT) == 1, "sendmsg");
  ::close(pipeFds[1]);
  FUZZ_CHECK(
      mine.drainWakeups() == SignalDrain::kDescriptors,
      "a descriptor on a wake-up was not reported");
  FUZZ_CHECK(closedOffThread(), "the closer did not close what it was handed");
  FUZZ_CHECK(
      ::read(pipeFds[0], &byte, 1) == 0, "a passed descriptor was kept open");
  ::close(pipeFds[0]);
}

void fuzzLoopback(FuzzInput& in) {
  uint64_t capacity = kCapacities[in.take<uint8_t>() % 3];
  Ring mine = Ring::create(capacity);
  Consumer c;
  c.capacity = capacity;
  c.memFd = ::dup(mine.fd());
  c.wakeFd = ::dup(mine.peerWakeFd());
  c.wakeDup = ::dup(mine.wakeFd());
  std::string why = Ring::attach(c.memFd, c.wakeFd, capacity, &c.ring);
  FUZZ_CHECK(why.empty(), "attach refused a ring of ours: " + why);
  blockingConsumerEnd(mine, c.wakeFd);
  PeerMapping peer;
  peer.map(mine.fd());
  Producer p;
  p.ring = &mine;
  runOps(in, c, peer, &p);
  descriptorOnConsumerEnd(mine, c.wakeFd);
  shutDownConsumerEnd(mine, c.wakeFd);
  ::close(c.wakeDup);
}

int fuzzOne(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  if ((in.take<uint8_t>() & 1) != 0) {
    fuzzLoopback(in);
  } else {
    fuzzAttach(in);
  }
  return 0;
}

} // namespace
} // namespace torch_rpc_ext::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torch_rpc_ext::fuzz::fuzzOne(data, size);
}
