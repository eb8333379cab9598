// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes shm::Slab::attach (csrc/channel/shm/slab.h): mapping a slab the
// peer announced (kSlab frame: a capacity, and a descriptor over
// SCM_RIGHTS). The harness hands it memfds of various sizes and seals, and
// descriptors that are not shared-memory files, with fuzzed capacities;
// after a successful attach the peer writes through its own mapping, grows
// the file or tries to shrink it, and the receiver touches the mapping.
//
// Input: uint8 file kind; file size (uint8 selector and operand); capacity
// (uint8 selector and operand); then up to kMaxOps operations, a uint8 op
// and its operands each.
//
// A finding: a sanitizer report or a crash (SIGBUS included); attach
// accepting anything but a memfd sealed with F_SEAL_SHRINK | F_SEAL_SEAL of
// exactly the announced, page-multiple, non-zero capacity, or refusing one;
// an accepted slab whose mapping is not the peer's file (bytes written on
// one side not seen on the other); the descriptor left open (attach closes
// it in every case); a file the peer could shrink under the mapping.

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "csrc/channel/shm/slab.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/shm_files.h"

namespace torch_rpc_ext::fuzz {
namespace {

using channel::shm::kSlabPage;
using channel::shm::Slab;

constexpr size_t kMaxOps = 16;
constexpr uint64_t kSizes[] = {
    kSlabPage,
    uint64_t(64) << 10,
    uint64_t(128) << 10,
    uint64_t(2) << 20};

uint64_t sizeFrom(FuzzInput& in) {
  uint8_t sel = in.take<uint8_t>();
  uint64_t table = kSizes[(sel >> 2) % std::size(kSizes)];
  uint64_t size;
  switch (sel & 3) {
    case 0:
      size = table;
      break;
    case 1:
      size = in.take<uint32_t>();
      break;
    case 2:
      size = kSlabPage * in.take<uint16_t>();
      break;
    default:
      size = table + uint64_t(int64_t(in.take<int16_t>()));
      break;
  }
  return std::min(size, kMaxFileBytes);
}

uint64_t capacityFrom(FuzzInput& in, uint64_t size) {
  uint8_t sel = in.take<uint8_t>();
  switch (sel & 3) {
    case 0:
      return size;
    case 1:
      return size + uint64_t(int64_t(in.take<int16_t>()));
    case 2:
      return in.take<uint64_t>();
    default:
      return kSlabPage * in.take<uint16_t>();
  }
}

bool attachShouldSucceed(FileKind kind, uint64_t size, uint64_t capacity) {
  bool sealed = kind == FileKind::kSealedMemfd ||
      kind == FileKind::kGrowSealed || kind == FileKind::kWriteSealed ||
      kind == FileKind::kFutureWriteSealed;
  return sealed && capacity != 0 && capacity % kSlabPage == 0 &&
      size == capacity;
}

void runOps(FuzzInput& in, int peerFd, const Slab& slab) {
  uint64_t cap = slab.capacity();
  void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_SHARED, peerFd, 0);
  FUZZ_CHECK(p != MAP_FAILED, "the peer cannot map its own slab");
  char* theirs = static_cast<char*>(p);
  char* ours = slab.data();
  for (size_t i = 0; i < kMaxOps && !in.empty(); ++i) {
    uint8_t op = in.take<uint8_t>();
    switch (op % 4) {
      case 0: { // the peer writes; we must see it
        uint64_t at = in.take<uint32_t>() % cap;
        char v = char(in.take<uint8_t>());
        theirs[at] = v;
        FUZZ_CHECK(ours[at] == v, "the slab is not the peer's file");
        break;
      }
      case 1: { // we write; the peer sees it (a returned slab's reply)
        uint64_t at = in.take<uint32_t>() % cap;
        char v = char(in.take<uint8_t>());
        ours[at] = v;
        FUZZ_CHECK(theirs[at] == v, "the slab is not the peer's file");
        break;
      }
      case 2: { // the peer tries to shrink the file
        uint64_t want = cap - std::min<uint64_t>(cap, 1 + in.take<uint16_t>());
        FUZZ_CHECK(
            ::ftruncate(peerFd, off_t(want)) != 0,
            "the peer shrank a slab the receiver had accepted");
        break;
      }
      default: { // the peer grows it (allowed unless sealed against)
        (void)::ftruncate(peerFd, off_t(cap + in.take<uint16_t>()));
        break;
      }
    }
  }
  // The receiver's tensors may use every byte of the slab.
  volatile char sink = ours[0];
  sink = ours[cap - 1];
  (void)sink;
  ::munmap(p, cap);
}

int fuzzOne(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  auto kind = FileKind(in.take<uint8_t>() % uint8_t(FileKind::kCount));
  uint64_t fileSize = sizeFrom(in);
  uint64_t capacity = capacityFrom(in, fileSize);
  int peerFd = makePeerFile(kind, fileSize, "");
  if (peerFd < 0) {
    kind = FileKind::kClosed;
  }
  int fd = peerFd >= 0 ? ::dup(peerFd) : -1;
  std::shared_ptr<Slab> slab;
  std::string why = Slab::attach(fd, capacity, &slab);
  FUZZ_CHECK(closedOffThread(), "the closer did not close what it was handed");
  FUZZ_CHECK(!isOpen(fd), "attach left the descriptor open");
  bool expected = attachShouldSucceed(kind, fileSize, capacity);
  if (why.empty()) {
    FUZZ_CHECK(expected, "attach accepted a bad slab");
    FUZZ_CHECK(
        slab != nullptr && slab->data() != nullptr &&
            slab->capacity() == capacity && slab->fd() == -1,
        "attached slab does not match");
    runOps(in, peerFd, *slab);
  } else {
    FUZZ_CHECK(
        !expected || kind == FileKind::kWriteSealed ||
            kind == FileKind::kFutureWriteSealed,
        "attach refused a good slab: " + why);
    FUZZ_CHECK(slab == nullptr, "a failed attach produced a slab");
  }
  slab.reset();
  if (peerFd >= 0) {
    ::close(peerFd);
  }
  return 0;
}

} // namespace
} // namespace torch_rpc_ext::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torch_rpc_ext::fuzz::fuzzOne(data, size);
}
