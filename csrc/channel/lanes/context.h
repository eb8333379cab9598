// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "csrc/channel/channel.h"
#include "csrc/channel/lanes/lane.h"
#include "csrc/common/buffer_pool.h"
#include "csrc/common/source_strikes.h"

namespace torch_rpc_ext::channel::lanes {

class LanesChannel;

// How many lanes a connection stripes over, and from which segment size.
// TORCH_RPC_EXT_LANES (1..16, default 4) and TORCH_RPC_EXT_LANES_MIN_BYTES
// (default 1 MiB).
struct LanesSettings {
  uint16_t lanes = 4;
  uint64_t minBytes = uint64_t(1) << 20;
  // The lanes a process (its agent's context) holds each way at most
  // (TORCH_RPC_EXT_LANES_MAX, `lanes` to 4096, default 128): those it has
  // offered to its peers, and those it has dialled to theirs, on
  // connections still open. A connection gets what is left, up to its
  // lanes, and none past it: its stream. Each lane is a thread and a socket.
  uint64_t maxLanes = 128;
  // Records under one lane key on an encrypted connection
  // (TORCH_RPC_EXT_LANES_RECORDS_PER_KEY, 1 to 65536, default 65536: 16 GiB
  // of 256 KiB records), as a receiver offers it.
  uint32_t recordsPerKey = kMaxRecordsPerKey;
  // Whether encrypted records go through our VAES AES-GCM (Aead's default
  // engine when the context was made: TORCH_RPC_EXT_AES_GCM and the CPU),
  // the counter "aes_gcm_vaes".
  bool aesGcmVaes = false;
  // Tests only (TORCH_RPC_EXT_TEST_LANES_FORGE): before the sender's first
  // stripe in the clear, chunks of a segment no record claims, as a peer
  // that misbehaves would send them: "tiny" (a one-byte segment) or
  // "scatter" (one-byte chunks with gaps), for the receiver's checks to
  // refuse (tests/rpc/test_lanes.py).
  std::string testForge;
  // Tests only (TORCH_RPC_EXT_TEST_LANES_STUCK_COPY=1): the sender's first
  // stripe sends keepalives, never its bytes, as if its device copy never
  // ended (tests/rpc/test_lanes_wire.py).
  bool testStuckCopy = false;
  // Tests only (TORCH_RPC_EXT_TEST_LANES_UNREACHABLE=1): offers name a port
  // nothing listens on, so that the peer's dials fail as behind a firewall.
  bool testUnreachable = false;
};

struct LanesCounters {
  std::atomic<uint64_t> segments{0}; // striped segments sent
  std::atomic<uint64_t> bytes{0}; // their bytes
  // Of them, CUDA segments cuda_staged copied out (takeStaged).
  std::atomic<uint64_t> stagedSegments{0};
  std::atomic<uint64_t> lanesOpened{0}; // lanes dialled and accepted
  std::atomic<uint64_t> lanesFailed{0}; // dials that failed (then: the stream)
  std::atomic<uint64_t> heldRecords{0}; // records that waited for their bytes
  // Keepalive chunks sent while a stripe waited for its device copy, and
  // connections closed for a held record whose lanes went quiet.
  std::atomic<uint64_t> keepAlives{0};
  std::atomic<uint64_t> stalls{0};
  // Lanes of peers' that broke (a reset, an error, a close in the middle of
  // a segment): each loses its connection, once the frames ahead of the
  // segment it carried are read.
  std::atomic<uint64_t> lanesBroken{0};
  // Connections that found maxLanes held, each way (an offer not made, or
  // lanes not dialled: the stream, until lanes go back).
  std::atomic<uint64_t> lanesCapped{0};
  // Lanes held now: offered to peers (in), dialled to theirs (out).
  std::atomic<uint64_t> lanesIn{0};
  std::atomic<uint64_t> lanesOut{0};
  // Lane keys replaced (both ways, recordsPerKey), hellos refused (no
  // ticket of ours, a wrong MAC, a bad version, or from a source that
  // failed too often lately) and sources held off for that.
  std::atomic<uint64_t> rekeys{0};
  std::atomic<uint64_t> hellosRefused{0};
  std::atomic<uint64_t> sourcesHeldOff{0};
  // Connections closed before their hello came whole: to make room for a
  // newer one (the listener's pending hellos full), or at their deadline.
  std::atomic<uint64_t> hellosEvicted{0};
  std::atomic<uint64_t> hellosTimedOut{0};
};

// tcp_lanes: large CPU segments striped over several TCP connections beside
// the one that hosts the channel, each lane with a thread of its own at
// both ends, as TensorPipe's multiplexed TCP channel (mpt) does: one stream
// stops at what one core can copy (and encrypt), lanes use more.
//
// Per process, the context keeps one listening socket per local address
// that hosts lanes (bound on first use, to the address its connections
// use, on a port the kernel picks) and the single-use tickets that admit
// dialled lanes; its accept thread challenges each lane, reads its Hello,
// checks its MAC and hands the socket to the channel whose ticket it names
// (lane.h). A source address whose hellos fail too often (SourceStrikes)
// within a window is held off (its connections closed at once) for a
// while, so that guessing costs a prober its address. Thread-safe.
class LanesContext final : public Context {
 public:
  explicit LanesContext(WireIds ids);
  ~LanesContext() override;

  std::string name() const override {
    return "tcp_lanes";
  }
  DeviceKind device() const override {
    return DeviceKind::kCpu;
  }
  Channel::Mode mode() const override {
    return Channel::Mode::kRegion;
  }
  std::string unviableReason() const override {
    return unviable_;
  }
  std::string domainDescriptor() const override {
    return "tcp_lanes/2";
  }
  bool needsDescriptorPassing() const override {
    return false;
  }
  bool needsNetworkHost() const override {
    return true;
  }
  void exemptFromHoldOff(const AddressRanges& ranges) override {
    strikes_.exempt(ranges);
  }
  // Offers lanes only on encrypted connections (it still dials a peer's
  // offer on any).
  void setEncryptedOnly(bool encryptedOnly) override {
    encryptedOnly_ = encryptedOnly;
  }
  bool encryptedOnly() const {
    return encryptedOnly_;
  }
  std::shared_ptr<Channel> open(
      std::weak_ptr<Host> host,
      const std::string& peerDescriptor) override;
  std::map<std::string, uint64_t> counters() const override;

  const LanesSettings& settings() const {
    return settings_;
  }
  LanesCounters& stats() const {
    return counters_;
  }
  BufferPool& pool() const {
    return *pool_;
  }
  const std::shared_ptr<BufferPool>& sharedPool() const {
    return pool_;
  }

  // The port lanes to `local` (a connection's own address) dial; listens
  // there on first use. Throws std::runtime_error naming the address.
  uint16_t listenFor(const sockaddr_storage& local);
  // A new ticket admitting one lane, `lane`, of `channel`, whose hello
  // proves knowledge of `helloKey` (lane.h).
  std::string issueTicket(
      std::weak_ptr<LanesChannel> channel,
      uint16_t lane,
      const std::string& helloKey);
  // Forget the tickets `channel` still has out (it is closing).
  void revokeTickets(const LanesChannel* channel);
  // Hold up to `most` more lanes one way (`inbound`: offered; else
  // dialled), as many as settings().maxLanes leaves: how many (0: none).
  uint64_t holdLanes(bool inbound, uint64_t most) const;
  void releaseLanes(bool inbound, uint64_t count) const;
  // A connection to `peer` found no lane left one way: counted, and said
  // the first time each way.
  void noteCapped(bool inbound, const std::string& peer) const;

 private:
  std::atomic<bool> encryptedOnly_{false};
  // What a listener's accept thread shares with us: it may outlive us by a
  // moment (when the last reference to us is dropped on it).
  struct AcceptState {
    ~AcceptState();
    std::atomic<bool> stop{false};
    int fd = -1; // the listening socket, closed with the last of us
  };
  struct Listener {
    std::shared_ptr<AcceptState> state;
    uint16_t port = 0;
    std::thread thread;
  };
  struct Ticket {
    std::weak_ptr<LanesChannel> channel;
    const LanesChannel* owner;
    uint16_t lane;
    std::string helloKey;
    std::chrono::steady_clock::time_point revokedAt{}; // in revoked_
  };
  static void acceptLoop(
      std::weak_ptr<LanesContext> weak,
      std::shared_ptr<AcceptState> state);
  // A complete Hello on `fd`, answering `challenge`, from `source` (an
  // address without its port): hand it to the channel its ticket names, or
  // close it.
  void admit(
      int fd,
      const Hello& hello,
      const uint8_t* challenge,
      const std::string& source);
  // Whether `source` is held off now (accept thread).
  bool heldOff(const std::string& source);
  // `source` sent a hello we refused (accept thread).
  void strike(const std::string& source);

  LanesSettings settings_;
  std::string unviable_;
  mutable LanesCounters counters_;
  mutable std::atomic<bool> cappedSaid_[2] = {false, false}; // out, in
  std::shared_ptr<BufferPool> pool_;
  std::mutex mutex_;
  std::map<std::string, Listener> listeners_; // by address (mutex_)
  std::map<std::string, Ticket> tickets_; // by ticket bytes (mutex_)
  std::map<std::string, Ticket> revoked_; // lately revoked (mutex_)
  // Sources whose hellos failed lately (SourceStrikes' limits: 8 within
  // 10 s hold a source off for 30 s).
  SourceStrikes strikes_;
};

} // namespace torch_rpc_ext::channel::lanes
