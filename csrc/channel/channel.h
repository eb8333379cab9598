// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "csrc/common/source_strikes.h"
#include "csrc/frame/frame.h"

namespace torch_rpc_ext::channel {

// The channel seam: how a tensor's bytes travel, apart from the control
// stream that carries frames (docs/architecture.md, "Channels").
//
// A transport connection carries every frame. By default each segment's bytes
// travel in that stream too ("basic"). A channel may carry a segment out of
// band instead, and put 16-byte SegmentRecords in the stream in its place
// (frame.h): shm_slab lends the receiver a shared slab the tensor then views,
// shm_ring copies it through a shared ring; CUDA IPC and pinned staging are
// next. Which channels a connection uses is negotiated per peer as transports
// are: each process publishes its viable channels with their domain
// descriptors at rendezvous, and a connection uses the channels both ends
// offer in the same domain that its transport can host, in the registry's
// order of preference (registry.cpp). The sender offers each segment to the
// channels of the segment's device in that order; one that declines (too
// small, over its bounds, out of memory) passes it to the next, and the
// stream takes whatever none took.
//
// On the wire, the top byte of an announced segment length names the channel
// that carries it (its wireId(); 0: the stream itself), and a channel's
// control frames have kinds of its own; the registry hands both out by the
// channel's position in its list (WireIds). A receiver rejects a frame that
// names a channel its connection did not negotiate.

// Where a segment's memory lives. Values are c10::DeviceType's.
enum class DeviceKind : uint8_t {
  kCpu = 0,
  kCuda = 1,
};

// A control frame a channel sends its peer channel: kind, head, descriptors
// passed with its first byte (kept open by keepAlive until it is written or
// dropped).
struct ControlFrame {
  frame::FrameKind kind;
  std::string head;
  std::vector<int> fds;
  std::shared_ptr<void> keepAlive;
};

// What a channel needs from the connection that hosts it. Implemented by the
// stream core (transport/stream/connection.h).
class Host {
 public:
  virtual ~Host() = default;
  // Any thread, once the connection is ready: send `frame` ahead of message
  // frames not yet started. Dropped if the connection is closed.
  virtual void sendControl(ControlFrame frame) = 0;
  // Any thread: send what the channels keep for a ride (their
  // collectPendingLocked) now, taken under the lock a message frame takes
  // them with, so a frame queued after this returns goes after them (a
  // release taken first and sent after could trail the next frame).
  virtual void sendPendingControl() = 0;
  // Any thread: run `fn` on the connection's loop thread (dropped once the
  // connection is gone).
  virtual void post(std::function<void()> fn) = 0;
  // The same, `delay` from now.
  virtual void postAfter(
      std::chrono::milliseconds delay,
      std::function<void()> fn) {
    post(std::move(fn));
  }
  // Loop thread: call `onReadable` on the loop thread whenever `fd` is
  // readable, until unwatchFromLoop(fd).
  virtual void watchFromLoop(int fd, std::function<void()> onReadable) = 0;
  virtual void unwatchFromLoop(int fd) = 0;
  // Loop thread: a frame a channel held back can go on (a chunk channel that
  // returned 0 from produceChunkLocked() has room again; staged bytes became
  // ready, StagedOut).
  virtual void resumeWritesFromLoop() = 0;
  // Loop thread: the peer broke the protocol; close the connection.
  virtual void rejectFromLoop(const std::string& reason) = 0;
  // Loop thread: close the connection, lost rather than refused (another
  // way of the peer's, e.g. a lane, broke or ended).
  virtual void loseFromLoop(const std::string& reason) {
    rejectFromLoop(reason);
  }
  virtual bool isClosed() const = 0;
  // Loop thread: a record held back (onRecordFromLoop() returned 0) can be
  // placed now; the stream offers it to its channel again.
  virtual void resumeReadsFromLoop() {}
  // Any thread: bytes of this connection arrived by another way (a lane):
  // the peer is alive, whatever its stream says (the heartbeat).
  virtual void noteProgress() {}
  // The connection's heartbeat_timeout (0: none): how long a channel lets
  // bytes it waits for by another way stay away.
  virtual std::chrono::milliseconds heartbeatTimeout() const {
    return std::chrono::milliseconds(0);
  }
  // The IP addresses of the connection's socket, ours and the peer's;
  // false if it has none (a Unix socket).
  virtual bool socketAddresses(sockaddr_storage* local, sockaddr_storage* peer)
      const {
    return false;
  }
  // Any thread: let go of `keepAlive` (a sent frame's tensors) where the
  // connection lets go of its own, never on a thread that must not take
  // the GIL.
  virtual void releaseLater(std::shared_ptr<void> keepAlive) {}
  // Whether the connection is encrypted (TLS): what a channel that moves
  // bytes by another way must match.
  virtual bool encrypted() const {
    return false;
  }
};

class Context;

using frame::DeviceRegion;

// How a channel is named on the wire, handed out by the registry: `channel`
// is the segment-length top byte of its segments (1..255), and its control
// frames use the kFrameKindsPerChannel kinds from `firstKind` on.
struct WireIds {
  uint8_t channel = 0;
  uint8_t firstKind = 0;
  // The kind of the channel's control frame number `offset`.
  frame::FrameKind kind(uint8_t offset) const {
    return static_cast<frame::FrameKind>(firstKind + offset);
  }
  // Which of its control frames `kind` is, or -1 if not one of them.
  int offsetOf(frame::FrameKind kind) const {
    int offset = static_cast<int>(kind) - firstKind;
    return offset >= 0 && offset < frame::kFrameKindsPerChannel ? offset : -1;
  }
};

// The segment being received, as a channel's record fills it.
struct InboundSegment {
  uint64_t size; // the whole segment
  uint64_t filled; // bytes already in place
  void* buffer; // the receiver's buffer (chunks), or nullptr (regions)
  // For a region or staging channel: the memory the receiver's tensor will
  // view, and what keeps it valid.
  void** provided;
  std::shared_ptr<frame::SharedRegion>* region;
  // The CUDA device its tensors go to, or -1, or frame::kDeviceNotServed
  // (InboundBuffers::devices).
  int8_t device = -1;
};

// A segment a staging channel copies out of device memory before the stream
// writes it: `data` is host memory that holds its first `readyBytes()` bytes
// already (the rest is on its way; the channel calls
// Host::resumeWritesFromLoop() as more become ready). Kept alive by the
// frame until it is written or dropped.
class StagedOut {
 public:
  virtual ~StagedOut() = default;
  virtual const char* data() const = 0;
  virtual uint64_t readyBytes() const = 0;
  // A copy out failed: the bytes past what was ready will never be (the
  // connection closes; a reader off the loop must stop waiting).
  virtual bool failed() const {
    return false;
  }
  // A reader off the loop (a lane thread): returns once readyBytes() >= end
  // or failed(), or after `timeout` (then the caller checks whether to go
  // on waiting). By default it polls.
  virtual void waitReady(uint64_t end, std::chrono::microseconds timeout)
      const {
    auto pause = std::chrono::microseconds(2);
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (readyBytes() < end && !failed() &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }
};

// One connection's end of a channel. Created per connection by its Context
// once the peer is known, destroyed with the connection (a region it lent
// out may outlive it: SharedRegion).
//
// Threads, as in the stream core: *FromLoop on the loop thread; *Locked with
// the connection's write lock held (never while copying large buffers in
// another thread's name: takeRegion runs with no lock held).
class Channel {
 public:
  enum class Mode {
    // One record names shared memory holding the whole segment; the
    // receiver's tensor views it (InboundBuffers::provided).
    kRegion,
    // The bytes go in chunks through the channel, one record per chunk, and
    // the receiver copies each into its buffer.
    kChunks,
    // The bytes travel in the stream itself, staged through host memory on
    // both sides: the sender copies them out of the device as the stream
    // needs them (stageOut), the receiver lands them in host memory and
    // copies them onto its device (landFromLoop), and its tensor views that
    // device memory. No records: the segment's bytes follow its frame's head
    // as the stream's own do.
    kStaged,
  };

  // The context (and the counters it holds) lives as long as its channels:
  // a connection may outlive the agent that made it.
  explicit Channel(std::shared_ptr<const Context> context)
      : context_(std::move(context)) {}
  virtual ~Channel() = default;
  const Context& context() const {
    return *context_;
  }

  // ---- Sender -------------------------------------------------------------
  // kRegion, any thread, no lock held: carry `segment` (copying it now if it
  // must) and fill `record`, with any frame the peer needs first (a new
  // region's setup) in `before`; or decline.
  virtual bool takeRegion(
      const frame::OutboundFrame::Segment& segment,
      frame::SegmentRecord* record,
      std::vector<ControlFrame>* before) {
    return false;
  }
  // kRegion, any thread, no lock held: the segments of one frame this
  // channel's device kind may carry (`offered`: indices into `segments`,
  // ascending), all at once, so that a channel may pack small ones into one
  // region and copy them in one go. Appends a TakenRegion for each it
  // carries. A throw leaves appended what stays taken: the caller gives
  // those back (abandonRegion). `keepAlive` owns the segments' memory: a
  // channel that reads it after returning holds on to it. By default,
  // takeRegion() for each.
  struct TakenRegion {
    size_t segment;
    frame::SegmentRecord record;
  };
  virtual void takeRegions(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& offered,
      std::vector<TakenRegion>* taken,
      std::vector<ControlFrame>* before,
      const std::shared_ptr<void>& keepAlive) {
    for (size_t i : offered) {
      frame::SegmentRecord record{};
      if (takeRegion(segments[i], &record, before)) {
        taken->push_back({i, record});
      }
    }
  }
  // kRegion, any thread, no lock held: the record takeRegion() filled for
  // `segment` will not be sent (a later segment of its frame could not
  // travel): give back what it took. The frames it put in `before` are still
  // sent, so the peer knows of any region it made.
  virtual void abandonRegion(
      const frame::OutboundFrame::Segment& segment,
      const frame::SegmentRecord& record) {}
  // kRegion, with the connection's write lock held: the frame whose
  // segments this channel took (takeRegions) joins the write queue now, in
  // the order frames go on the wire; `records` are its records of this
  // channel, which it may still rewrite. (The lanes number their segments
  // here, so that their stripes and their records keep one order.)
  virtual void onRegionsQueuedLocked(
      const std::vector<frame::SegmentRecord*>& records) {}
  // kChunks, any thread, no lock held: whether to carry `segment` in chunks.
  // A channel that copies the bytes out of a device first (cuda_ring) sets
  // `*staged`: the stream then starts the frame only once its readyBytes()
  // are more than zero and produces chunks only as far as they go, and
  // passes it back to produceChunkLocked().
  virtual bool takeChunks(
      const frame::OutboundFrame::Segment& segment,
      std::shared_ptr<StagedOut>* staged) {
    return false;
  }
  // kChunks: a frame with chunks of ours is about to start; a control frame
  // the peer needs first (set up or resize the channel), or nothing.
  virtual std::optional<ControlFrame> prepareChunksLocked() {
    return std::nullopt;
  }
  // kChunks: put up to `size` bytes into the channel and fill `record`.
  // Returns the bytes taken; 0 when full (then Host::resumeWritesFromLoop()
  // follows), with `error` set on failure. `staged`: what takeChunks() set
  // for the segment (then `data` is its data() plus the offset), or null.
  virtual size_t produceChunkLocked(
      const char* data,
      size_t size,
      StagedOut* staged,
      frame::SegmentRecord* record,
      std::string* error) {
    *error = "channel carries no chunks";
    return 0;
  }
  // kStaged, any thread, no lock held: start copying `segment` out of its
  // device, returning the host memory the stream will write it from, or
  // nullptr to decline; throws, naming why, when it cannot carry the
  // segment now (over its memory limit, a failing driver call).
  virtual std::shared_ptr<StagedOut> stageOut(
      const frame::OutboundFrame::Segment& segment) {
    return nullptr;
  }
  // kStaged, any thread, no lock held: the segments of one frame this
  // channel's device kind may carry (`offered`, ascending), all at once, so
  // that it may gather small ones with one launch. Sets staged[i] (`staged`
  // has a slot per segment) for each it carries; throws as stageOut() does,
  // leaving set what it carries (released with `staged`). By default,
  // stageOut() for each.
  virtual void stageOutAll(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& offered,
      std::vector<std::shared_ptr<StagedOut>>& staged) {
    for (size_t i : offered) {
      staged[i] = stageOut(segments[i]);
    }
  }
  // kRegion, any thread, no lock held: carry a device segment whose bytes a
  // staging channel is copying out into host memory (`staged`: its data()
  // fills up to readyBytes(); `segment` is the device segment), writing
  // them as they become ready, and fill `record`; or decline. The receiver
  // gets a region of host memory for a device segment, which the agent
  // copies onto its device (tcp_lanes: CUDA tensors across hosts).
  // `keepAlive` owns the frame; the channel holds `staged` as long as it
  // reads it.
  virtual bool takeStaged(
      const frame::OutboundFrame::Segment& segment,
      const std::shared_ptr<StagedOut>& staged,
      frame::SegmentRecord* record,
      const std::shared_ptr<void>& keepAlive) {
    return false;
  }
  // Frames waiting for a ride with the next message frame (batched
  // notifications), appended to `out`.
  virtual void collectPendingLocked(std::vector<ControlFrame>* out) {}
  // Whether bytes this channel took are still queued on sockets of its own
  // (tcp_lanes' stripes), not yet handed to the kernel: a connection with
  // such is not drained (transport::Connection::hasQueuedWrites()). Any
  // thread, no lock of the connection's held.
  virtual bool hasQueuedSends() const {
    return false;
  }
  // No queued frame uses this channel: release idle resources, returning
  // the frame that tells the peer, if any.
  virtual std::optional<ControlFrame> dropIfIdleLocked() {
    return std::nullopt;
  }

  // ---- Receiver -----------------------------------------------------------
  // Whether records of this channel can be taken now (a ring must have been
  // set up first).
  virtual bool acceptsRecords() const {
    return true;
  }
  // A record for `segment` has arrived: place (part of) it and return how
  // many bytes are now in place (the whole segment for a region), or -1
  // after Host::rejectFromLoop(). 0: the bytes are still on their way; the
  // stream reads nothing more until Host::resumeReadsFromLoop(), then
  // offers the same record again.
  virtual int64_t onRecordFromLoop(
      const frame::SegmentRecord& record,
      InboundSegment& segment) = 0;
  // kStaged: the first byte of `segment` is about to be read: where its
  // bytes go (host memory of at least segment.size bytes), or nullptr after
  // Host::rejectFromLoop().
  virtual char* landFromLoop(InboundSegment& segment) {
    return nullptr;
  }
  // kStaged: the segment's first `filled` bytes are in the landing memory;
  // once they are all there, the channel fills segment.provided and
  // segment.region. False after Host::rejectFromLoop().
  virtual bool landedFromLoop(InboundSegment& segment, uint64_t filled) {
    return false;
  }
  // The message frame whose segments were just placed is complete, before
  // it is delivered: false after Host::rejectFromLoop() (work a channel
  // defers to a frame's last record was never finished: the frame must not
  // be delivered).
  virtual bool onFrameEndFromLoop() {
    return true;
  }
  // Control frames of its own: whether a frame of `kind` with a head of
  // `headLength` bytes is one, and handling it (`fds`: descriptors received
  // and not yet claimed; take the ones it owns from the front). False once
  // the connection is closed.
  virtual bool acceptsControlFrame(frame::FrameKind kind, uint32_t headLength)
      const {
    return false;
  }
  virtual bool onControlFrameFromLoop(
      frame::FrameKind kind,
      const std::string& head,
      std::vector<int>& fds) {
    return true;
  }
  // Descriptors that may wait for one of its frames at most.
  virtual size_t maxPendingFds() const {
    return 0;
  }

  // ---- Both ---------------------------------------------------------------
  // The connection has just become ready (its handshake is done): control
  // frames sent from here on reach the peer.
  virtual void onReadyFromLoop() {}
  // Every heartbeat tick while ready (idle housekeeping), and once at close.
  virtual void onTickFromLoop() {}
  virtual void onClosedFromLoop() {}
  // A graceful shutdown, the group idle: give back at once what the peer
  // holds of ours and need not keep, so that it lets go of it before the
  // connection closes (cuda_ipc: the peer closes its imports of our blocks
  // before we free them, as the driver wants). settled(), any thread:
  // nothing of ours is left for the peer to let go of, or the wait for it
  // is over.
  virtual void settleFromLoop() {}
  virtual bool settled() {
    return true;
  }

 private:
  const std::shared_ptr<const Context> context_;
};

// A way of moving tensor bytes, per process: what the registry lists and
// rendezvous negotiates. Thread-safe; outlives its channels.
class Context : public std::enable_shared_from_this<Context> {
 public:
  explicit Context(WireIds ids) : ids_(ids) {}
  virtual ~Context() = default;
  virtual std::string name() const = 0;
  // Its ids on the wire, as the registry gave them.
  const WireIds& wireIds() const {
    return ids_;
  }
  // The segment-length top byte naming it on the wire (1..255, unique).
  uint8_t wireId() const {
    return ids_.channel;
  }
  virtual DeviceKind device() const = 0;
  virtual Channel::Mode mode() const = 0;
  // Why it cannot work in this process ("" when it can).
  virtual std::string unviableReason() const = 0;
  bool isViable() const {
    return unviableReason().empty();
  }
  // What a process publishes about the channel at rendezvous: the shm
  // channels' one booted kernel, cuda_ipc's too plus the devices it serves.
  virtual std::string domainDescriptor() const = 0;
  // Whether this process can use the channel with a peer that published
  // `peerDescriptor`; symmetric. By default: equal descriptors.
  virtual bool reaches(const std::string& peerDescriptor) const {
    return peerDescriptor == domainDescriptor();
  }
  // It passes descriptors over its connection (SCM_RIGHTS): only a transport
  // whose connections can host it.
  virtual bool needsDescriptorPassing() const = 0;
  // It opens connections of its own over IP beside its connection
  // (tcp_lanes): never hosted by a transport that passes descriptors (a
  // Unix socket on one host, where the shm channels do better).
  virtual bool needsNetworkHost() const {
    return false;
  }
  // Before any channel is opened: take part only on connections that
  // encrypt (the agent's default for tcp_lanes, whose threads spread the
  // cipher's work). Its channels still exist on every connection it is
  // negotiated for, so a peer that uses it everywhere can; they just never
  // start using it themselves on a connection in the clear. A channel
  // without such a mode ignores it.
  virtual void setEncryptedOnly(bool encryptedOnly) {}
  // Sources whose refused connections never hold them off, for a channel
  // that listens and holds sources off (tcp_lanes); set before it listens.
  virtual void exemptFromHoldOff(const AddressRanges& ranges) {}
  // One connection's end, talking through `host` to a peer that published
  // `peerDescriptor` (one this context reaches()).
  virtual std::shared_ptr<Channel> open(
      std::weak_ptr<Host> host,
      const std::string& peerDescriptor) = 0;
  // Counters for RpcAgent::getMetrics(), by name.
  virtual std::map<std::string, uint64_t> counters() const = 0;

 private:
  const WireIds ids_;
};

// A channel a connection uses: our context, and what the peer published.
struct Offer {
  std::shared_ptr<Context> context;
  std::string peerDescriptor;
};

// The channels one connection uses, in order of preference: what a
// transport asks its owner for once the peer is known (TransportOptions).
using ChannelsFor = std::function<
    std::vector<Offer>(int32_t peerId, bool hostPassesDescriptors)>;

} // namespace torch_rpc_ext::channel
