// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/stream/connection.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

#include "csrc/common/fd_closer.h"
#include "csrc/common/host_load.h"
#include "csrc/common/logging.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/stream/address.h"

namespace torch_rpc_ext::transport::stream {

namespace {

// Calls a channel's function when the descriptor it watches is readable.
class Watcher final : public Pollable {
 public:
  explicit Watcher(std::function<void()> fn) : fn_(std::move(fn)) {}
  void handleEventsFromLoop(uint32_t /*events*/) override {
    fn_();
  }

 private:
  std::function<void()> fn_;
};

// Tests only: a loop thread stalls this long, as one descheduled there would
// (read each time: a forked child may set it). ..._AFTER_PROOF_MS: an end
// once the proofs are through, before it is ready and writes what waited
// (test_last_words.py); ..._CONNECTING_MS: see connect().
void pauseForTesting(const char* variable) {
  if (const char* ms = std::getenv(variable)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
  }
}

} // namespace

StreamConnection::StreamConnection(
    Loop& loop,
    const TransportOptions& options,
    std::string transportName,
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer,
    std::shared_ptr<const TlsContext> tls)
    : loop_(loop),
      options_(options),
      state_(outbound ? State::kConnecting : State::kHandshake),
      transportName_(std::move(transportName)),
      tlsContext_(std::move(tls)),
      fd_(fd),
      outbound_(outbound),
      expectedPeerId_(expectedPeerId),
      peerAddress_(std::move(peerAddress)),
      observer_(observer),
      handshake_(
          outbound,
          options.secret,
          options.selfId,
          expectedPeerId,
          options.peerIdLimit,
          options.selfIncarnation,
          options.admit) {}

StreamConnection::~StreamConnection() {
  // A Unix socket may still hold messages with descriptors the peer sent
  // (a frame after the one we refused): closing it lets them go, the last
  // close of each on this thread (fd_closer.h).
  closeSocket(fd_);
  closeOffThread(receivedFds_); // the peer's: fd_closer.h
}

void StreamConnection::post(std::function<void()> fn) {
  loop_.post(std::move(fn));
}

void StreamConnection::watchFromLoop(int fd, std::function<void()> onReadable) {
  try {
    loop_.addFromLoop(
        fd, std::make_shared<Watcher>(std::move(onReadable)), EPOLLIN);
  } catch (const std::exception& e) {
    // A frame ring's or a channel's wake-ups would never be heard: the
    // connection closes, naming that (from the loop's next batch: a caller
    // may hold the write lock). Until session 97 the error escaped into
    // the caller, leaving a ring half set up and its calls waiting out
    // their timeouts.
    std::weak_ptr<StreamConnection> weak = weak_from_this();
    loop_.post([weak, error = std::string(e.what())] {
      if (auto self = weak.lock()) {
        self->closeInternal(
            "the event loop could not watch a wake-up of the connection: " +
                error,
            false);
      }
    });
  }
}

void StreamConnection::unwatchFromLoop(int fd) {
  loop_.removeFromLoop(fd);
}

void StreamConnection::startConnect(
    const std::string& address,
    const std::string& refused) {
  openChannels(expectedPeerId_);
  if (!refused.empty()) {
    closeInternal(refused, false);
    return;
  }
  if (fd_ < 0) {
    closeInternal(errnoText("socket"), false);
    return;
  }
  SocketAddress to;
  try {
    to = SocketAddress::parse(address);
  } catch (const std::exception& e) {
    closeInternal(e.what(), false);
    return;
  }
  tuneSocket();
  int rv = ::connect(fd_, reinterpret_cast<sockaddr*>(&to.storage), to.length);
  if (rv != 0 && errno == EAGAIN && to.storage.ss_family == AF_UNIX) {
    // A local listener whose backlog is full (a burst of local dialers
    // while its loop was busy): the socket stays unconnected, so dial again
    // from the loop, backing off, within the handshake timeout. Before
    // session 96 the call failed at once ("Resource temporarily
    // unavailable") where a moment later the dial would have gone through.
    struct Redial {
      static void after(
          std::shared_ptr<StreamConnection> self,
          SocketAddress to,
          std::string address,
          std::chrono::steady_clock::time_point deadline,
          std::chrono::milliseconds wait) {
        Loop& loop = self->loop_;
        loop.runAfter(wait, [self, to, address, deadline, wait]() mutable {
          if (self->state_ == State::kClosed) {
            return;
          }
          int rv = ::connect(
              self->fd_, reinterpret_cast<sockaddr*>(&to.storage), to.length);
          const int error = rv == 0 ? 0 : errno;
          if (rv == 0 || error == EINPROGRESS) {
            self->startFromLoop(/*connecting=*/true);
          } else if (
              error == EAGAIN && std::chrono::steady_clock::now() < deadline) {
            after(
                std::move(self),
                to,
                std::move(address),
                deadline,
                std::min<std::chrono::milliseconds>(
                    wait * 2, std::chrono::milliseconds(100)));
          } else {
            self->closeInternal(
                "connect to " + address + " failed: " + std::strerror(error) +
                    (error == EAGAIN ? " (its listen backlog stayed full for "
                                       "handshake_timeout)"
                                     : ""),
                false);
          }
        });
      }
    };
    Redial::after(
        shared_from_this(),
        to,
        address,
        std::chrono::steady_clock::now() + options_.handshakeTimeout,
        std::chrono::milliseconds(1));
    return;
  }
  if (rv != 0 && errno != EINPROGRESS) {
    closeInternal(
        "connect to " + address + " failed: " + std::strerror(errno), false);
    return;
  }
  auto self = shared_from_this();
  if (std::getenv("TORCH_RPC_EXT_TEST_PAUSE_CONNECTING_MS")) {
    auto paused = std::make_shared<std::promise<void>>();
    auto started = paused->get_future();
    loop_.post([paused] {
      paused->set_value();
      pauseForTesting("TORCH_RPC_EXT_TEST_PAUSE_CONNECTING_MS");
    });
    started.wait(); // startFromLoop() is in the loop's next batch
  }
  loop_.post([self] { self->startFromLoop(/*connecting=*/true); });
}

void StreamConnection::startAcceptedFromLoop() {
  tuneSocket();
  TlsStart tls = startTlsFromLoop();
  if (tls == TlsStart::kClosed) {
    return;
  }
  if (startFromLoop(/*connecting=*/false) && tls == TlsStart::kEncrypt) {
    driveTlsFromLoop();
  }
}

bool StreamConnection::startFromLoop(bool connecting) {
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return false;
    }
    wantWrite_ = connecting || !writes_.empty();
    uint32_t events = EPOLLIN | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u);
    try {
      loop_.addFromLoop(fd_, shared_from_this(), events);
      registered_ = true;
    } catch (const std::exception& e) {
      refused = e.what();
    }
  }
  if (!refused.empty()) {
    // The kernel refused to watch it (ENOMEM, or fs.epoll.max_user_watches
    // reached). Until session 97 the error escaped into the loop's log: the
    // connection stayed connecting, with no timer, and every call to its
    // peer waited out its timeout, the next ones on it too.
    closeInternal(
        "the event loop could not watch the connection: " + refused, false);
    return false;
  }
  noteActivity();
  handshakeStartedAt_ = std::chrono::steady_clock::now();
  armHandshakeTimer(options_.handshakeTimeout);
  return true;
}

std::string StreamConnection::describe() const {
  return transportName_ + (outbound_ ? " to " : " from ") + peerAddress_ +
      (peerId_ >= 0 ? " (worker id " + std::to_string(peerId_.load()) + ")"
                    : "");
}

bool StreamConnection::hasQueuedWrites() const {
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (!writes_.empty() || (tls_ && tls_->hasPendingOutput())) {
      return true;
    }
  }
  // And what a channel writes on sockets of its own (tcp_lanes' stripes):
  // its frame's record went through us, its bytes not yet. (channels_ is
  // complete once the state is ready: it is set after them.)
  if (state_.load() != State::kReady) {
    return false;
  }
  for (const auto& c : channels_) {
    if (c->hasQueuedSends()) {
      return true;
    }
  }
  return false;
}

void StreamConnection::strikeSourceFromLoop() {
  if (!strikes_ || !strikes_->strike(strikeSource_)) {
    return;
  }
  // Rate-limited: whoever can reach the port decides how often.
  logWarningLimited(
      "source_held_off",
      "torch_rpc_ext: " + transportName_ + ": " + strikeSource_ + " made " +
          strikes_->describe("connections whose proof was refused") +
          " (its connections closed unread; counted in "
          "rpc_ext." +
          transportName_ + ".sources_held_off)");
}

void StreamConnection::countGuessesAgainst(
    std::shared_ptr<SourceStrikes> s,
    std::string t) {
  guessStrikes_ = std::move(s);
  guessTarget_ = std::move(t);
}

std::string StreamConnection::heldOffServerText(
    const SourceStrikes& strikes,
    const std::string& target) {
  return "connect to " + target + " refused here: its server ended " +
      strikes.describe(
          "of our TLS handshakes unfinished after the key exchange") +
      " (this worker and it do not share the group's secret: an impostor "
      "taking a guess at it with each connection, or one of the two given "
      "another; or it shed our handshakes itself: over its cap on "
      "unauthenticated connections, or holding this address off; the "
      "warning logged as the hold-off began says how they ended)";
}

void StreamConnection::logServerHeldOff(const std::string& reason) {
  // Rate-limited: a server that refuses us decides how often.
  logWarningLimited(
      "server_held_off",
      "torch_rpc_ext: " + transportName_ + ": the server at " + guessTarget_ +
          " ended " +
          guessStrikes_->describe(
              "of our TLS handshakes unfinished after the key exchange") +
          " (this worker and it do not share the group's secret, or it shed "
          "them itself; the last ended: " +
          reason + "; counted in rpc_ext." + transportName_ +
          ".servers_held_off)");
}

bool StreamConnection::closedForHeldOffSourceFromLoop() {
  // Checked at each step before a proof is, not only at accept: a guesser
  // could open many connections first and prove on each afterwards.
  if (!strikes_ || !strikes_->heldOff(strikeSource_)) {
    return false;
  }
  closeInternal(
      "closed before its proof was checked: its source " + strikeSource_ +
          " is held off for the proofs refused from it lately",
      false);
  return true;
}

std::string StreamConnection::security() const {
  // tls_ never changes once set, before kHandshake (writeMutex_ orders the
  // two).
  std::lock_guard<std::mutex> lock(writeMutex_);
  return tls_ && state_ == State::kReady ? tls_->describe() : std::string();
}

std::string StreamConnection::closeReason() const {
  std::lock_guard<std::mutex> lock(writeMutex_);
  return closeReason_;
}

void StreamConnection::handleEventsFromLoop(uint32_t events) {
  if (state_ == State::kClosed) {
    return;
  }
  if (state_ == State::kConnecting) {
    if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) {
      onConnectedFromLoop();
    }
    return;
  }
  if (state_ == State::kTls) {
    driveTlsFromLoop();
    return;
  }
  if (inRing_ && (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
    socketEnded_ = true; // closed once the ring is read to its end
  }
  if (recordHeld_ && (events & (EPOLLERR | EPOLLHUP | EPOLLRDHUP))) {
    socketEndedWhileHeldFromLoop(); // read once the record's bytes are in
    return;
  }
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP | kRingInput)) {
    onReadableFromLoop();
  }
  if ((events & EPOLLOUT) && state_ != State::kClosed) {
    std::string error;
    {
      std::lock_guard<std::mutex> lock(writeMutex_);
      error = flushLocked();
    }
    afterFlush(error);
  }
}

void StreamConnection::afterFlush(const std::string& error) {
  releaseFinished();
  if (!error.empty()) {
    writeFailed(error);
  }
}

void StreamConnection::releaseFinished() {
  std::vector<std::shared_ptr<void>> done;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    done.swap(finished_);
  }
  if (done.empty()) {
    return;
  }
  if (options_.releaseOffLoop && loop_.inLoop()) {
    // One hand-off a flush, not one a frame: a loop that flushes a queue of
    // pipelined requests woke a pool thread for each (session 47).
    options_.releaseOffLoop(std::move(done));
  }
}

void StreamConnection::onConnectedFromLoop() {
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    closeInternal(
        "connect to " + peerAddress_ + " failed: " + std::strerror(err), false);
    return;
  }
  int domain = 0;
  len = sizeof(domain);
  if (::getsockopt(fd_, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 &&
      domain == AF_UNIX) {
    // Who listens there is checked before our hello goes, as an accepted
    // connection's peer is (listener.cpp).
    std::string refusal = localPeerRefusal(fd_, options_.localPeersAnyUser);
    if (!refusal.empty()) {
      closeInternal("refused " + peerAddress_ + ": " + refusal, false);
      return;
    }
  }
  switch (startTlsFromLoop()) {
    case TlsStart::kClosed:
      return;
    case TlsStart::kEncrypt:
      driveTlsFromLoop();
      return;
    case TlsStart::kClear:
      break;
  }
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    state_ = State::kHandshake;
  }
  queueControl(uint8_t(frame::FrameKind::kHello), handshake_.hello());
}

bool StreamConnection::onHandshakeFrameFromLoop(std::string head) {
  if (closedForHeldOffSourceFromLoop()) {
    return false;
  }
  Handshake::Step step = handshake_.onFrame(head);
  if (!step.error.empty()) {
    if (step.proofRefused && !outbound_) {
      strikeSourceFromLoop();
    }
    closeInternal(step.error, false);
    return false;
  }
  if (step.done) {
    peerProven_ = true; // before our reply's write, which may fail
  }
  if (step.hasReply) {
    queueControl(uint8_t(step.replyKind), std::move(step.replyHead));
  }
  if (step.done) {
    pauseForTesting("TORCH_RPC_EXT_TEST_PAUSE_AFTER_PROOF_MS");
  }
  if (!step.done) {
    return state_ != State::kClosed;
  }
  // The peer is known: an accepted connection's channels open before the
  // peer's first frame is read (an outbound one's opened on connect).
  if (!outbound_) {
    openChannels(handshake_.peerId());
  }
  if (receivedFds_.size() > maxPendingFds_) {
    rejectFromLoop("peer sent unexpected file descriptors");
    return false;
  }
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return false;
    }
    peerInc_ = handshake_.peerIncarnation();
    peerId_ = handshake_.peerId();
    state_ = State::kReady;
    error = flushLocked();
  }
  releaseFinished();
  if (!error.empty() && !writeFailed(error)) {
    return false;
  }
  noteActivity();
  scheduleHeartbeat();
  for (auto& ch : channels_) {
    ch->onReadyFromLoop();
  }
  if (state_ != State::kClosed && !closingAfterInput_) { // (gone: no ring)
    offerFrameRingFromLoop();
  }
  if (state_ == State::kClosed) {
    return false;
  }
  observer_->onReady(shared_from_this());
  return state_ != State::kClosed;
}

void StreamConnection::close(const std::string& reason) {
  closeInternal(reason, true);
}

void StreamConnection::closeKnockedFromLoop(bool reset) {
  knockOnly_ = true;
  closeInternal(
      reset ? "peer reset the connection before its first byte"
            : "peer closed the connection before its first byte",
      false);
}

void StreamConnection::closeInternal(std::string reason, bool local) {
  bool holdOffBegan = false;
  std::deque<PendingWrite> dropped;
  std::vector<std::shared_ptr<void>> unsent;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    state_ = State::kClosed;
    // Struck before anyone sees it closed (a redial then finds the hold-off).
    if (guessOut_.exchange(false) && !local) {
      holdOffBegan = guessStrikes_->strike(guessTarget_);
    }
    dropped.swap(writes_);
    for (auto& w : dropped) {
      if (w.frame.keepAlive) {
        finished_.push_back(std::move(w.frame.keepAlive));
      }
      if (w.frame.ifUnsent) {
        // A holder that runs it as it is let go.
        unsent.push_back(
            std::shared_ptr<void>(
                nullptr,
                [run = std::move(w.frame.ifUnsent)](void*) { run(); }));
      }
    }
    closeReason_ = reason;
  }
  releaseFinished();
  if (holdOffBegan) {
    logServerHeldOff(reason);
  }
  // Off this thread whichever it is (releaseFinished() lets go in place
  // off the loop): a close may come from a thread holding locks of its
  // owner's, and the owner's action takes others (and the GIL).
  if (!unsent.empty() && options_.releaseOffLoop) {
    options_.releaseOffLoop(std::move(unsent));
  }
  if (!local && !reason.empty()) {
    logDebug("torch_rpc_ext: closing " + describe() + ": " + reason);
  }
  auto self = shared_from_this();
  auto finish = [self, reason] {
    if (self->registered_) {
      self->loop_.removeFromLoop(self->fd_);
    }
    if (self->inRing_) {
      self->loop_.removeFromLoop(self->inRing_->signalFd());
    }
    if (self->outRing_) {
      self->loop_.removeFromLoop(self->outRing_->signalFd());
    }
    for (auto& ch : self->channels_) {
      ch->onClosedFromLoop();
    }
    if (self->fd_ >= 0) {
      ::shutdown(self->fd_, SHUT_RDWR);
    }
    self->observer_->onClosed(*self, reason);
  };
  if (loop_.inLoop()) {
    finish();
  } else {
    loop_.post(finish);
  }
}

} // namespace torch_rpc_ext::transport::stream
