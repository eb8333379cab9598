// SPDX-License-Identifier: BSD-3-Clause
// LanesChannel's life cycle and control frames; the sender's side is in
// lanes_sender.cpp, the receiver's in lanes_receiver.cpp.
#include "csrc/channel/lanes/lanes_channel.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "csrc/channel/lanes/lane.h"
#include "csrc/common/logging.h"
#include "csrc/common/resident_pages.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

// The offer's head: port (2), lanes (1), encrypted (1), records per key
// (4), the lane secret (32), then a ticket per lane.
constexpr size_t kOfferFixedBytes = 8 + kLaneSecretBytes;

} // namespace

LanesChannel::LanesChannel(
    std::shared_ptr<const LanesContext> context,
    std::weak_ptr<Host> host)
    : Channel(context),
      host_(std::move(host)),
      lanes_(context->settings().lanes),
      minBytes_(context->settings().minBytes) {}

LanesChannel::~LanesChannel() {
  stopAll();
}

const LanesContext& LanesChannel::lanesContext() const {
  return static_cast<const LanesContext&>(context());
}

void LanesChannel::onReadyFromLoop() {
  sendOfferFromLoop();
}

void LanesChannel::sendOfferFromLoop() {
  auto host = host_.lock();
  sockaddr_storage local{}, peer{};
  if (!host || host->isClosed() || !host->socketAddresses(&local, &peer)) {
    return; // not a TCP connection: lanes have nothing to ride beside
  }
  if (lanesContext().encryptedOnly() && !host->encrypted()) {
    return; // the default: lanes where the cipher's work is to spread
  }
  uint16_t port;
  try {
    port = const_cast<LanesContext&>(lanesContext()).listenFor(local);
  } catch (const std::exception& e) {
    logWarning(
        std::string("torch_rpc_ext: ") + e.what() +
        "; large tensors from this peer travel in the connection's stream");
    return;
  }
  if (lanesContext().settings().testUnreachable) {
    // Tests only: a port nothing listens on (bound, then closed).
    std::string ignored;
    if (int fd = bindAnyPort(local, &port, &ignored); fd >= 0) {
      ::close(fd);
    }
  }
  std::string head(kOfferFixedBytes, '\0');
  std::memcpy(head.data(), &port, 2);
  uint64_t offered;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || offerSent_) {
      return;
    }
    offered = lanesContext().holdLanes(/*inbound=*/true, lanes_);
    if (offered == 0) {
      // None left under the process's cap: this peer sends in the stream,
      // until a tick finds lanes gone back.
      if (!offerCapped_) {
        offerCapped_ = true;
        lanesContext().noteCapped(/*inbound=*/true, describeAddress(peer));
      }
      return;
    }
    offerSent_ = true;
    heldIn_ = offered;
    head[2] = static_cast<char>(offered);
    inEncrypted_ = host->encrypted();
    head[3] = inEncrypted_ ? 1 : 0;
    uint32_t perKey = lanesContext().settings().recordsPerKey;
    std::memcpy(head.data() + 4, &perKey, 4);
    inSecret_ = randomBytes(kLaneSecretBytes);
    std::memcpy(head.data() + 8, inSecret_.data(), kLaneSecretBytes);
  }
  auto& context = const_cast<LanesContext&>(lanesContext());
  const std::string key = helloKey(inSecret_);
  for (uint16_t i = 0; i < offered; ++i) {
    head += context.issueTicket(weak_from_this(), i, key);
  }
  host->sendControl(
      ControlFrame{
          context.wireIds().kind(kOfferFrame), std::move(head), {}, {}});
}

bool LanesChannel::acceptsControlFrame(
    frame::FrameKind kind,
    uint32_t headLength) const {
  int offset = context().wireIds().offsetOf(kind);
  if (offset == kDeclineFrame) {
    return headLength == 0;
  }
  if (offset == kOfferFrame) {
    return headLength > kOfferFixedBytes &&
        headLength <= kOfferFixedBytes + 16 * kTicketBytes &&
        (headLength - kOfferFixedBytes) % kTicketBytes == 0;
  }
  return false;
}

bool LanesChannel::onControlFrameFromLoop(
    frame::FrameKind kind,
    const std::string& head,
    std::vector<int>& /*fds*/) {
  auto host = host_.lock();
  if (!host) {
    return false;
  }
  if (context().wireIds().offsetOf(kind) == kDeclineFrame) {
    onDeclinedFromLoop();
    return true;
  }
  std::string why;
  // The peer's offer of its lanes.
  sockaddr_storage local{}, peer{};
  uint16_t port;
  std::memcpy(&port, head.data(), 2);
  size_t count = (head.size() - kOfferFixedBytes) / kTicketBytes;
  bool encrypted = head[3] != 0;
  uint32_t perKey;
  std::memcpy(&perKey, head.data() + 4, 4);
  if (!host->socketAddresses(&local, &peer)) {
    why = "lanes offered on a connection that has no IP address";
  } else if (
      port == 0 || uint8_t(head[2]) != count || uint8_t(head[3]) > 1 ||
      perKey == 0 || perKey > kMaxRecordsPerKey) {
    why = "a malformed lanes offer";
  } else if (encrypted != host->encrypted()) {
    why = encrypted ? "lanes offered encrypted on a connection in the clear"
                    : "lanes offered in the clear on an encrypted connection";
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (why.empty() && offered_) {
      why = "a second lanes offer";
    }
    if (why.empty()) {
      offered_ = true;
      peerAddress_ = peer;
      peerLanes_ = peer;
      setPort(&peerLanes_, port);
      outEncrypted_ = encrypted;
      outRecordsPerKey_ = perKey;
      outSecret_ = head.substr(8, kLaneSecretBytes);
      outTickets_.clear();
      for (size_t i = 0; i < count; ++i) {
        outTickets_.push_back(
            head.substr(kOfferFixedBytes + i * kTicketBytes, kTicketBytes));
      }
    }
  }
  // Never with mutex_ held: closing the connection stops us (stopAll()).
  if (!why.empty()) {
    host->rejectFromLoop("rejected frame: " + why);
    return false;
  }
  return true;
}

void LanesChannel::onDeclinedFromLoop() {
  uint64_t unspent = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !offerSent_ || declined_) {
      return; // (a decline of no offer, or a second: nothing to give back)
    }
    declined_ = true;
    // Lanes it opened before it gave up keep theirs (their threads run
    // until the connection closes); none opens after this.
    unspent = heldIn_ > inLanes_ ? heldIn_ - inLanes_ : 0;
    heldIn_ -= unspent;
  }
  const_cast<LanesContext&>(lanesContext()).revokeTickets(this);
  if (unspent > 0) {
    lanesContext().releaseLanes(/*inbound=*/true, unspent);
  }
}

void LanesChannel::onTickFromLoop() {
  lanesContext().pool().trim();
  // The stream is not read while a record waits for its stripes, so the
  // peer's pings wait unread there: the heartbeat cannot tell a lane that
  // stalled from a busy peer, and would give it six timeouts, then name
  // the peer, alive all along. Said here after two, naming the lanes.
  if (std::string why = stalledLanding(); !why.empty()) {
    lanesContext().stats().stalls.fetch_add(1, std::memory_order_relaxed);
    if (auto host = host_.lock()) {
      host->loseFromLoop(why);
    }
    return;
  }
  bool retry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    retry = offerCapped_ && !offerSent_ && !closing_;
  }
  if (retry) {
    sendOfferFromLoop(); // (not on a closed host: it checks)
  }
}

void LanesChannel::onClosedFromLoop() {
  stopAll();
}

void LanesChannel::failConnection(const std::string& reason, bool refused) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) {
      return;
    }
  }
  if (auto host = host_.lock()) {
    std::weak_ptr<Host> weak = host;
    host->post([weak, reason, refused] {
      if (auto h = weak.lock(); h && !h->isClosed()) {
        if (refused) {
          h->rejectFromLoop(reason);
        } else {
          h->loseFromLoop(reason);
        }
      }
    });
  }
}

bool LanesChannel::waitSayingAlive(
    const std::function<bool()>& waitABit,
    const std::function<bool()>& sayAlive,
    const char* underWay,
    std::string* error) {
  auto said = std::chrono::steady_clock::now();
  while (!waitABit()) {
    if (stop_.load() || host_.expired()) {
      *error = std::string("closed while ") + underWay;
      return false;
    }
    if (std::chrono::steady_clock::now() - said >= kKeepAliveEvery) {
      if (!sayAlive()) {
        return false;
      }
      said = std::chrono::steady_clock::now();
    }
  }
  return true;
}

bool LanesChannel::waitResident(
    const char* data,
    uint64_t bytes,
    const std::shared_ptr<void>& keepAlive,
    const std::function<bool()>& sayAlive,
    std::string* error) {
  auto read = PageRead::start(data, bytes, keepAlive);
  if (read == nullptr) {
    return true; // (no thread: the send reads them, silent meanwhile)
  }
  // Asked every 10 ms (a close does not wait on us).
  if (!waitSayingAlive(
          [&] { return read->waitFor(std::chrono::milliseconds(10)); },
          sayAlive,
          "its pages were read into memory",
          error)) {
    read->abandon();
    return false;
  }
  return true;
}

void LanesChannel::release(std::shared_ptr<void> keepAlive) {
  if (!keepAlive) {
    return;
  }
  if (auto host = host_.lock()) {
    host->releaseLater(std::move(keepAlive));
  }
  // else: the connection is gone, and with it the frames' other owners; the
  // last reference goes here.
}

void LanesChannel::stopAll() {
  std::vector<std::thread> threads;
  std::vector<std::shared_ptr<void>> queued;
  std::map<uint64_t, std::shared_ptr<Landing>> landings;
  uint64_t heldIn = 0, heldOut = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
    std::swap(heldIn, heldIn_);
    std::swap(heldOut, heldOut_);
    // Their memory goes back to the pool now (a tensor that views one
    // keeps its own reference), not when the last lane thread ends.
    landings.swap(landings_);
    unclaimedBytes_ = 0;
    unclaimedSegments_ = 0;
    stop_ = true;
    if (outState_ != OutState::kUp) {
      outState_ = OutState::kFailed;
    }
    for (auto& lane : out_) {
      if (lane.fd >= 0) {
        ::shutdown(lane.fd, SHUT_RDWR);
      }
      for (auto& stripe : lane.queue) {
        queued.push_back(std::move(stripe.keepAlive));
      }
      lane.queue.clear();
      if (lane.thread.joinable()) {
        threads.push_back(std::move(lane.thread));
      }
    }
    for (auto& [id, t] : taken_) {
      queued.push_back(std::move(t.keepAlive));
    }
    taken_.clear();
    for (int fd : inFds_) {
      ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : inThreads_) {
      threads.push_back(std::move(t));
    }
    inThreads_.clear();
  }
  wake_.notify_all();
  budget_.notify_all();
  for (auto& k : queued) {
    release(std::move(k));
  }
  const_cast<LanesContext&>(lanesContext()).revokeTickets(this);
  for (auto& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      // The last lane thread to end let go of us: it touches nothing of
      // ours after this.
      t.detach();
    } else {
      t.join();
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& lane : out_) {
    if (lane.fd >= 0) {
      ::close(lane.fd);
      lane.fd = -1;
    }
  }
  for (int fd : inFds_) {
    ::close(fd);
  }
  inFds_.clear();
  inSlots_.clear();
  // Our lanes' threads have ended (or end now, touching nothing) and their
  // sockets are closed: what we held goes back to the cap (closing: no
  // offer or dial follows).
  if (heldIn > 0) {
    lanesContext().releaseLanes(/*inbound=*/true, heldIn);
  }
  if (heldOut > 0) {
    lanesContext().releaseLanes(/*inbound=*/false, heldOut);
  }
}

} // namespace torch_rpc_ext::channel::lanes
