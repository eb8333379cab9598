// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes an shm connection reading a peer's frame ring and its socket
// together (csrc/transport/stream/connection_ring.cpp and the reader it
// drives, docs/wire-format.md "Frame rings"), as an authenticated
// same-host peer reaches it: frames in the ring, the descriptor carriers
// and the message bodies the ring's frames send on the socket
// (kFlagCarrier, kFlagBodyOnSocket), socket bytes read together with the
// ring's offer (kept for later), the ring's shared header written with
// anything, signals and ends in any order. fuzz_stream feeds a connection
// that has no ring; this one reaches it only the way a peer does: through
// a real socket pair, the real handshake and a real sealed ring, with the
// connection on its own loop threads, as in a worker.
//
// Input: one setup byte t, then operations until the input ends. The
// harness authenticates, then sends its kFrameRing offer with the ring's
// memfd and signal end, followed in the same send by the first t bytes
// after the setup byte (socket bytes the connection reads with the offer).
// Each operation is one byte whose low three bits name it:
//   0 ring:    u32 n, u16 p, p bytes: n bytes (p repeated; zeros if p is
//              0; n at most 4 MiB) written into the ring and published,
//              the receiver woken if it parked; waits for room as a sender
//              does (100 ms at most, then the input ends).
//   1 socket:  the same operands: n bytes on the socket.
//   2 carrier: u8 byte: that byte on the socket with a descriptor (an
//              eventfd), counted in the ring's header first as a sender
//              does; op bit 3: not counted; bit 4: no descriptor.
//   3 field:   u8 f, u64 v: the shared header's field f % 7 (head, tail,
//              receiverParked, senderParked, carriers, magic, capacity)
//              set to v (published bytes stay ours: a later ring write
//              goes on from where the harness had published).
//   4 signal:  a byte on the ring's signal socket; op bit 3: with a
//              descriptor (a protocol break).
//   5 settle:  wait until the connection consumed what the ring holds, or
//              closed (20 ms at most); bit 3: until it closed (20 ms at
//              most); 200 ms in all per input.
//   6 end:     close the ring's signal end (bit 3: shut the socket's
//              writing side instead).
//   7 setup:   a frame with descriptors, sent as a sender sends one:
//              counted, its carrier on the socket, the frame flagged in
//              the ring. Bits 3-7 % 3: a second frame ring (refused); a
//              real sealed slab of the shm_slab channel, id 1; a real ring
//              of the shm_ring channel (records after it are checked
//              against real mappings).
// Then the harness closes its ends of the socket and the ring's signal.
//
// A finding: a sanitizer report, a crash; a frame delivered with a segment
// count other than announced; the connection still open 10 s after its
// peer ended (a hang).

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "csrc/channel/registry.h"
#include "csrc/channel/shm/ring.h"
#include "csrc/channel/shm/ring_channel.h"
#include "csrc/channel/shm/slab.h"
#include "csrc/channel/shm/slab_channel.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/shm/connection.h"
#include "csrc/transport/stream/frame_ring.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/stream_peer.h"

namespace torch_rpc_ext::fuzz {
namespace {

using frame::FrameHeader;
using frame::FrameKind;
using frame::InboundBuffers;
using transport::stream::FrameRing;
using transport::stream::FrameRingHeader;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kRingBytes = 64 << 10;
constexpr uint32_t kMaxWrite = 4 << 20;
constexpr int32_t kServerId = 1, kClientId = 0;

// Receives what the connection delivers, on its loop threads; one input's
// connection at a time.
class Observer final : public transport::ConnectionObserver {
 public:
  void onReady(const std::shared_ptr<transport::Connection>&) override {}

  InboundBuffers onFrameHead(
      transport::Connection&,
      const std::string& /*head*/,
      const std::vector<uint64_t>& sizes,
      const std::vector<bool>& provided) override {
    std::lock_guard<std::mutex> lock(mutex_);
    announced_ = sizes;
    return ownedBuffers(sizes, provided);
  }

  void onFrame(
      const std::shared_ptr<transport::Connection>&,
      std::string /*head*/,
      InboundBuffers buffers) override {
    std::lock_guard<std::mutex> lock(mutex_);
    checkDelivered(buffers, announced_, sink_);
    ++frames_;
  }

  void onClosed(transport::Connection&, const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mutex_);
    reason_ = reason;
    closed_ = true;
    cv_.notify_all();
  }

  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = false;
    announced_.clear();
    frames_ = 0;
    reason_.clear();
  }
  // What the input came to (FUZZ_VERBOSE=1 prints it: checking a seed).
  std::string outcome() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::to_string(frames_) + " messages delivered; closed: " + reason_;
  }
  bool closed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_;
  }
  bool waitClosed(std::chrono::milliseconds within) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, within, [this] { return closed_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool closed_ = false;
  std::vector<uint64_t> announced_;
  size_t frames_ = 0;
  std::string reason_;
  volatile char sink_ = 0;
};

struct Harness : PeerHarness {
  Harness() {
    options.selfId = kServerId;
    options.limits.maxFrameBytes = 16 << 20;
    // The connection's own frames go on the socket (the harness reads and
    // drops them); the peer's ring is what is fuzzed.
    options.frameRingBytes = 0;
    // Both shm channels, as between two workers of one host: records of
    // slabs and chunks the harness never set up are refused.
    for (const char* name : {"shm_slab", "shm_ring"}) {
      auto c = channel::createChannel(name);
      channels.push_back(channel::Offer{c, c->domainDescriptor()});
    }
  }
  Observer observer;
};

Harness& harness() {
  static Harness* h = new Harness(); // never destroyed: its loop keeps running
  return *h;
}

// Waits for `events` on `fd` until `until`; false if they did not come.
bool awaitFd(int fd, short events, Clock::time_point until) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      until - Clock::now());
  pollfd p{fd, events, 0};
  return left.count() > 0 && ::poll(&p, 1, int(left.count())) > 0;
}

// Sends all of `bytes` (with `fds` on the first byte), waiting up to
// `within` for room; false if the socket would not take them.
bool sendAll(
    int fd,
    const std::string& bytes,
    std::vector<int> fds = {},
    std::chrono::milliseconds within = std::chrono::milliseconds(100)) {
  const auto until = Clock::now() + within;
  size_t at = 0;
  while (at < bytes.size() || !fds.empty()) {
    iovec iov{const_cast<char*>(bytes.data() + at), bytes.size() - at};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control;
    if (!fds.empty()) {
      control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      at += static_cast<size_t>(n);
      fds.clear();
      continue;
    }
    if ((n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ||
        !awaitFd(fd, POLLOUT, until)) {
      return false; // the connection closed its end, or takes no more
    }
  }
  return true;
}

// Reads exactly `n` bytes within 5 s (the handshake's answers).
bool readExactly(int fd, char* out, size_t n) {
  const auto until = Clock::now() + std::chrono::seconds(5);
  size_t at = 0;
  while (at < n) {
    ssize_t got = ::recv(fd, out + at, n - at, MSG_DONTWAIT);
    if (got > 0) {
      at += static_cast<size_t>(got);
      continue;
    }
    if (got == 0 || (errno != EAGAIN && errno != EINTR) ||
        !awaitFd(fd, POLLIN, until)) {
      return false;
    }
  }
  return true;
}

// The client's side of the handshake, on the socket's blocking reads.
void authenticate(int fd) {
  transport::Handshake client(
      /*client=*/true, harness().options.secret, kClientId, kServerId);
  std::string hello = client.hello();
  FUZZ_CHECK(
      sendAll(
          fd,
          frameHeader(FrameKind::kHello, hello.size()) + hello,
          {},
          std::chrono::seconds(5)),
      "sending the hello");
  while (true) {
    FrameHeader h{};
    FUZZ_CHECK(
        readExactly(fd, reinterpret_cast<char*>(&h), sizeof(h)),
        "the connection's handshake frame");
    std::string head(h.headLength, '\0');
    FUZZ_CHECK(
        h.headLength == client.expectedHeadBytes() &&
            readExactly(fd, head.data(), head.size()),
        "the connection's handshake head");
    transport::Handshake::Step step = client.onFrame(head);
    FUZZ_CHECK(step.error.empty(), "handshake: " + step.error);
    if (step.hasReply) {
      FUZZ_CHECK(
          sendAll(
              fd,
              frameHeader(step.replyKind, step.replyHead.size()) +
                  step.replyHead,
              {},
              std::chrono::seconds(5)),
          "sending the proof");
    }
    if (step.done) {
      return;
    }
  }
}

// The peer's side of one input: the socket, the ring (the harness's own
// mapping of its memory) and what it has published.
struct Peer {
  int sock = -1;
  std::unique_ptr<FrameRing> ring;
  FrameRingHeader* shared = nullptr;
  char* data = nullptr;
  uint64_t published = 0;
  bool signalOpen = true;
  // What settling may still wait in this input (a connection that holds,
  // waiting for a body, would have each settle wait its whole 20 ms).
  Clock::duration settleLeft = std::chrono::milliseconds(200);
  // What operation 7 set up (the sender's side, kept for the input).
  std::unique_ptr<FrameRing> secondRing;
  std::shared_ptr<channel::shm::Slab> slab;
  channel::shm::Ring shmRing;

  void drainSocket() const {
    char sink[4096];
    while (::recv(sock, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
  }
  void signal(bool withDescriptor) const {
    int fd = withDescriptor ? ::eventfd(0, EFD_CLOEXEC) : -1;
    sendAll(
        ring->signalFd(),
        std::string(1, '\1'),
        withDescriptor ? std::vector<int>{fd} : std::vector<int>{},
        std::chrono::milliseconds(0));
    if (fd >= 0) {
      ::close(fd);
    }
  }
  bool setUp(unsigned what);
  // Writes `bytes` as a sender does: into the room the receiver's tail
  // leaves, published, a parked receiver woken. False when no room came.
  bool writeRing(const std::string& bytes) {
    const auto until = Clock::now() + std::chrono::milliseconds(100);
    size_t at = 0;
    while (at < bytes.size()) {
      uint64_t tail = shared->tail.load(std::memory_order_acquire);
      uint64_t used = published - std::min(tail, published);
      size_t room = used >= kRingBytes ? 0 : size_t(kRingBytes - used);
      if (room == 0) {
        if (Clock::now() >= until || harness().observer.closed()) {
          return false;
        }
        drainSocket(); // the connection's answers, so its writes go on
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      size_t n = std::min(room, bytes.size() - at);
      for (size_t done = 0; done < n;) {
        size_t off = size_t((published + done) % kRingBytes);
        size_t take = std::min(n - done, size_t(kRingBytes - off));
        std::memcpy(data + off, bytes.data() + at + done, take);
        done += take;
      }
      at += n;
      published += n;
      shared->head.store(published, std::memory_order_seq_cst);
      if (shared->receiverParked.exchange(0, std::memory_order_seq_cst)) {
        signal(false);
      }
    }
    return true;
  }
};

// Operation 7: a frame that passes descriptors, sent as a sender sends
// one: counted, its carrier byte with the descriptors on the socket, the
// frame, flagged, in the ring. `what`: 0 a second frame ring (refused), 1
// a real sealed slab, id 1 (the shm_slab channel's setup), 2 a real ring of
// the shm_ring channel: records in the frames after it are checked against
// real mappings, in the stream or in a body on the socket.
bool Peer::setUp(unsigned what) {
  FrameKind kind = FrameKind::kFrameRing;
  std::string head;
  std::vector<int> fds;
  auto append = [&head](const auto& v) {
    head.append(reinterpret_cast<const char*>(&v), sizeof(v));
  };
  if (what == 0) {
    secondRing = FrameRing::create(kRingBytes);
    append(secondRing->capacity());
    fds = {secondRing->memFd(), secondRing->peerSignalFd()};
  } else if (what == 1) {
    if (!slab) {
      slab = channel::shm::Slab::create(channel::shm::kSlabMinSegment);
    }
    kind =
        harness().channel("shm_slab").wireIds().kind(channel::shm::kSlabSetup);
    append(uint32_t(1));
    append(slab->capacity());
    fds = {slab->fd()};
  } else {
    if (!shmRing.valid()) {
      shmRing = channel::shm::Ring::create(channel::shm::kMinRingBytes);
    }
    kind =
        harness().channel("shm_ring").wireIds().kind(channel::shm::kRingSetup);
    append(shmRing.capacity());
    fds = {shmRing.fd(), shmRing.peerWakeFd()};
  }
  std::string frame = frameHeader(kind, head.size()) + head;
  reinterpret_cast<FrameHeader*>(frame.data())->flags = frame::kFlagCarrier;
  shared->carriers.fetch_add(1, std::memory_order_seq_cst);
  return sendAll(sock, "F", fds) && writeRing(frame);
}

std::string expand(FuzzInput& in) {
  uint32_t n = std::min(in.take<uint32_t>(), kMaxWrite);
  std::string pattern = in.takeBytes(in.take<uint16_t>());
  std::string out(n, '\0');
  size_t at = 0;
  fillRepeating(out.data(), n, pattern, at);
  return out;
}

// One operation of the input; false ends the input.
bool step(Peer& peer, FuzzInput& in) {
  uint8_t op = in.take<uint8_t>();
  peer.drainSocket();
  switch (op & 7) {
    case 0:
      return peer.writeRing(expand(in));
    case 1:
      return sendAll(peer.sock, expand(in));
    case 2: {
      char byte = static_cast<char>(in.take<uint8_t>());
      if (!(op & 8)) {
        peer.shared->carriers.fetch_add(1, std::memory_order_seq_cst);
      }
      int fd = (op & 16) ? -1 : ::eventfd(0, EFD_CLOEXEC);
      bool sent = sendAll(
          peer.sock,
          std::string(1, byte),
          fd >= 0 ? std::vector<int>{fd} : std::vector<int>{});
      if (fd >= 0) {
        ::close(fd);
      }
      return sent;
    }
    case 3: {
      uint8_t f = in.take<uint8_t>() % 7;
      uint64_t v = in.take<uint64_t>();
      FrameRingHeader* s = peer.shared;
      switch (f) {
        case 0:
          s->head.store(v);
          break;
        case 1:
          s->tail.store(v);
          break;
        case 2:
          s->receiverParked.store(uint32_t(v));
          break;
        case 3:
          s->senderParked.store(uint32_t(v));
          break;
        case 4:
          s->carriers.store(v);
          break;
        case 5:
          s->magic = v;
          break;
        default:
          s->capacity = v;
          break;
      }
      return true;
    }
    case 4:
      if (peer.signalOpen) {
        peer.signal(op & 8);
      }
      return true;
    case 5: {
      const auto start = Clock::now();
      const auto until = start +
          std::min<Clock::duration>(
                             std::chrono::milliseconds(20), peer.settleLeft);
      while (Clock::now() < until && !harness().observer.closed() &&
             ((op & 8) || peer.shared->tail.load() != peer.published)) {
        peer.drainSocket();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      peer.settleLeft -= std::min(peer.settleLeft, Clock::now() - start);
      return true;
    }
    case 6:
      if (op & 8) {
        ::shutdown(peer.sock, SHUT_WR);
      } else if (peer.signalOpen) {
        // (Shut, not closed: the ring closes its descriptor.)
        ::shutdown(peer.ring->signalFd(), SHUT_RDWR);
        peer.signalOpen = false;
      }
      return true;
    default:
      return peer.setUp((op >> 3) % 3);
  }
}

// Once per process, before the first input, a valid peer no input makes:
// a ring setup (two descriptors) that the connection's first read ends
// inside, its rest sent with the frame ring's offer (two more). A Unix
// socket's read ends after the first bytes that bring descriptors, so the
// second read brings the offer's while the setup's still wait for their
// frame: four at once. Until session 94 the bound was the channels' sum
// (three here), and such a peer was refused ("peer sent unexpected file
// descriptors"); a sender's own writes split a frame so only where the
// receiver's staging buffer ends inside it.
// An accepted connection on its loop, its peer authenticated on the
// returned socket; the connection is kept in `conn`.
int acceptedAndAuthenticated(
    const char* what,
    std::shared_ptr<transport::shm::ShmConnection>& conn) {
  auto& h = harness();
  int pair[2];
  FUZZ_CHECK(
      ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0,
      "socketpair");
  h.observer.reset();
  conn = std::make_shared<transport::shm::ShmConnection>(
      h.loop,
      h.options,
      pair[0],
      /*outbound=*/false,
      /*expectedPeerId=*/-1,
      what,
      &h.observer);
  h.loop.post([conn] { conn->startAcceptedFromLoop(); });
  authenticate(pair[1]);
  return pair[1];
}

void checkSetupSplitAheadOfTheOffer() {
  auto& h = harness();
  std::shared_ptr<transport::shm::ShmConnection> conn;
  const int sock = acceptedAndAuthenticated("split setup", conn);
  auto ring = channel::shm::Ring::create(channel::shm::kMinRingBytes);
  uint64_t cap = ring.capacity();
  std::string setup = frameHeader(
      h.channel("shm_ring").wireIds().kind(channel::shm::kRingSetup),
      sizeof(cap));
  setup.append(reinterpret_cast<const char*>(&cap), sizeof(cap));
  auto frameRing = FrameRing::create(kRingBytes);
  cap = frameRing->capacity();
  std::string offer = frameHeader(FrameKind::kFrameRing, sizeof(cap));
  offer.append(reinterpret_cast<const char*>(&cap), sizeof(cap));
  const size_t cut = sizeof(FrameHeader) / 2;
  FUZZ_CHECK(
      sendAll(sock, setup.substr(0, cut), {ring.fd(), ring.peerWakeFd()}) &&
          sendAll(
              sock,
              setup.substr(cut) + offer,
              {frameRing->memFd(), frameRing->peerSignalFd()}),
      "sending the split setup and the offer");
  // The peer ends: the connection reads what it sent, then closes (on the
  // ends, or on the descriptors).
  frameRing->closeHandedOver();
  ::shutdown(frameRing->signalFd(), SHUT_RDWR);
  ::close(sock);
  FUZZ_CHECK(
      h.observer.waitClosed(std::chrono::seconds(10)),
      "the split-setup connection stayed open 10 s after its peer ended");
  const std::string outcome = h.observer.outcome();
  FUZZ_CHECK(
      outcome.find("descriptors") == std::string::npos,
      "a ring setup split ahead of the frame ring's offer was refused: " +
          outcome);
  static const bool verbose = std::getenv("FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "split setup: %s\n", outcome.c_str());
  }
}

} // namespace
} // namespace torch_rpc_ext::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace torch_rpc_ext;
  using namespace torch_rpc_ext::fuzz;
  static const bool checked = (checkSetupSplitAheadOfTheOffer(), true);
  (void)checked;
  auto& h = harness();
  FuzzInput in(data, size);
  uint8_t trailing = in.take<uint8_t>();

  std::shared_ptr<transport::shm::ShmConnection> conn;
  Peer peer;
  peer.sock = acceptedAndAuthenticated("fuzz peer", conn);
  peer.ring = FrameRing::create(kRingBytes);
  void* mapped = ::mmap(
      nullptr,
      transport::stream::kFrameRingHeaderBytes + kRingBytes,
      PROT_READ | PROT_WRITE,
      MAP_SHARED,
      peer.ring->memFd(),
      0);
  FUZZ_CHECK(mapped != MAP_FAILED, "mapping the harness's ring");
  peer.shared = static_cast<FrameRingHeader*>(mapped);
  peer.data =
      static_cast<char*>(mapped) + transport::stream::kFrameRingHeaderBytes;

  // The offer, with the first `trailing` bytes of the input behind it.
  uint64_t cap = kRingBytes;
  std::string offer = frameHeader(FrameKind::kFrameRing, sizeof(cap));
  offer.append(reinterpret_cast<const char*>(&cap), sizeof(cap));
  offer += in.takeBytes(trailing);
  bool going = sendAll(
      peer.sock, offer, {peer.ring->memFd(), peer.ring->peerSignalFd()});
  peer.ring->closeHandedOver();
  while (going && !in.empty() && !h.observer.closed()) {
    going = step(peer, in);
  }

  // The peer ends: the connection reads what is left and closes.
  ::shutdown(peer.ring->signalFd(), SHUT_RDWR);
  ::close(peer.sock);
  bool closed = h.observer.waitClosed(std::chrono::seconds(10));
  FUZZ_CHECK(closed, "the connection stayed open 10 s after its peer ended");
  static const bool verbose = std::getenv("FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "fuzz_frame_ring: %s\n", h.observer.outcome().c_str());
  }
  ::munmap(mapped, transport::stream::kFrameRingHeaderBytes + kRingBytes);
  return 0;
}
