// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace torch_rpc_ext::channel::shm {

// A sealed memfd mapping that carries one large tensor segment between two
// processes of one host without a receive-side copy: the memory of the
// shm_slab channel (slab_channel.h; docs/architecture.md, "Shared slabs").
//
// The sender copies the segment into one of its slabs (the one copy of that
// direction) and sends a SlabRecord in the segment's place; the receiver's
// tensor storage is then a view of the slab for as long as the tensor lives.
// When that storage dies, the receiver tells the sender (kSlabRelease) and
// the slab goes back to the sender's pool, already faulted in. A receiver
// that sends such a storage back to the same peer, and is its only user,
// hands the slab back instead of copying it (SlabRecord::kReturned): the
// reply costs no copy at all.
//
// Slabs are sealed against shrinking before they are shared, so a peer
// cannot turn our accesses into SIGBUS by truncating the file.
class Slab {
 public:
  // A new slab of `capacity` bytes, pre-faulted (sender side). Throws
  // std::runtime_error naming the failing call.
  static std::shared_ptr<Slab> create(uint64_t capacity);
  // Map the peer's slab from `fd` (receiver side; closes `fd` in all cases:
  // the mapping needs no descriptor, so a receiver never holds one per slab).
  // Returns an error text, or "".
  static std::string attach(
      int fd,
      uint64_t capacity,
      std::shared_ptr<Slab>* out);

  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  ~Slab();

  char* data() const {
    return base_;
  }
  uint64_t capacity() const {
    return capacity_;
  }
  // The memfd, until closeFd(): the sender keeps it only until the slab has
  // been handed to the peer (its setup frame written, or dropped with the
  // connection), so -1 here also says the peer has heard of the slab if it
  // ever will. Any thread.
  int fd() const {
    return fd_.load();
  }
  void closeFd();

 private:
  Slab() = default;
  std::atomic<int> fd_{-1};
  char* base_ = nullptr;
  uint64_t capacity_ = 0;
};

// What travels on the socket in place of a slab segment's bytes.
struct SlabRecord {
  enum Kind : uint32_t {
    kLent = 1, // the sender's slab `id`, lent to the receiver
    kReturned = 2, // the receiver's own slab `id`, handed back by the sender
  };
  uint32_t id;
  uint32_t kind;
  uint64_t offset; // of the segment's first byte in the slab
};
static_assert(sizeof(SlabRecord) == 16, "SlabRecord is 16 bytes on the wire");

// Segments at least this large go through slabs (the ring's threshold too:
// smaller ones ride in the socket stream).
constexpr uint64_t kSlabMinSegment = uint64_t(64) << 10;
// Slab sizes: powers of two from 64 KiB to 2 MiB, then multiples of 2 MiB,
// so a pooled slab fits any segment between half its size and its size.
constexpr uint64_t kSlabLargeGranule = uint64_t(2) << 20;
constexpr uint64_t kSlabPage = 4096;
uint64_t slabCapacityFor(uint64_t segmentBytes);
// Per connection and direction: at most this many slabs exist, of at most
// kMaxSlabBytes in all (free, lent or handed back: every one the peer has
// mapped); past either bound the sender declines the segment (the next
// channel, shm_ring, takes it: a copy per side) rather than grow.
constexpr size_t kMaxSlabs = 1024;
constexpr uint64_t kMaxSlabBytes = uint64_t(1) << 35; // 32 GiB
// kMaxSlabBytes, or a lower bound a test set for this process (a test hook:
// _testing.set_slab_bytes_bound), which takes the peer's bound down with it.
uint64_t slabBytesBound();
void setSlabBytesBound(uint64_t bytes);
// A free slab unused this long is unmapped (and the peer told to unmap it).
constexpr int64_t kSlabIdleMs = 2000;
// Shared memory pays for itself only when it is used again: making a slab
// (or a ring) and mapping it on both sides costs more than the two copies of
// sending the bytes in the stream. So a connection maps new shared memory
// for a large segment only if it offered the channel another one less than
// this long ago; a one-off travels in the stream (at 64 workers all-to-all,
// slabs made for one segment each and unmapped idle made the pass 1.6x
// slower than the stream).
constexpr int64_t kWarmWithinMs = 2000;

// When a connection's channel was last offered a large segment.
class OfferClock {
 public:
  // Record an offer now; true if the previous one was within kWarmWithinMs.
  bool offerIsWarm() {
    const int64_t now =
        std::chrono::steady_clock::now().time_since_epoch().count();
    const int64_t last = last_.exchange(now, std::memory_order_relaxed);
    return last != 0 &&
        std::chrono::steady_clock::duration(now - last) <
        std::chrono::milliseconds(kWarmWithinMs);
  }

 private:
  std::atomic<int64_t> last_{0}; // steady_clock ticks; 0: never
};

// The slab traffic of one process's connections, for its counters.
struct SlabCounters {
  std::atomic<uint64_t> segments{0}; // segments sent through a slab
  std::atomic<uint64_t> copiedBytes{0}; // bytes copied into slabs
  std::atomic<uint64_t> handedBack{0}; // sent with no copy (kReturned)
  std::atomic<uint64_t> created{0};
  std::atomic<uint64_t> unmapped{0}; // own slabs dropped when idle
  // Segments declined (one-offs, over a slab bound, or no slab could be
  // made): the next channel took them.
  std::atomic<uint64_t> declined{0};
  // Segments declined as one-offs (kWarmWithinMs).
  std::atomic<uint64_t> oneOffs{0};
};

} // namespace torch_rpc_ext::channel::shm
