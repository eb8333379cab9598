// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/signal_socket.h"

namespace torch_rpc_ext::channel::shm {

// A single-producer, single-consumer byte ring in a memfd shared by two
// processes on one host: the memory of the shm_ring channel.
//
// Each direction of a connection has its own ring, created by the sending
// side when it first needs one and handed to the receiver over the
// connection's Unix socket (SCM_RIGHTS) in a kRingSetup frame; see
// ring_channel.h for how rings are sized, grown and dropped. The socket stays
// the control path: for every chunk the producer copies into the ring it writes
// a 16-byte ChunkRecord on the socket, and the consumer copies the chunk
// straight into the message's final buffer. So a tensor crosses with one copy
// per side and both copies run in parallel on two cores, while wake-ups stay
// event-driven: nobody spins. The consumer publishes its position in the shared
// header; a producer that finds the ring full raises `writerWaiting`, and the
// consumer then signals the ring's wake-up socket pair (signal_socket.h), whose
// other end the producer's loop thread watches. (The wake-up cannot travel on
// the consumer's own socket: that stream may itself be stuck mid-frame behind
// a full ring.)
//
// Memory layout: one 4 KiB header page, then `capacity` data bytes.
struct RingHeader {
  uint64_t magic;
  uint64_t capacity;
  std::atomic<uint64_t> consumed; // written by the consumer only
  std::atomic<uint32_t>
      writerWaiting; // set by the producer, cleared by the consumer
};

// What the producer writes on the socket for each chunk it put in the ring.
struct ChunkRecord {
  uint64_t offset; // into the data area; always the consumer's next byte
  uint64_t length;
};
static_assert(sizeof(ChunkRecord) == 16, "ChunkRecord is 16 bytes on the wire");

// The ring traffic of one process's connections, for its counters.
struct RingCounters {
  std::atomic<uint64_t> segments{0}; // segments sent through a ring
  std::atomic<uint64_t> bytes{0}; // bytes copied into rings
  std::atomic<uint64_t> created{0}; // rings made, first or larger
  std::atomic<uint64_t> dropped{0}; // rings unmapped when idle
  std::atomic<uint64_t> oneOffs{0}; // declined: no ring, no recent use
  std::atomic<uint64_t> fullWaits{0}; // a producer found its ring full
};

constexpr uint64_t kRingMagic = 0x474e495258505254ull; // "TRPXRING"
constexpr size_t kRingHeaderBytes = 4096;
constexpr uint64_t kMinRingBytes = 64 * 1024;
constexpr uint64_t kMaxRingBytes = uint64_t(1) << 30;

class Ring {
 public:
  // A new ring (producer side). Throws std::runtime_error naming the failing
  // call (memfd_create, ftruncate, mmap) when shared memory is unavailable.
  static Ring create(uint64_t capacity);
  // Map the peer's ring from `fd` with `wakeFd`, the consumer's end of its
  // wake-up socket pair (consumer side; takes ownership of both). Returns an
  // error text, or "".
  static std::string attach(int fd, int wakeFd, uint64_t capacity, Ring* out);

  Ring() = default;
  Ring(Ring&& other) noexcept;
  Ring& operator=(Ring&& other) noexcept;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring();

  bool valid() const {
    return base_ != nullptr;
  }
  int fd() const {
    return fd_;
  }
  // This side's end of the wake-up pair: the producer watches it for the
  // consumer's signals (room in the ring), the consumer sends them on it.
  int wakeFd() const {
    return wakeFd_;
  }
  // Producer: the consumer's end, handed over in the setup frame. Kept open
  // with the ring, as the memfd is (the frame names both until it is
  // written), so our watched end does not read as ended when the consumer
  // lets the ring go first; a consumer that shuts the socket down ends it
  // all the same (drainWakeups()).
  int peerWakeFd() const {
    return peerWakeFd_;
  }
  // Producer: read the signals after a wake-up. Anything but kOpen once
  // the consumer has shut the wake-up down (it reads as ended for good) or
  // passed descriptors over it: stop watching, end the connection.
  SignalDrain drainWakeups();
  // Producer: the consumer has taken every byte produced so far.
  bool drained() const;
  uint64_t capacity() const {
    return capacity_;
  }

  // Producer: copy up to `size` bytes from `src` into the ring, at most up to
  // the end of the data area and `maxChunk`. Returns the bytes copied (0 when
  // full: the producer has then raised writerWaiting) and fills `record`.
  // Sets `error` if the consumer's published position is impossible.
  size_t produce(
      const void* src,
      size_t size,
      size_t maxChunk,
      ChunkRecord* record,
      std::string* error);

  // Consumer: check `record` (it must start at our position and fit), copy
  // its bytes to `dst`, release them and wake the producer if it waits.
  // Returns an error text or "".
  std::string consume(const ChunkRecord& record, void* dst, size_t dstRoom);

 private:
  void release();

  int fd_ = -1;
  int wakeFd_ = -1;
  int peerWakeFd_ = -1; // producer only
  char* base_ = nullptr;
  size_t mapped_ = 0;
  uint64_t capacity_ = 0;
  uint64_t position_ = 0; // producer: bytes produced; consumer: bytes consumed
  RingHeader* header() const {
    return reinterpret_cast<RingHeader*>(base_);
  }
  char* data() const {
    return base_ + kRingHeaderBytes;
  }
};

} // namespace torch_rpc_ext::channel::shm
