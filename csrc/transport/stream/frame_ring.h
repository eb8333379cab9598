// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "csrc/common/option_defaults.h"
#include "csrc/common/signal_socket.h"

namespace torch_rpc_ext::transport::stream {

// One direction of a connection's frames (one that passes descriptors: shm)
// in shared memory instead of the Unix socket: a single-producer,
// single-consumer byte ring in a sealed memfd, made by the sending side and
// handed to the receiver with the kFrameRing control frame
// (docs/wire-format.md, "Frame rings"). A frame costs a copy in and a copy
// out and no system call while the receiver's loop is awake (it polls its
// rings in memory: Pollable::ringInputFromLoop).
//
// The two ends signal each other through a socket pair of the ring's own
// (the sender keeps one end and hands over the other): the sender only for
// a receiver that parked before sleeping, the receiver only for a sender
// that found the ring full. A socket, not an eventfd: an eventfd's flags
// are shared with the peer, which could make our reads and writes of it
// block; a socket end's are our own, and every call passes MSG_DONTWAIT.
//
// The socket of the connection stays for descriptors: a frame that passes
// some sends them first, with one byte, and counts the send in `carriers`,
// so the receiver knows to read the socket when it parses that frame.
//
// Both processes can write the whole mapping, so neither trusts the other's
// counters: each keeps its own position privately and checks the peer's
// against it (a violation is an error, which closes the connection).
struct FrameRingHeader {
  uint64_t magic;
  uint64_t capacity;
  alignas(64) std::atomic<uint64_t> head; // bytes published (sender)
  alignas(64) std::atomic<uint64_t> tail; // bytes consumed (receiver)
  alignas(64) std::atomic<uint32_t> receiverParked;
  std::atomic<uint32_t> senderParked;
  alignas(64) std::atomic<uint64_t> carriers; // descriptor sends (sender)
};

constexpr uint64_t kFrameRingMagic = 0x474e524d52465852ull; // "RXFRMRNG"
constexpr size_t kFrameRingHeaderBytes = 4096;
constexpr uint64_t kMinFrameRingBytes = kMinShmFrameRingBytes;
constexpr uint64_t kMaxFrameRingBytes = kMaxShmFrameRingBytes;
// A large frame's write or read publishes its progress every this many
// bytes, so that the two ends copy at once rather than in turn. (Only a
// large frame's: small frames many at a time, published in pieces, made
// pipelined calls ~10% slower on a 2-core machine, more rounds of fewer
// frames each.)
constexpr size_t kFrameRingPublishStep = 16 * 1024;

class FrameRing {
 public:
  // Sender: a new ring. Throws std::runtime_error naming what failed.
  static std::unique_ptr<FrameRing> create(uint64_t capacity);
  // Receiver: the peer's ring from the descriptors of its kFrameRing frame
  // (owned from now on, even on failure). Returns null with `error` set.
  static std::unique_ptr<FrameRing> attach(
      int memFd,
      int signalFd,
      uint64_t capacity,
      std::string* error);
  ~FrameRing();
  FrameRing(const FrameRing&) = delete;
  FrameRing& operator=(const FrameRing&) = delete;

  // Sender: what the kFrameRing frame hands over (the memfd and the
  // receiver's end of the signal socket), and closing them once it has.
  int memFd() const {
    return memFd_;
  }
  int peerSignalFd() const {
    return peerSignalFd_;
  }
  void closeHandedOver();
  // This end of the signal socket: readable when the other end signalled.
  int signalFd() const {
    return signalFd_;
  }
  uint64_t capacity() const {
    return capacity_;
  }
  // Read what the other end signalled (MSG_DONTWAIT). kEnded once it
  // closed its end (the peer is gone or broke the protocol), kDescriptors
  // if it passed descriptors over it (it broke the protocol).
  SignalDrain drainSignals();

  // ---- Sender (one thread at a time) ------------------------------------
  // Room for this many bytes now; 0 also when the receiver's counter is
  // impossible (`error` set).
  size_t room(std::string* error);
  // Copy up to `max` bytes of `iov` in and publish them; the count.
  // `piecewise` (a frame of at least the ring's size): publish every
  // kFrameRingPublishStep as it goes.
  size_t write(const iovec* iov, int n, size_t max, bool piecewise = false);
  // After a descriptor send on the socket, before the frame's bytes.
  void countCarrier() {
    header()->carriers.fetch_add(1, std::memory_order_seq_cst);
  }
  // After publishing: wake a parked receiver; true if it signalled.
  bool wakeReceiver() {
    return wakeIfParked(header()->receiverParked);
  }
  // The ring was full: wait up to `spin` for room while the receiver's
  // loop is awake (not parked), which drains a ring in microseconds where
  // a signal and a wake-up cost tens: what bounds a large frame's rate
  // through a small ring. 0 if none came (or `error`).
  size_t spinForRoom(std::chrono::nanoseconds spin, std::string* error);
  // The ring was full: ask for a signal. True if room appeared meanwhile
  // (no signal will come for it: write again).
  bool parkSender();

  // ---- Receiver (the loop thread) ---------------------------------------
  // Bytes waiting; -1 when the sender's counter is impossible.
  int64_t waiting() const {
    return waitingAfter(header()->head.load(std::memory_order_acquire));
  }
  // Copy up to `size` bytes out; -1 on an impossible counter (`error`).
  // `piecewise` (a large segment's body): publish every
  // kFrameRingPublishStep as it goes.
  int64_t read(
      void* dst,
      size_t size,
      std::string* error,
      bool piecewise = false);
  // After consuming: wake a sender that found the ring full; true if it
  // signalled.
  bool wakeSender() {
    return wakeIfParked(header()->senderParked);
  }
  // Mid-frame with the ring empty: wait up to `spin` for the sender's next
  // piece (yielding the core each round). True if bytes (or an impossible
  // head, which the next read reports) came.
  bool spinForBytes(std::chrono::nanoseconds spin);
  // Before the loop sleeps: ask for a signal. True if bytes are waiting
  // already (no signal will come for them).
  bool parkReceiver();
  void unparkReceiver() {
    header()->receiverParked.store(0, std::memory_order_relaxed);
  }
  // Descriptor sends the sender has counted so far (checked by the caller
  // against the carriers that arrived).
  uint64_t carriersSent() const {
    return header()->carriers.load(std::memory_order_seq_cst);
  }

 private:
  FrameRing() = default;
  FrameRingHeader* header() const {
    return reinterpret_cast<FrameRingHeader*>(base_);
  }
  char* data() const {
    return base_ + kFrameRingHeaderBytes;
  }
  int64_t waitingAfter(uint64_t head) const;
  bool signal();
  // Clear `parked` and signal the other end if it was set.
  bool wakeIfParked(std::atomic<uint32_t>& parked);

  int memFd_ = -1;
  int signalFd_ = -1;
  int peerSignalFd_ = -1;
  char* base_ = nullptr;
  size_t mapped_ = 0;
  uint64_t capacity_ = 0;
  // Our own position, never read back from the shared header: the
  // sender's head, or the receiver's tail.
  uint64_t position_ = 0;
  // Sender: the receiver's tail when last read (it only grows).
  uint64_t peerTail_ = 0;
};

} // namespace torch_rpc_ext::transport::stream
