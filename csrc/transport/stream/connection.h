// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/common/cpace.h"
#include "csrc/common/source_strikes.h"
#include "csrc/transport/connection.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/stream/frame_ring.h"
#include "csrc/transport/stream/loop.h"
#include "csrc/transport/stream/pending_write.h"
#include "csrc/transport/tls.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::stream {

// The tag both of the key exchange's messages begin with (docs/
// wire-format.md, "Key exchange"); its first byte is neither TLS's (0x16) nor
// a frame header's ('T'), so an accepting end tells the three apart by it.
inline constexpr char kExchangeTag[4] = {'C', 'P', 'c', '1'};

// The stream core every socket transport shares: a non-blocking stream
// socket speaking the frame protocol of frame.h with the handshake of
// handshake.h in front, a heartbeat, a write queue, descriptor passing, and
// an incremental parser that checks every length before it allocates.
//
// A backend (tcp/, shm/) derives from it and fills in the hooks below: how
// the socket is tuned and whether it passes descriptors. Tensor bytes that
// travel out of band go through the connection's channels
// (csrc/channel/channel.h), which the stream core hosts: it opens the ones
// TransportOptions::channelsFor names once the peer is known, offers them
// each segment, routes their records and control frames, and sends theirs.
//
// Threads: write() and close() from any thread; everything named *FromLoop
// on the loop thread; *Locked with writeMutex_ held. Reads go straight into
// the buffers the observer hands out for segments of 16 KiB or more;
// smaller pieces pass through a 64 KiB staging buffer so a small frame costs
// one read(2).
class StreamConnection : public Connection,
                         public channel::Host,
                         public Pollable,
                         public std::enable_shared_from_this<StreamConnection> {
 public:
  ~StreamConnection() override;

  // Outbound: start connecting to `to` (a parsed `address`); the handshake
  // follows on the loop thread. Errors close the connection, as does a
  // non-empty `refused` (why the address cannot be reached from here).
  void startConnect(
      const std::string& address,
      const std::string& refused = {});
  // Accepted socket: the handshake starts at once. Loop thread.
  void startAcceptedFromLoop();
  // Accepted, before it starts: a proof of the peer's refused here (a
  // wrong secret, a failed TLS handshake) counts against `source`
  // (StreamTransport::acceptedFromLoop holds off those that fail often).
  void countRefusalsAgainst(
      std::shared_ptr<SourceStrikes> strikes,
      std::string source) {
    strikes_ = std::move(strikes);
    strikeSource_ = std::move(source);
  }
  // Outbound: a TLS handshake left unfinished after our key exchange (our
  // binder out: its server learned whether a guess at the secret was right),
  // not by this end, counts against `target`; heldOffServerText(): why a
  // dial to one held off is refused (StreamTransport::connect()).
  void countGuessesAgainst(std::shared_ptr<SourceStrikes> s, std::string t);
  static std::string heldOffServerText(
      const SourceStrikes&,
      const std::string&);

  bool write(frame::OutboundFrame frame) override;
  void close(const std::string& reason) override;
  bool hasQueuedWrites() const override;
  int32_t peerId() const override {
    return peerId_.load();
  }
  uint64_t peerIncarnation() const override {
    // Written before peerId_ (release by its atomic store): valid once
    // peerId() is.
    return peerInc_;
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
  std::string security() const override;
  void runAfterDispatch(std::function<void()> fn, bool expectMore) override {
    loop_.runAfterDispatch(std::move(fn), expectMore);
  }
  void expectInput() override {
    loop_.expectInput();
  }
  void settleChannels() override;
  bool channelsSettled() override;
  std::string closeReason() const override;
  bool rejectedPeer() const override {
    return rejected_.load();
  }
  bool knockOnly() const override {
    return knockOnly_.load();
  }

  void handleEventsFromLoop(uint32_t events) override;
  bool ringInputFromLoop() override;
  bool parkRingFromLoop() override;
  void unparkRingFromLoop() override {
    if (inRing_) {
      inRing_->unparkReceiver();
    }
  }

  // channel::Host.
  void sendControl(channel::ControlFrame frame) override;
  void sendPendingControl() override;
  void post(std::function<void()> fn) override;
  void postAfter(std::chrono::milliseconds delay, std::function<void()> fn)
      override {
    loop_.runAfter(delay, std::move(fn));
  }
  void watchFromLoop(int fd, std::function<void()> onReadable) override;
  void unwatchFromLoop(int fd) override;
  void resumeWritesFromLoop() override;
  void rejectFromLoop(const std::string& reason) override {
    rejected_ = true;
    closeInternal(reason, false);
  }
  void loseFromLoop(const std::string& reason) override {
    closeInternal(reason, false);
  }
  void resumeReadsFromLoop() override;
  void noteProgress() override {
    noteActivity();
  }
  std::chrono::milliseconds heartbeatTimeout() const override {
    return options_.heartbeatTimeout;
  }
  bool socketAddresses(sockaddr_storage* local, sockaddr_storage* peer)
      const override;
  bool encrypted() const override {
    return tls_ != nullptr;
  }
  void releaseLater(std::shared_ptr<void> keepAlive) override {
    if (options_.releaseOffLoop) {
      std::vector<std::shared_ptr<void>> one;
      one.push_back(std::move(keepAlive));
      options_.releaseOffLoop(std::move(one));
    }
  }

  // Fuzzing and tests only (tests/fuzz/fuzz_stream.cpp): parse `data` on the
  // calling thread as if a ready connection had just read it from its socket
  // (the handshake skipped), with `fds` as the descriptors that came with
  // it. For a connection made with fd -1 that was never started. Returns
  // false once the connection has closed (the peer's input was rejected).
  bool feedForTesting(const char* data, size_t size, std::vector<int> fds = {});

 protected:
  // kTls: the TLS handshake, on a connection that encrypts (tls.h), before
  // the frame protocol's own handshake.
  enum class State { kConnecting, kTls, kHandshake, kReady, kClosed };

  // A frame queued for the socket and how far it is written
  // (pending_write.h).
  using PendingWrite = stream::PendingWrite;

  // `fd` is a connected (accepted) or connecting (outbound) stream socket,
  // owned from now on.
  StreamConnection(
      Loop& loop,
      const TransportOptions& options,
      std::string transportName,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer,
      std::shared_ptr<const TlsContext> tls = nullptr);

  // ---- Backend hooks --------------------------------------------------
  // Socket options for the new socket (before connect or the handshake).
  virtual void tuneSocket() {}
  // Whether the socket can pass descriptors (SCM_RIGHTS): channels that need
  // it are opened only then. False: reads use read(2).
  virtual bool passesDescriptors() const {
    return false;
  }

  // ---- For backends ----------------------------------------------------
  int fd() const {
    return fd_;
  }

 private:
  // Queue a control frame of the core's (may go before kReady) and flush.
  void queueControl(uint8_t kind, std::string head);
  // Put `w` ahead of every frame not yet started.
  void insertControlLocked(PendingWrite w);
  // sendControl and sendPendingControl: `frames`, and with `collect` the
  // channels' waiting ones, queued ahead of message frames not yet started.
  void sendControlFrames(
      std::vector<channel::ControlFrame> frames,
      bool collect);
  // A channel's control frame, ready for writes_ (not queued).
  PendingWrite controlFrame(channel::ControlFrame frame);
  // Write as much as the socket takes. Returns an error text or "".
  std::string flushLocked();
  // After a flush under writeMutex_ (released by now): releaseFinished(),
  // then writeFailed(error) if the flush failed.
  void afterFlush(const std::string& error);
  // A write failed with `error`. It closes the connection, unless the peer,
  // once it proved itself, closed its end (the socket refused our or
  // TlsSession's send: EPIPE, ECONNRESET): then what it sent before it
  // closed is still ours to read, and is delivered first
  // (closeAfterInputFromLoop(), posted). Returns whether the connection
  // stays open for that.
  bool writeFailed(const std::string& error);
  // Reads what the peer left in the socket (and its frame ring), then
  // closes with `error` if the peer's end did not close it first.
  void closeAfterInputFromLoop(const std::string& error);
  // Bytes of the peer's wait unread: in our socket, or in its frame ring.
  bool inputWaitingFromLoop() const;
  // What the handshake waits for from the peer ("its proof"), for the
  // handshake timeout's message (loop thread).
  std::string awaitedText() const;
  void closeInternal(std::string reason, bool local);
  // Accepted, and closed (`reset`: reset) by the peer before its first
  // byte: a knock on the listener (knockOnly()), not a failed handshake.
  void closeKnockedFromLoop(bool reset);
  // Accepted: the peer's proof was refused (countRefusalsAgainst).
  void strikeSourceFromLoop();
  void logServerHeldOff(const std::string& reason); // as a hold-off begins
  // Accepted, mid-handshake: closes it if its source is held off now.
  bool closedForHeldOffSourceFromLoop();

  Loop& loop_;
  const TransportOptions& options_;
  std::atomic<State> state_;
  // settleChannels() asked, its loop task not yet run.
  std::atomic<int> settlesPending_{0};
  mutable std::mutex writeMutex_;
  std::deque<PendingWrite> writes_;
  bool chunksBlocked_ = false; // a frame waits for chunk room (writeMutex_)
  // The next bytes to write are staged ones not yet ready (writeMutex_).
  bool stagingBlocked_ = false;
  // The channels, in order of preference: set once (outbound: on connect;
  // accepted: when the peer is authenticated) and read-only afterwards.
  std::vector<std::shared_ptr<channel::Channel>> channels_;
  // The most descriptors one frame brings (a channel's setup, a frame
  // ring's offer), and the most that may wait for their frames: twice that
  // (openChannels() says why). More in one read, or more waiting, closes
  // the connection.
  size_t maxFdsPerFrame_ = 0;
  size_t maxPendingFds_ = 0;
  // Loop thread: the head of the control frame being handled, descriptors
  // received and not yet claimed, and the frame being read.
  std::string head_;
  std::vector<int> receivedFds_;
  std::vector<uint64_t> segmentSizes_;
  size_t segmentIndex_ = 0;
  size_t segmentFilled_ = 0;
  frame::InboundBuffers inbound_;
  // Where a staging channel lands the current segment's bytes.
  char* landing_ = nullptr;

  enum class ReadPhase { kHeader, kLengthsAndHead, kSegments };

  bool startFromLoop(bool connecting); // false: closed
  void onConnectedFromLoop();
  // Whether this connection encrypts: kClear (no TLS context, or an
  // outbound one whose peer's address does not call for it), kEncrypt
  // (state kTls; outbound: the session is made; accepted: the client's
  // first byte decides, see driveTlsFromLoop()), kClosed (it failed).
  enum class TlsStart { kClear, kEncrypt, kClosed };
  TlsStart startTlsFromLoop();
  // Advance the TLS handshake; on its end the frame handshake starts.
  void driveTlsFromLoop();
  // The key exchange before TLS under the group's key (tls.h): the
  // client's offer sent, the peer's message read as it comes; once whole,
  // the TLS session is made under the key both derive. True when tls_ is
  // set; false while waiting or once closed.
  bool sendOfferFromLoop();
  bool exchangeFromLoop();

  // Closes on a share that gives no secret; accepted: a strike against the
  // source, as for a refused proof.
  void refuseExchangeFromLoop(const std::string& reason);
  // Sends the offer or the answer (`what`) whole; false once closed.
  bool sendExchangeMessageFromLoop(
      const std::string& message,
      const char* what);
  void onReadableFromLoop();
  // read(2) into `dst`: >0 bytes read, 0 would block, -1 closed (the
  // connection has been closed with the reason). `piecewise`: a large
  // segment's body, which a frame ring hands back in pieces as it copies
  // (FrameRing::read).
  ssize_t readFromLoop(void* dst, size_t size, bool piecewise = false);
  // Why the connection ended when the peer closed it after our proof.
  std::string refusedProofText() const;
  // `bytes` more of the current segment are in; finish the frame when the
  // last segment is complete.
  void advanceSegmentFromLoop(size_t bytes);
  // Consume staged bytes; false once the connection has closed.
  bool consumeFromLoop();
  // Offers the complete record_ to its channel: false once the connection
  // is closing or the record is held (recordHeld_).
  bool placeRecordFromLoop();
  // The epoll events to watch besides EPOLLOUT: none while a record is held
  // (one more, EPOLLONESHOT, once its socket ended: epoll reports an error or
  // hang-up whatever is asked).
  uint32_t readEvents() const;
  // The socket reported its end while a record is held: the record's bytes
  // may still come another way, and what the socket holds is read after.
  void socketEndedWhileHeldFromLoop();
  bool onHeaderFromLoop();
  bool onLengthsAndHeadFromLoop();
  bool onHandshakeFrameFromLoop(std::string head);
  void finishFrameFromLoop();
  void skipEmptySegments();
  // The channel carrying segment segmentIndex_ (index in channels_ plus one;
  // 0: the stream).
  uint8_t carried() const {
    return carried_.empty() ? 0 : carried_[segmentIndex_];
  }
  // Whether the current segment's bytes follow in the stream (its own, or
  // a staging channel's), rather than records.
  bool bytesInline() const {
    uint8_t c = carried();
    return c == 0 ||
        channels_[c - 1]->context().mode() == channel::Channel::Mode::kStaged;
  }
  // Inline bytes of the current segment: where the next ones go, and
  // taking `n` of them that arrived there.
  char* inlineTargetFromLoop();
  bool inlineArrivedFromLoop(size_t n);
  channel::InboundSegment inboundSegment();
  // Open the channels for talking to `peerId` (once, before any frame of
  // theirs can be written or read).
  void openChannels(int32_t peerId);
  // The channel slot (index plus one) named by `wireId` on the wire, or 0.
  uint8_t channelSlot(uint8_t wireId) const;
  // Sender: choose how each segment travels (the channels' copies happen
  // now, on the calling thread, with no lock held). `slots`: per segment,
  // the channel slot that carries it as a region or staged (empty: none).
  void planSegments(
      frame::OutboundFrame& frame,
      PendingWrite& w,
      std::vector<uint8_t>& slots,
      std::vector<channel::ControlFrame>& before);
  // Sender: a staged segment `i` (copying out of its device) offered to the
  // host region channels (tcp_lanes), which write it as it gets ready;
  // true (`staged` moved to w.stagedElsewhere, `slots[i]` set) if one took
  // it.
  bool offerStagedToHostChannels(
      const frame::OutboundFrame& frame,
      size_t i,
      std::shared_ptr<channel::StagedOut>& staged,
      PendingWrite& w,
      std::vector<uint8_t>& slots);
  // A frame whose planning failed: the region channels give back what they
  // took for it, and the frames they queued in `before` are sent.
  void abandonPlan(
      const frame::OutboundFrame& frame,
      const PendingWrite& w,
      const std::vector<uint8_t>& slots,
      std::vector<channel::ControlFrame> before);
  // Heartbeat tick: the channels' housekeeping.
  void tickChannelsFromLoop();
  // (Re-)arm the handshake timer; see handshakeTimeoutFromLoop().
  void armHandshakeTimer(std::chrono::milliseconds after);
  void handshakeTimeoutFromLoop();

  // Every heartbeatTimeout / 5 once ready: ping if idle, close if silent.
  void scheduleHeartbeat();
  void heartbeatFromLoop();
  void noteActivity() { // (the peer's sign of life)
    lastActivity_.store(
        std::chrono::steady_clock::now().time_since_epoch().count(),
        std::memory_order_relaxed);
  }
  // A send's: a sign of life only after one found no room (writeMutex_).
  void noteSentLocked(ssize_t sent, size_t asked);
  bool outFull_ = false;
  // Push a frame with chunked segments as far as the socket and channel
  // allow.
  enum class ChunkFlush { kDone, kSocketFull, kChannelFull };
  ChunkFlush flushChunkedFrameLocked(PendingWrite& w, std::string* error);
  // `written` (a send's result), counted in the loop's bytesWritten.
  ssize_t counted(ssize_t written);
  // Whether `w` may start: each of its staged segments has bytes ready.
  static bool stagedStartable(const PendingWrite& w);
  // send(2) what the socket takes now: bytes sent, 0 if it would block,
  // -1 with `error` set.
  ssize_t sendSome(const char* data, size_t size, std::string* error);
  // write(2), or sendmsg(2) with `fds` attached; into the frame ring
  // once the frames go there (`ringWait`: as sendToRingLocked's).
  ssize_t sendLocked(
      const iovec* iov,
      int n,
      const std::vector<int>* fds,
      std::chrono::nanoseconds* ringWait = nullptr);
  ssize_t sendSocketLocked(
      const iovec* iov,
      int n,
      const std::vector<int>* fds);
  // Into outRing_: what fits (-1 with EAGAIN when nothing does, the sender
  // parked; -1 with EPROTO and ringError_ on a bad peer counter). `fds` go
  // first on the socket, with one byte. `ringWait`, when given: a full ring
  // is waited on for room (kRingSenderSpin at a time) while this budget,
  // which the wait draws down, lasts; without it the sender parks at once.
  ssize_t sendToRingLocked(
      const iovec* iov,
      int n,
      const std::vector<int>* fds,
      std::chrono::nanoseconds* ringWait = nullptr);
  // A sender that found its frame ring full waits up to kRingSenderSpin
  // for room while the receiver is awake, before it parks for a signal: a
  // frame larger than the ring (64 KiB by default; cuda_staged's bytes on
  // one host) otherwise pays a signal and a wake-up per ring-full. Only
  // while such a frame is the first of a write (flushLocked): small frames
  // that filled the ring (many calls in flight) leave the rest to the loop,
  // which the receiver's signal wakes. At most kRingWaitPerFlush in all per
  // flush, so a receiver that takes a few bytes now and then cannot hold
  // the writing thread.
  static constexpr std::chrono::microseconds kRingSenderSpin{50};
  static constexpr std::chrono::microseconds kRingWaitPerFlush{1000};
  // A receiver mid-way through a large segment streaming in pieces that
  // finds its ring empty waits up to this for the sender's next piece
  // before going back to its loop (and, with nothing else to do, parking
  // for a signal); it reads and waits for at most kRingWaitPerFlush per
  // call of onReadableFromLoop(), whose loop's other connections wait
  // meanwhile.
  static constexpr std::chrono::microseconds kRingReceiverSpin{50};
  // Frame ring: offer ours once ready (options_.frameRingBytes), and take
  // the peer's from its kFrameRing frame (connection_ring.cpp).
  void offerFrameRingFromLoop();
  bool onFrameRingFromLoop();
  // The other end of a ring signalled (inbound: bytes for a parked
  // receiver; outbound: room for a parked sender).
  void onRingSignalFromLoop(bool inbound);
  // Before a frame from the ring with kFlagCarrier is handled: its carrier
  // (one byte; its descriptors came with it). False once closing.
  bool takeCarrierFromLoop();
  // A frame about to go through the ring, first byte not yet written: its
  // flags (a carrier; a large body that goes on the socket).
  void markForRingLocked(PendingWrite& w);
  // A ring frame's body on the socket begins (its flag; false once
  // closing), or ends (watchSocketBodyFromLoop(false)).
  bool beginSocketBodyFromLoop();
  void watchSocketBodyFromLoop(bool reading);
  // The socket's part of readFromLoop(); with !closeAtEnd, the peer's end
  // returns kSocketEnded instead of closing the connection.
  static constexpr ssize_t kSocketEnded = -2;
  // The reason a connection closes with once the peer's end is read.
  static constexpr const char* kPeerClosed = "peer closed the connection";
  ssize_t readSocketFromLoop(void* dst, size_t size, bool closeAtEnd = true);
  void updateEventsLocked();
  // Tells the region channels that `w`, whose segments they took, joins
  // writes_ now (Channel::onRegionsQueuedLocked).
  void announceRegionsLocked(
      PendingWrite& w,
      const std::vector<uint8_t>& slots);
  // Destroy the keepAlives of finished frames; off the loop thread when the
  // options say how. Call without writeMutex_ held.
  void releaseFinished();

  const std::string transportName_;
  // The transport's TLS context (null: never encrypts), and this
  // connection's session once it encrypts: set on the loop thread under
  // writeMutex_ while kTls (under certificates: outbound as it enters it,
  // accepted when the client's first byte is TLS; under the group's key:
  // once the key exchange is done), never changed after; writers use it
  // only from kHandshake on.
  const std::shared_ptr<const TlsContext> tlsContext_;
  std::unique_ptr<TlsSession> tls_;
  // kTls under the group's key, until tls_ is made: this end's part of the
  // exchange (made with the client's offer) and the peer's message as far
  // as it came (a fixed size). Loop thread.
  std::unique_ptr<cpace::Exchange> exchange_;
  std::string exchangeIn_;
  // Accepted, in kTls: whether the peer's address requires TLS (a client in
  // the clear is refused then). Loop thread.
  bool tlsRequired_ = false;
  // The error of the TLS write that failed, and the small pieces of frames
  // gathered into one record (writeMutex_).
  std::string tlsWriteError_;
  std::string tlsGather_;
  int fd_;
  const bool outbound_;
  const int32_t expectedPeerId_;
  const std::string peerAddress_;
  ConnectionObserver* const observer_;
  std::atomic<int32_t> peerId_{-1}; // set once authenticated
  uint64_t peerInc_ = 0;
  std::atomic<bool> rejected_{false};
  // Accepted, and closed by the peer before its first byte (knockOnly()).
  std::atomic<bool> knockOnly_{false};
  // The peer's proof checked out (loop thread sets): what it sent after it
  // is the peer's, even once it has gone.
  std::atomic<bool> peerProven_{false};
  std::shared_ptr<SourceStrikes> strikes_; // accepted (loop thread)
  std::string strikeSource_;
  std::shared_ptr<SourceStrikes> guessStrikes_; // outbound; set, then read
  std::string guessTarget_;
  std::atomic<bool> guessOut_{false}; // our binder is out, TLS not done
  // The last write failed because the peer closed its end (writeMutex_
  // sets), and closeAfterInputFromLoop() is posted for it.
  std::atomic<bool> peerEndedWrites_{false};
  std::atomic<bool> closingAfterInput_{false};
  bool receivedAny_ = false; // loop thread: a byte arrived on the socket
  // steady_clock ticks of the last byte received or accepted by the socket.
  std::atomic<int64_t> lastActivity_{0};
  Handshake handshake_; // loop thread
  // Loop thread: when the handshake started, and when its timer is due.
  std::chrono::steady_clock::time_point handshakeStartedAt_;
  std::chrono::steady_clock::time_point handshakeDue_;
  // Loop thread: when the next heartbeat tick is due.
  std::chrono::steady_clock::time_point tickDue_;

  std::vector<std::shared_ptr<void>> finished_; // keepAlives (writeMutex_)
  bool registered_ = false;
  bool wantWrite_ = false;
  std::string closeReason_;

  // Loop-thread read state. The staging buffer is allocated on first use
  // and left uninitialised: a connection that only sees small frames keeps
  // few of its pages resident.
  std::unique_ptr<char[]> staging_;
  size_t stagedBegin_ = 0;
  size_t stagedEnd_ = 0;
  std::atomic<ReadPhase> phase_{ReadPhase::kHeader}; // (heartbeat reads it)
  frame::FrameHeader header_{};
  size_t phaseFilled_ = 0;
  std::string lengthsAndHead_;
  std::vector<uint8_t> carried_; // of the frame being read (empty: bytes)
  frame::SegmentRecord record_{};
  size_t recordFilled_ = 0;
  // record_ is complete and its channel held it (its bytes are on their way
  // by another way): nothing more is read until resumeReadsFromLoop(). Set
  // on the loop thread; read by updateEventsLocked() on any.
  std::atomic<bool> recordHeld_{false};
  // The socket ended (reset, error, hang-up) while a record was held; it is
  // read to its end once reads resume (socketEndedWhileHeldFromLoop()).
  std::atomic<bool> socketEndedWhileHeld_{false};
  // closeAfterInputFromLoop()'s reason, kept while a record is held: it
  // runs again once reads resume (loop thread).
  std::optional<std::string> closeWhenResumed_;

  // Frame rings. Ours (writeMutex_), used once its kFrameRing frame is on
  // the socket (ringOut_), and why a write to it failed; the peer's (loop
  // thread), with the descriptor carriers taken so far.
  std::unique_ptr<FrameRing> outRing_;
  bool ringOut_ = false;
  bool carrierBlocked_ = false; // a carrier's send would block (writeMutex_)
  std::string ringError_;
  std::unique_ptr<FrameRing> inRing_;
  // inRing_ is set: the socket is watched for its end only (readEvents(),
  // from any thread).
  std::atomic<bool> ringIn_{false};
  uint64_t carriersReceived_ = 0;
  bool socketEnded_ = false; // the peer closed; its ring is read to the end
  // A body on the socket (kFlagBodyOnSocket): being written, the socket
  // full (writeMutex_); being read (loop thread; readEvents() from any),
  // its bytes still to come, and what was read from the ring past its
  // frame meanwhile (read again first once the body is in).
  bool socketBodyBlocked_ = false;
  std::atomic<bool> bodyOnSocket_{false};
  uint64_t bodyLeft_ = 0;
  std::string ringStash_;
  // Socket bytes read with the kFrameRing frame, past it: carriers and
  // bodies, taken before the socket's next bytes.
  std::string socketStash_;
  static ssize_t takeStashed(std::string& stash, void* dst, size_t size) {
    size_t take = std::min(size, stash.size());
    std::memcpy(dst, stash.data(), take);
    stash.erase(0, take);
    return static_cast<ssize_t>(take);
  }
};

} // namespace torch_rpc_ext::transport::stream
