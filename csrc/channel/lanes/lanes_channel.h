// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/channel/lanes/context.h"
#include "csrc/common/crypto.h"

namespace torch_rpc_ext::channel::lanes {

// One connection's end of tcp_lanes (context.h), both ways.
//
// Receiving: once the connection is ready, the channel listens (through its
// context), and offers the peer its lanes in a control frame: the port, a
// ticket per lane, a fresh lane secret (hello MACs and, on an encrypted
// connection, the lanes' keys derive from it: lane.h) and how many records
// go under one key, all inside the connection (so inside TLS where it has
// TLS). Each lane the
// peer dials gets a reader thread that reads chunks straight into the
// segment's landing memory (from the context's pool), which the receiving
// tensor then views (a region).
//
// Sending: with the peer's offer in, the first segment of at least
// `minBytes` dials the lanes (one thread each, which then writes); until
// every lane is up, segments ride the stream. A segment then goes in
// stripes, one per lane, with the frame's keepAlive, and its record (token,
// size) goes in the stream; the token is given, and the stripes queued to
// the lane threads, as the frame joins the write queue (with the
// connection's write lock held), so that the stripes on every lane and the
// records in the stream come in one order: a receiver holding a record
// never waits for stripes queued behind ones it cannot take yet. A record whose
// stripes are not all in yet holds the stream (onRecordFromLoop() returns 0)
// until the last lands.
//
// A dial that fails (a firewall, NAT) leaves this connection on its stream,
// with a warning; a lane that fails once up closes the connection, naming
// the lane, since its stripes are lost. The context caps the lanes a
// process holds each way: a connection offers, or dials, what is left of
// it (up to its lanes); with none left, none (the stream, meanwhile), and
// the next tick (offers) or large segment (dials) tries again. A dial that
// fails gives its lane back at once and tells the offerer (kDeclineFrame),
// which gives back those it held for us; a closing connection all of its
// own.
//
// Threads: the Channel calls as channel.h says; lane threads of its own,
// each holding a reference to the channel, joined at close (the
// connection's, or the channel's destruction on the last of them to end).
// mutex_ guards the queues, the landings and the state; nothing calls the
// host with it held (a reject closes the connection, which stops us).
class LanesChannel final : public Channel,
                           public std::enable_shared_from_this<LanesChannel> {
 public:
  LanesChannel(
      std::shared_ptr<const LanesContext> context,
      std::weak_ptr<Host> host);
  ~LanesChannel() override;

  // The context's accept thread: lane `lane` of ours has dialled in.
  void attachInbound(uint16_t lane, int fd);

  // Sender.
  void takeRegions(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& offered,
      std::vector<TakenRegion>* taken,
      std::vector<ControlFrame>* before,
      const std::shared_ptr<void>& keepAlive) override;
  // A CUDA segment cuda_staged copies out: striped as its bytes get ready.
  bool takeStaged(
      const frame::OutboundFrame::Segment& segment,
      const std::shared_ptr<StagedOut>& staged,
      frame::SegmentRecord* record,
      const std::shared_ptr<void>& keepAlive) override;
  void abandonRegion(
      const frame::OutboundFrame::Segment& segment,
      const frame::SegmentRecord& record) override;
  void onRegionsQueuedLocked(
      const std::vector<frame::SegmentRecord*>& records) override;
  // Stripes queued on our lanes, or being written.
  bool hasQueuedSends() const override;

  // Receiver.
  int64_t onRecordFromLoop(
      const frame::SegmentRecord& record,
      InboundSegment& segment) override;
  bool acceptsControlFrame(frame::FrameKind kind, uint32_t headLength)
      const override;
  bool onControlFrameFromLoop(
      frame::FrameKind kind,
      const std::string& head,
      std::vector<int>& fds) override;

  // Offers the peer our lanes.
  void onReadyFromLoop() override;
  void onTickFromLoop() override;
  void onClosedFromLoop() override;

 private:
  // A stripe queued to an outbound lane.
  struct Stripe {
    uint64_t token;
    uint64_t segmentSize;
    uint64_t offset;
    uint64_t length;
    const char* data; // the segment's first byte
    std::shared_ptr<void> keepAlive;
    // A staged segment's bytes, written only as far as they are ready
    // (kept alive by keepAlive); null: all there.
    const StagedOut* staged = nullptr;
  };
  struct OutLane {
    int fd = -1;
    std::deque<Stripe> queue;
    std::thread thread;
  };
  // A segment arriving on our lanes.
  struct Landing {
    std::shared_ptr<frame::SharedRegion> region;
    char* data = nullptr;
    uint64_t size = 0;
    uint64_t received = 0;
    // The byte ranges chunks have claimed (offset -> end): no two overlap,
    // so that `received == size` means every byte came.
    std::map<uint64_t, uint64_t> ranges;
    bool claimed = false; // its record came (else: counted as unclaimed)
    bool held = false; // its record waits in the stream
    std::chrono::steady_clock::time_point heldSince;
    std::array<uint64_t, kMaxLanes> laneBytes{}; // what each lane carried
    // steady_clock ticks of its last bytes, and of its last keepalive (its
    // sender still copies it out of a device), on any lane.
    std::atomic<int64_t> bytesAt{0};
    std::atomic<int64_t> keptAt{0};
  };
  // A segment taken, waiting for its frame to be queued (then it gets its
  // token and its stripes go to the lanes).
  struct Taken {
    const char* data;
    uint64_t size;
    std::shared_ptr<void> keepAlive;
    const StagedOut* staged = nullptr;
  };
  // kCapped: the process held its cap of lanes; a later segment tries again.
  enum class OutState { kIdle, kCapped, kDialing, kUp, kFailed };

  const LanesContext& lanesContext() const;
  void sendOfferFromLoop();
  // The peer's kDeclineFrame (loop thread), and ours (any thread but one
  // holding mutex_).
  void onDeclinedFromLoop();
  void sendDecline();
  void startLanesLocked();
  // Whether a large segment goes over the lanes now (dialling them if they
  // are not up yet: this one rides the stream meanwhile).
  bool lanesTakeLocked();
  // A staged stripe's bytes up to `end` are out of the device; false with
  // `error` set once the channel closes first (a failed copy closes it).
  // Calls `waitABit` (which waits up to 10 ms, true once what it waits for
  // is there) until it is, and `sayAlive` every kKeepAliveEvery meanwhile;
  // false with `error` set if the lane failed or the channel closed while
  // `underWay`.
  bool waitSayingAlive(
      const std::function<bool()>& waitABit,
      const std::function<bool()>& sayAlive,
      const char* underWay,
      std::string* error);
  // Waits until `staged` has its bytes up to `end`, calling `keepAlive`
  // every kKeepAliveEvery meanwhile (false: the lane failed).
  bool waitStaged(
      const StagedOut& staged,
      uint64_t end,
      const std::function<bool()>& keepAlive,
      std::string* error);
  // Reads the pages of [data, data + bytes) of a CPU stripe into memory on
  // a thread of their own (a memory-mapped file on slow storage, swap),
  // calling `sayAlive` every kKeepAliveEvery meanwhile; false with `error`
  // set if the lane failed or the channel closed first.
  bool waitResident(
      const char* data,
      uint64_t bytes,
      const std::shared_ptr<void>& keepAlive,
      const std::function<bool()>& sayAlive,
      std::string* error);
  // A keepalive chunk (lane.h) for `stripe` at `offset`, counted.
  bool sendKeepAlive(
      int fd,
      const Stripe& stripe,
      uint64_t offset,
      LaneCipher* cipher,
      std::string* error);
  void runOutLane(uint16_t lane, sockaddr_storage address, std::string ticket);
  // A dialled lane's opening: the listener's challenge in, our Hello out,
  // its admission in.
  bool sayHello(
      int fd,
      uint16_t lane,
      const std::string& ticket,
      std::string* error);
  // Tests only: the stripe's bytes as a misbehaving peer sends them.
  bool writeForged(int fd, const Stripe& stripe, std::string* error);
  bool writeStripe(
      int fd,
      const Stripe& stripe,
      LaneCipher* cipher,
      std::string* buffer,
      std::string* error);
  // Lane `lane` of the peer's, inFds_[slot].
  void runInLane(uint16_t lane, size_t slot, int fd);
  // False with `error` set, and `refused` if the peer broke the protocol
  // (else the lane ended or broke: "closed" between chunks).
  bool readChunk(
      int fd,
      uint16_t lane,
      size_t slot,
      LaneCipher* cipher,
      std::string* error,
      bool* refused);
  // A held record whose stripes stopped coming ("" if none; loop thread):
  // nothing of it (bytes or keepalives) came for twice heartbeat_timeout
  // and no lane's socket took data in that time, or only keepalives for
  // six. Names it and what each lane carried of it.
  std::string stalledLanding();
  // Whether the socket of a lane that may still owe segment `token` bytes
  // took data within `within` (the kernel's own clock: a starved reader, or
  // a slow link whose progress we mark per slice; a lane waiting for room
  // has its window shut). A lane that began a later segment owes it none:
  // a lane carries its stripes in token order. mutex_ held.
  bool lanesReceivingLocked(std::chrono::milliseconds within, uint64_t token)
      const;
  // The landing of `token`, made if new (by a record when `claim`, else
  // by a chunk, which waits while kMaxUnclaimedBytes are unclaimed); null
  // with `error` set, and `refused` if the peer broke the protocol.
  std::shared_ptr<Landing> landingLocked(
      std::unique_lock<std::mutex>& lock,
      uint64_t token,
      uint64_t size,
      bool claim,
      std::string* error,
      bool* refused);
  void eraseLandingLocked(uint64_t token);
  // Whether every landing has all its bytes (a lane may end quietly).
  bool landingsCompleteLocked() const;
  // A lane that ended between chunks with a landing not all in: waits while
  // lanes still open bring bytes (the peer shuts its lanes one by one as it
  // closes, so another may still carry the rest). mutex_ held.
  void lingerLocked(std::unique_lock<std::mutex>& lock);
  // The connection's heartbeat: our peer is alive (lane bytes moved).
  void noteProgress();
  void queueStripesLocked(uint64_t token, Taken taken);
  // Lane threads: the connection must close (a lane broke).
  // `refused`: the peer broke the protocol (else the lane broke or ended).
  void failConnection(const std::string& reason, bool refused);
  // A keepAlive let go where the GIL may not be taken (Host::releaseLater).
  void release(std::shared_ptr<void> keepAlive);
  void stopAll();

  const std::weak_ptr<Host> host_;
  const uint16_t lanes_;
  const uint64_t minBytes_;
  std::atomic<bool> forged_{false}; // testForge done (context.h)
  std::atomic<bool> stuck_{false}; // testStuckCopy taken (context.h)

  mutable std::mutex mutex_;
  std::condition_variable wake_; // out lanes: a stripe or closing
  std::condition_variable budget_; // in lanes: unclaimed bytes went down
  bool closing_ = false;
  std::atomic<bool> stop_{false}; // closing_, for dials without the lock
  // Sender (mutex_).
  OutState outState_ = OutState::kIdle;
  bool offered_ = false; // the peer's offer is in
  sockaddr_storage peerLanes_{}; // its address and lane port
  sockaddr_storage peerAddress_{}; // its address and the connection's port
  std::string outSecret_; // the peer's lane secret (its offer)
  bool outEncrypted_ = false;
  uint32_t outRecordsPerKey_ = 0;
  std::vector<std::string> outTickets_;
  std::vector<OutLane> out_;
  size_t outUp_ = 0;
  size_t stripesWriting_ = 0; // taken off a queue, not yet written
  uint64_t nextToken_ = 1;
  size_t nextFirstLane_ = 0;
  uint64_t heldOut_ = 0; // lanes held against the context's cap, dialled
  std::map<uint64_t, Taken> taken_; // by the record's provisional number
  uint64_t nextTaken_ = 1;
  // Receiver (mutex_).
  bool offerSent_ = false;
  bool declined_ = false; // the peer dials none of our lanes (kDeclineFrame)
  uint64_t heldIn_ = 0; // lanes held against the context's cap, offered
  bool offerCapped_ = false; // no offer for the cap yet: ticks try again
  std::string inSecret_; // the lane secret we offered
  bool inEncrypted_ = false;
  std::map<uint64_t, std::shared_ptr<Landing>> landings_;
  uint64_t unclaimedBytes_ = 0; // page-rounded: what the landings pin
  size_t unclaimedSegments_ = 0;
  bool inLaneEnded_ = false; // a lane the peer closed between chunks
  // A lane of the peer's that broke while no record waited: why, for the
  // next record whose stripes are not all in (lanes_receiver.cpp).
  std::string inLaneBroken_;
  size_t inLanes_ = 0; // attached

  std::vector<int> inFds_;
  // By slot (inFds_'s): the segment of that lane's last chunk, if any, and
  // whether the lane ended (between chunks).
  struct InSlot {
    std::optional<uint64_t> token;
    bool ended = false;
  };
  std::vector<InSlot> inSlots_;
  std::vector<std::thread> inThreads_;
};

} // namespace torch_rpc_ext::channel::lanes
