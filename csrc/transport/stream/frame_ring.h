// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "csrc/common/option_defaults.h"

namespace torch_rpc_ext::transport::stream {

// One direction of a connection's frames (one that passes descriptors: shm), in
// shared memory instead of the Unix socket: a single-producer, single-consumer
// byte ring in a sealed memfd, made by the sending side and handed to the
// receiver with the kFrameRing control frame (docs/wire-format.md). A frame
// costs a copy in and a copy out and no system call while the receiver's loop
// is awake (it polls rings in memory: Pollable::ringInputFromLoop); the sender
// signals the ring's data eventfd only when the receiver has parked before
// sleeping, and the receiver signals the space eventfd only when the sender
// found the ring full. The socket stays for descriptors: a frame that passes
// some sends them first, with one byte, and counts the send in `carriers`, so
// the receiver knows to read the socket before the frame's bytes.
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

class FrameRing {
 public:
  // Sender: a new ring. Throws std::runtime_error naming what failed.
  static std::unique_ptr<FrameRing> create(uint64_t capacity);
  // Receiver: the peer's ring from the descriptors of its kFrameRing frame
  // (owned from now on, even on failure). Returns null with `error` set.
  static std::unique_ptr<FrameRing> attach(
      int memFd,
      int dataFd,
      int spaceFd,
      uint64_t capacity,
      std::string* error);
  ~FrameRing();
  FrameRing(const FrameRing&) = delete;
  FrameRing& operator=(const FrameRing&) = delete;

  int memFd() const {
    return memFd_;
  }
  // Once the mapping is made (receiver) or handed over (sender): the memory
  // lives as long as the mapping, and a host of connections holds one
  // descriptor fewer each.
  void closeMemFd();
  // Signalled by the sender for a parked receiver.
  int dataFd() const {
    return dataFd_;
  }
  // Signalled by the receiver for a sender that found the ring full.
  int spaceFd() const {
    return spaceFd_;
  }
  uint64_t capacity() const {
    return capacity_;
  }

  // ---- Sender (one thread at a time) ------------------------------------
  // Room for this many bytes now; 0 also when the receiver's counter is
  // impossible (`error` set).
  size_t room(std::string* error);
  // Copy up to `room()` bytes of `iov` in and publish them; the count.
  size_t write(const iovec* iov, int n, size_t max);
  // After a descriptor send on the socket, before the frame's bytes.
  void countCarrier() {
    header()->carriers.fetch_add(1, std::memory_order_seq_cst);
  }
  // After publishing: wake a parked receiver (one eventfd write, or none);
  // true if it signalled.
  bool wakeReceiver();
  // The ring was full: ask for a signal on spaceFd(). True if room
  // appeared meanwhile (no signal will come for it: write again).
  bool parkSender();

  // ---- Receiver (the loop thread) ---------------------------------------
  // Bytes waiting; -1 when the sender's counter is impossible.
  int64_t waiting() const;
  // Copy up to `size` bytes out; -1 on an impossible counter (`error`).
  int64_t read(void* dst, size_t size, std::string* error);
  // After consuming: wake a sender that found the ring full; true if it
  // signalled.
  bool wakeSender();
  // Before the loop sleeps: ask for a signal on dataFd(). True if bytes are
  // waiting already (no signal will come for them).
  bool parkReceiver();
  void unparkReceiver() {
    header()->receiverParked.store(0, std::memory_order_relaxed);
  }
  // Descriptor sends the sender has made so far.
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

  int memFd_ = -1;
  int dataFd_ = -1;
  int spaceFd_ = -1;
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
