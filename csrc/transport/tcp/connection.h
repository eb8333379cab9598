// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/transport/connection.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/tcp/loop.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::tcp {

// A non-blocking TCP socket speaking the frame protocol of frame.h, with the
// handshake of handshake.h in front.
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
      ConnectionObserver* observer);

  // An accepted socket; the handshake starts at once. Loop thread.
  static std::shared_ptr<TcpConnection> acceptFromLoop(
      Loop& loop,
      const TransportOptions& options,
      int fd,
      std::string peerAddress,
      ConnectionObserver* observer);

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
  std::string closeReason() const override;

  void handleEventsFromLoop(uint32_t events) override;

 private:
  enum class State { kConnecting, kHandshake, kReady, kClosed };
  enum class ReadPhase { kHeader, kLengthsAndHead, kSegments };

  struct PendingWrite {
    std::string prefix; // header + segment lengths + head
    OutboundFrame frame;
    size_t written = 0; // bytes of this frame already on the wire
    bool control = false; // handshake frame: may go before kReady
  };

  TcpConnection(
      Loop& loop,
      const TransportOptions& options,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer);

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
  // Write as much as the socket takes. Returns an error text or "".
  std::string flushLocked();
  void updateEventsLocked();
  // Destroy the keepAlives of finished frames; off the loop thread when the
  // options say how. Call without writeMutex_ held.
  void releaseFinished();
  void closeInternal(std::string reason, bool local);

  Loop& loop_;
  const TransportOptions& options_;
  int fd_;
  const bool outbound_;
  const int32_t expectedPeerId_;
  const std::string peerAddress_;
  ConnectionObserver* const observer_;
  std::atomic<State> state_;
  std::atomic<int32_t> peerId_{-1}; // set once authenticated
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
};

} // namespace torch_rpc_ext::transport::tcp
