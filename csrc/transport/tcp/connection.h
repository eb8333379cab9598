// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/transport/connection.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/shm/ring.h"
#include "csrc/transport/shm/slab.h"
#include "csrc/transport/tcp/loop.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::tcp {

// A non-blocking TCP socket speaking the frame protocol of frame.h, with the
// handshake of handshake.h in front.
//
// The same class serves the "shm" transport: a Unix socket between two
// processes of one host, plus one shared ring per direction (shm/ring.h)
// that carries the bytes of large segments while the socket carries frame
// heads, small segments and the rings' chunk records. Segments of 64 KiB or
// more go through shared slabs first (shm/slab.h): one copy on the sender's
// side, none on the receiver's, and none at all for a storage handed back to
// the peer it came from; the ring takes them only when the connection's
// slabs are at their bounds.
//
// Threads: write() and close() from any thread; everything named *FromLoop
// on the loop thread. Reads go straight into the buffers the observer hands
// out for segments of 16 KiB or more; smaller pieces pass through a 64 KiB
// staging buffer so a small frame costs one read(2).
class TcpConnection final : public Connection,
                            public Pollable,
                            public std::enable_shared_from_this<TcpConnection> {
 public:
  // An outbound connection; connect(2) starts on the loop thread.
  static std::shared_ptr<TcpConnection> connect(
      Loop& loop,
      const TransportOptions& options,
      const std::string& address,
      int32_t expectedPeerId,
      ConnectionObserver* observer,
      bool shm);

  // An accepted socket; the handshake starts at once. Loop thread.
  static std::shared_ptr<TcpConnection> acceptFromLoop(
      Loop& loop,
      const TransportOptions& options,
      int fd,
      std::string peerAddress,
      ConnectionObserver* observer,
      bool shm);

  ~TcpConnection() override;

  bool write(OutboundFrame frame) override;
  void close(const std::string& reason) override;
  int32_t peerId() const override {
    return peerId_.load();
  }
  bool isReady() const override {
    return state_.load() == State::kReady;
  }
  bool isClosed() const override {
    return state_.load() == State::kClosed;
  }
  bool isOutbound() const override {
    return outbound_;
  }
  std::string describe() const override;
  void runAfterDispatch(std::function<void()> fn, bool expectMore) override {
    loop_.runAfterDispatch(std::move(fn), expectMore);
  }
  void expectInput() override {
    loop_.expectInput();
  }
  std::string closeReason() const override;
  bool rejectedPeer() const override {
    return rejected_.load();
  }

  void handleEventsFromLoop(uint32_t events) override;
  // shm: the peer released ring space we wait for. Loop thread.
  void onRingWakeFromLoop();

  // shm slabs (connection_slabs.cpp), from a SlabLease's destructor on any
  // thread: we no longer use the peer's slab `id` (tell the peer), or our own
  // slab `id` came back from the peer and is free again.
  void releasePeerSlab(uint32_t id, uint64_t capacity);
  void freeOwnSlab(uint32_t id);

 private:
  enum class State { kConnecting, kHandshake, kReady, kClosed };
  enum class ReadPhase { kHeader, kLengthsAndHead, kSegments };

  struct PendingWrite {
    std::string prefix; // header + segment lengths + head
    OutboundFrame frame;
    size_t written = 0; // bytes of this frame already on the wire
    bool control = false; // handshake frame: may go before kReady
    // Descriptors sent with the frame's first byte (SCM_RIGHTS); owned by
    // the connection's ring.
    std::vector<int> passFds;
    // shm: which segments go through the ring (empty: none). Such a frame is
    // written piece by piece: the prefix, then each segment as bytes or as
    // ring chunks announced by ChunkRecords.
    std::vector<bool> ring;
    size_t piece = 0; // 0: prefix; i + 1: segment i
    size_t pieceOffset = 0;
    std::string records; // ChunkRecords not yet on the socket
    size_t recordsWritten = 0;
    // shm: what goes on the wire in place of slab segments (the frame's
    // segments point here).
    std::vector<shm::SlabRecord> slabRecords;
    // Partly on the wire: nothing may be sent before the rest of it.
    bool started() const {
      return written > 0 || piece > 0 || pieceOffset > 0;
    }
  };
  enum class RingFlush { kDone, kSocketFull, kRingFull };

  TcpConnection(
      Loop& loop,
      const TransportOptions& options,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer,
      bool shm);

  void startFromLoop(bool connecting);
  void onConnectedFromLoop();
  void onReadableFromLoop();
  // read(2) into `dst`: >0 bytes read, 0 would block, -1 closed (the
  // connection has been closed with the reason).
  ssize_t readFromLoop(void* dst, size_t size);
  // `bytes` more of the current segment are in; finish the frame when the
  // last segment is complete.
  void advanceSegmentFromLoop(size_t bytes);
  // Consume staged bytes; false once the connection has closed.
  bool consumeFromLoop();
  bool onHeaderFromLoop();
  bool onLengthsAndHeadFromLoop();
  bool onHandshakeFrameFromLoop(std::string head);
  void finishFrameFromLoop();
  void skipEmptySegments();

  void queueControl(uint8_t kind, std::string head);
  // Every heartbeatTimeout / 5 once ready: ping if idle, close if silent.
  void scheduleHeartbeat();
  void heartbeatFromLoop();
  void noteActivity() {
    lastActivity_.store(
        std::chrono::steady_clock::now().time_since_epoch().count(),
        std::memory_order_relaxed);
  }
  // Write as much as the socket takes. Returns an error text or "".
  std::string flushLocked();
  // Push a frame with ring segments as far as the socket and ring allow.
  RingFlush flushRingFrameLocked(PendingWrite& w, std::string* error);
  // send(2) what the socket takes now: bytes sent, 0 if it would block,
  // -1 with `error` set.
  ssize_t sendSome(const char* data, size_t size, std::string* error);
  // write(2), or sendmsg(2) with `fds` attached.
  ssize_t sendLocked(const iovec* iov, int n, const std::vector<int>* fds);
  // Queue the kRing frame that hands our outbound ring to the peer.
  void queueRingSetupLocked();
  bool onRingSetupFromLoop();
  bool isRingSegment() const {
    return !ringSegments_.empty() && ringSegments_[segmentIndex_];
  }
  bool isSlabSegment() const {
    return !slabSegments_.empty() && slabSegments_[segmentIndex_];
  }
  // Writer, without writeMutex_: send `segment` through a slab if it is
  // large enough and the bounds allow. Fills `record`, and `setup` with a
  // new slab the peer must be handed first. False: send it another way.
  bool prepareSlabSegment(
      const OutboundFrame::Segment& segment,
      shm::SlabRecord* record,
      std::shared_ptr<shm::Slab>* setup);
  // The kSlab frame handing `slab` (our slab `id`) to the peer.
  PendingWrite slabSetupFrame(uint32_t id, std::shared_ptr<shm::Slab> slab);
  // Reader: the frames and records of the slab protocol. False once closed.
  bool onSlabSetupFromLoop();
  bool onSlabReleaseFromLoop();
  bool onSlabDropFromLoop();
  bool onSlabRecordFromLoop();
  // Unmap free slabs idle for kSlabIdleMs, telling the peer to unmap them
  // too.
  void trimSlabs();
  // Queue one kSlabRelease frame for every pending release (writeMutex_).
  void queueReleasesLocked();
  void flushReleases();
  void updateEventsLocked();
  // Destroy the keepAlives of finished frames; off the loop thread when the
  // options say how. Call without writeMutex_ held.
  void releaseFinished();
  // After a flush under writeMutex_ (released by now): releaseFinished(),
  // then close the connection if the flush failed with `error`.
  void afterFlush(const std::string& error);
  void closeInternal(std::string reason, bool local);
  // Close because the peer broke the protocol (see rejectedPeer()).
  void rejectFromLoop(const std::string& reason) {
    rejected_ = true;
    closeInternal(reason, false);
  }

  Loop& loop_;
  const TransportOptions& options_;
  int fd_;
  const bool outbound_;
  const int32_t expectedPeerId_;
  const std::string peerAddress_;
  ConnectionObserver* const observer_;
  const bool shm_;
  shm::Ring ringOut_; // ours, written under writeMutex_
  shm::Ring ringIn_; // the peer's, read on the loop thread
  bool ringBlocked_ = false; // a frame waits for ring space (writeMutex_)
  std::vector<int> receivedFds_; // loop thread
  std::atomic<State> state_;
  std::atomic<int32_t> peerId_{-1}; // set once authenticated
  std::atomic<bool> rejected_{false};
  // steady_clock ticks of the last byte received or accepted by the socket.
  std::atomic<int64_t> lastActivity_{0};
  Handshake handshake_; // loop thread

  mutable std::mutex writeMutex_;
  std::deque<PendingWrite> writes_;
  std::vector<std::shared_ptr<void>> finished_; // keepAlives of sent frames
  bool registered_ = false;
  bool wantWrite_ = false;
  std::string closeReason_;

  // Loop-thread read state.
  std::vector<char> staging_;
  size_t stagedBegin_ = 0;
  size_t stagedEnd_ = 0;
  ReadPhase phase_ = ReadPhase::kHeader;
  FrameHeader header_{};
  size_t phaseFilled_ = 0;
  std::string lengthsAndHead_;
  std::vector<uint64_t> segmentSizes_;
  InboundBuffers inbound_;
  size_t segmentIndex_ = 0;
  size_t segmentFilled_ = 0;
  std::string head_;
  std::vector<bool> ringSegments_; // of the frame being read (shm)
  shm::ChunkRecord record_{};
  size_t recordFilled_ = 0;
  std::vector<bool> slabSegments_; // of the frame being read (shm)
  shm::SlabRecord slabRecord_{};
  size_t slabRecordFilled_ = 0;
  // The peer's slabs we have mapped, by id (loop thread).
  std::unordered_map<uint32_t, std::shared_ptr<shm::Slab>> peerSlabs_;
  uint64_t peerSlabBytes_ = 0;

  // Our slabs, by id. kFree: in our pool; kLent: the peer's tensors use it;
  // kLocal: handed back by the peer, our tensors use it.
  struct OwnSlab {
    enum class State { kFree, kLent, kLocal };
    std::shared_ptr<shm::Slab> slab;
    State state = State::kFree;
    std::chrono::steady_clock::time_point lastUsed;
  };
  std::mutex slabMutex_; // guards the members below; never held while
                         // copying or taking another lock
  std::unordered_map<uint32_t, OwnSlab> ownSlabs_;
  uint32_t nextSlabId_ = 1;
  size_t slabsBeingMapped_ = 0; // ids taken, not yet in ownSlabs_
  uint64_t lentSlabBytes_ = 0;
  // Releases of the peer's small slabs not yet sent (writeMutex_): they ride
  // with our next frame, or go alone on the heartbeat tick.
  std::string pendingReleases_; // uint32 ids
};

} // namespace torch_rpc_ext::transport::tcp
