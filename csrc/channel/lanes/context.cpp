// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/lanes/context.h"

#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "csrc/channel/lanes/factory.h"
#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

constexpr int kHelloTimeoutMs = 5000;
constexpr int kAcceptPollMs = 200;
constexpr size_t kMaxPendingHellos = 64;
// Revoked tickets are remembered this long (at most kMaxRevoked of them).
constexpr auto kRevokedKept = std::chrono::seconds(30);
constexpr size_t kMaxRevoked = 4096;
// Landing buffers kept for reuse, and for how long.
constexpr size_t kPoolBytes = size_t(512) << 20;
constexpr auto kPoolIdle = std::chrono::seconds(5);

// An unsigned integer from the environment within [lo, hi]; "" or the
// default if unset; else why not.
std::string readSetting(
    const char* name,
    uint64_t lo,
    uint64_t hi,
    uint64_t* out) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return "";
  }
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) {
    return std::string(name) + "=" + text + " is not a whole number from " +
        std::to_string(lo) + " to " + std::to_string(hi);
  }
  *out = v;
  return "";
}

// The index in `pending` (in arrival order) of the oldest entry of the
// source holding the most entries; of equals, the one whose oldest came first.
template <typename Pending>
size_t oldestOfBusiestSource(const std::vector<Pending>& pending) {
  std::unordered_map<std::string_view, size_t> held;
  for (const auto& p : pending) {
    ++held[p.source];
  }
  size_t pick = 0;
  for (size_t i = 1; i < pending.size(); ++i) {
    if (held[pending[i].source] > held[pending[pick].source]) {
      pick = i; // (the first of its source: a later one never has more)
    }
  }
  return pick;
}

} // namespace

LanesContext::LanesContext(WireIds ids)
    : Context(ids), pool_(std::make_shared<BufferPool>(kPoolBytes, kPoolIdle)) {
  uint64_t lanes = settings_.lanes;
  unviable_ = readSetting("TORCH_RPC_EXT_LANES", 1, 16, &lanes);
  if (unviable_.empty()) {
    unviable_ = readSetting(
        "TORCH_RPC_EXT_LANES_MIN_BYTES",
        kMinStripedBytes,
        frame::kSegmentLengthMask,
        &settings_.minBytes);
  }
  settings_.lanes = static_cast<uint16_t>(lanes);
  if (unviable_.empty()) {
    unviable_ = readSetting(
        "TORCH_RPC_EXT_LANES_MAX", lanes, 4096, &settings_.maxLanes);
  }
  if (unviable_.empty()) {
    uint64_t perKey = settings_.recordsPerKey;
    unviable_ = readSetting(
        "TORCH_RPC_EXT_LANES_RECORDS_PER_KEY", 1, kMaxRecordsPerKey, &perKey);
    settings_.recordsPerKey = static_cast<uint32_t>(perKey);
  }
  if (const char* forge = std::getenv("TORCH_RPC_EXT_TEST_LANES_FORGE")) {
    if (std::string(forge) == "tiny" || std::string(forge) == "scatter") {
      settings_.testForge = forge; // nothing else: a stray value does nothing
    }
  }
  if (const char* stuck = std::getenv("TORCH_RPC_EXT_TEST_LANES_STUCK_COPY")) {
    settings_.testStuckCopy = std::string(stuck) == "1";
  }
  if (const char* unreachable =
          std::getenv("TORCH_RPC_EXT_TEST_LANES_UNREACHABLE")) {
    settings_.testUnreachable = std::string(unreachable) == "1";
  }
  if (unviable_.empty()) {
    try {
      Aead probe(std::string(Aead::kKeyBytes, '\0')); // encrypted lanes
      settings_.aesGcmVaes = probe.engine() == Aead::Engine::kVaes;
    } catch (const std::exception& e) {
      unviable_ = e.what();
    }
  }
}

LanesContext::AcceptState::~AcceptState() {
  if (fd >= 0) {
    ::close(fd);
  }
}

LanesContext::~LanesContext() {
  std::map<std::string, Listener> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    listeners.swap(listeners_);
  }
  for (auto& [key, l] : listeners) {
    l.state->stop = true;
    if (l.thread.get_id() == std::this_thread::get_id()) {
      l.thread.detach(); // it touches only its state from here on
    } else {
      l.thread.join();
    }
  }
}

std::shared_ptr<Channel> LanesContext::open(
    std::weak_ptr<Host> host,
    const std::string& /*peerDescriptor*/) {
  auto self = std::static_pointer_cast<LanesContext>(shared_from_this());
  return std::make_shared<LanesChannel>(std::move(self), std::move(host));
}

std::map<std::string, uint64_t> LanesContext::counters() const {
  return {
      {"segments", counters_.segments.load()},
      {"staged_segments", counters_.stagedSegments.load()},
      {"bytes", counters_.bytes.load()},
      {"lanes_opened", counters_.lanesOpened.load()},
      {"lanes_failed", counters_.lanesFailed.load()},
      {"held_records", counters_.heldRecords.load()},
      {"keepalives", counters_.keepAlives.load()},
      {"stalls", counters_.stalls.load()},
      {"lanes_broken", counters_.lanesBroken.load()},
      {"lanes_capped", counters_.lanesCapped.load()},
      {"lanes_in", counters_.lanesIn.load()},
      {"lanes_out", counters_.lanesOut.load()},
      {"rekeys", counters_.rekeys.load()},
      {"hellos_refused", counters_.hellosRefused.load()},
      {"sources_held_off", counters_.sourcesHeldOff.load()},
      {"hold_off_exempt_failures", strikes_.exemptFailures()},
      {"hellos_evicted", counters_.hellosEvicted.load()},
      {"hellos_timed_out", counters_.hellosTimedOut.load()},
      {"aes_gcm_vaes", settings_.aesGcmVaes ? 1u : 0u},
  };
}

uint64_t LanesContext::holdLanes(bool inbound, uint64_t most) const {
  auto& held = inbound ? counters_.lanesIn : counters_.lanesOut;
  uint64_t now = held.load();
  uint64_t n;
  do {
    n = now >= settings_.maxLanes ? 0
                                  : std::min(most, settings_.maxLanes - now);
    if (n == 0) {
      return 0;
    }
  } while (!held.compare_exchange_weak(now, now + n));
  return n;
}

void LanesContext::noteCapped(bool inbound, const std::string& peer) const {
  counters_.lanesCapped.fetch_add(1, std::memory_order_relaxed);
  if (cappedSaid_[inbound ? 1 : 0].exchange(true)) {
    return;
  }
  // Lanes the program asked for say so; the default's (encrypted
  // connections only) is an optimisation the program never chose: a note.
  auto say = encryptedOnly_ ? &logDebug : &logWarning;
  say(std::string("torch_rpc_ext: tcp_lanes: this process holds ") +
      std::to_string(
          (inbound ? counters_.lanesIn : counters_.lanesOut).load()) +
      " lanes " + (inbound ? "from its peers" : "to its peers") +
      " of TORCH_RPC_EXT_LANES_MAX=" + std::to_string(settings_.maxLanes) +
      ", none left for " + peer +
      ": its large tensors travel in the connection's stream until lanes go "
      "back, as on every connection past the cap (said once; "
      "rpc_ext.channel.tcp_lanes.lanes_capped counts them)");
}

void LanesContext::releaseLanes(bool inbound, uint64_t count) const {
  (inbound ? counters_.lanesIn : counters_.lanesOut).fetch_sub(count);
}

uint16_t LanesContext::listenFor(const sockaddr_storage& local) {
  sockaddr_storage address = local;
  setPort(&address, 0);
  std::string key = describeAddress(address);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = listeners_.find(key);
  if (it != listeners_.end()) {
    return it->second.port;
  }
  Listener l;
  std::string why;
  int fd = bindAnyPort(local, &l.port, &why);
  if (fd >= 0 && ::listen(fd, 128) != 0) {
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  if (fd < 0) {
    throw std::runtime_error("tcp_lanes: cannot listen on " + key + ": " + why);
  }
  auto state = std::make_shared<AcceptState>();
  state->fd = fd; // closed with the state from here on
  l.state = state;
  // Listed only once its thread runs (std::thread may throw).
  // A weak reference: the thread must not keep us alive.
  std::weak_ptr<LanesContext> weak =
      std::static_pointer_cast<LanesContext>(shared_from_this());
  l.thread = std::thread([weak = std::move(weak), state]() mutable {
    nameThisThread("rpcx-lane-acc");
    acceptLoop(std::move(weak), state);
  });
  uint16_t port = l.port;
  listeners_.emplace(key, std::move(l));
  return port;
}

std::string LanesContext::issueTicket(
    std::weak_ptr<LanesChannel> channel,
    uint16_t lane,
    const std::string& helloKey) {
  std::string ticket = randomBytes(kTicketBytes);
  const LanesChannel* owner = channel.lock().get();
  std::lock_guard<std::mutex> lock(mutex_);
  tickets_[ticket] = Ticket{std::move(channel), owner, lane, helloKey};
  return ticket;
}

void LanesContext::revokeTickets(const LanesChannel* channel) {
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  // Kept a while: their peer may be dialling them now (not a prober).
  for (auto it = revoked_.begin(); it != revoked_.end();) {
    it = it->second.revokedAt + kRevokedKept < now ? revoked_.erase(it)
                                                   : std::next(it);
  }
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    if (it->second.owner != channel) {
      ++it;
      continue;
    }
    if (revoked_.size() < kMaxRevoked) {
      Ticket t = it->second;
      t.channel.reset();
      t.revokedAt = now;
      revoked_.emplace(it->first, std::move(t));
    }
    it = tickets_.erase(it);
  }
}

void LanesContext::acceptLoop(
    std::weak_ptr<LanesContext> weak,
    std::shared_ptr<AcceptState> state) {
  // Hellos being read: each must come whole within kHelloTimeoutMs; at most
  // kMaxPendingHellos wait, so that nobody holds the lanes' door by
  // connecting and saying nothing. Past that the oldest of the source
  // holding the most goes: a prober that fills the door closes its own, not
  // a peer's lane whose hello is on its way (before session 98, the oldest
  // of all: a flood of silent connections closed every lane dialled before
  // it, whose hellos then failed and whose segments rode the stream).
  struct Pending {
    int fd;
    std::chrono::steady_clock::time_point due;
    Hello hello;
    size_t got;
    uint8_t challenge[kChallengeBytes];
    std::string source;
  };
  std::vector<Pending> pending;
  std::vector<pollfd> polled;
  auto drop = [&](size_t i) {
    ::close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  while (!state->stop) {
    polled.assign(1, pollfd{state->fd, POLLIN, 0});
    for (const auto& p : pending) {
      polled.push_back(pollfd{p.fd, POLLIN, 0});
    }
    if (::poll(polled.data(), polled.size(), kAcceptPollMs) < 0 &&
        errno != EINTR) {
      std::this_thread::sleep_for(std::chrono::milliseconds(kAcceptPollMs));
      continue;
    }
    auto now = std::chrono::steady_clock::now();
    // Read what came, from the last so that drops keep indices valid.
    for (size_t k = pending.size(); k-- > 0;) {
      Pending& p = pending[k];
      if (polled[k + 1].revents != 0) {
        ssize_t n = ::recv(
            p.fd,
            reinterpret_cast<char*>(&p.hello) + p.got,
            sizeof(Hello) - p.got,
            MSG_DONTWAIT);
        if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) {
          drop(k);
          continue;
        }
        p.got += n > 0 ? static_cast<size_t>(n) : 0;
        if (p.got == sizeof(Hello)) {
          Pending taken = std::move(p);
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
          int fd = taken.fd;
          if (auto self = weak.lock()) {
            try {
              self->admit(fd, taken.hello, taken.challenge, taken.source);
            } catch (const std::exception& e) {
              logWarningLimited(
                  "lanes_admit",
                  std::string(
                      "torch_rpc_ext: tcp_lanes could not take a "
                      "lane: ") +
                      e.what());
            }
          } else {
            ::close(fd);
          }
          if (state->stop) {
            break; // we may have been the last to hold the context
          }
          continue;
        }
      }
      if (now >= p.due) {
        drop(k);
        if (auto self = weak.lock()) {
          self->counters_.hellosTimedOut.fetch_add(
              1, std::memory_order_relaxed);
        }
      }
    }
    if (state->stop || (polled[0].revents & POLLIN) == 0) {
      continue;
    }
    sockaddr_storage from{};
    socklen_t fromLength = sizeof(from);
    int fd = ::accept4(
        state->fd,
        reinterpret_cast<sockaddr*>(&from),
        &fromLength,
        SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        // Out of descriptors or memory: let the process catch up.
        std::this_thread::sleep_for(std::chrono::milliseconds(kAcceptPollMs));
      }
      continue;
    }
    setPort(&from, 0);
    std::string source = describeAddress(from);
    bool refuse;
    {
      auto self = weak.lock();
      refuse = !self || self->heldOff(source);
    }
    if (refuse || state->stop) { // (we may have held the last reference)
      ::close(fd);
      continue;
    }
    Pending p{
        fd,
        now + std::chrono::milliseconds(kHelloTimeoutMs),
        Hello{},
        0,
        {},
        std::move(source)};
    std::string challenge;
    try {
      challenge = randomBytes(kChallengeBytes);
    } catch (const std::exception&) {
      ::close(fd);
      continue;
    }
    std::memcpy(p.challenge, challenge.data(), kChallengeBytes);
    // A fresh socket's buffer takes 16 bytes at once.
    if (::send(fd, p.challenge, kChallengeBytes, MSG_DONTWAIT | MSG_NOSIGNAL) !=
        static_cast<ssize_t>(kChallengeBytes)) {
      ::close(fd);
      continue;
    }
    pending.push_back(std::move(p));
    if (pending.size() > kMaxPendingHellos) {
      drop(oldestOfBusiestSource(pending));
      if (auto self = weak.lock()) {
        self->counters_.hellosEvicted.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  for (const auto& p : pending) {
    ::close(p.fd);
  }
}

bool LanesContext::heldOff(const std::string& source) {
  if (!strikes_.heldOff(source)) {
    return false;
  }
  counters_.hellosRefused.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void LanesContext::strike(const std::string& source) {
  if (strikes_.strike(source)) {
    counters_.sourcesHeldOff.fetch_add(1, std::memory_order_relaxed);
    logWarningLimited(
        "lanes_held_off",
        "torch_rpc_ext: tcp_lanes: " + source + " sent " +
            strikes_.describe("lane hellos that proved nothing") +
            " (its lane connections closed unread)");
  }
}

void LanesContext::admit(
    int fd,
    const Hello& hello,
    const uint8_t* challenge,
    const std::string& source) {
  std::shared_ptr<LanesChannel> channel;
  uint16_t lane = 0;
  // A hello that proves a ticket (a valid MAC) is no prober's, even when
  // its channel closed meanwhile or revoked it: refused, never a strike.
  bool proved = false;
  try {
    if (hello.magic == kHelloMagic && hello.version == kHelloVersion) {
      std::string ticket(
          reinterpret_cast<const char*>(hello.ticket), kTicketBytes);
      auto proves = [&](const Ticket& t) {
        uint8_t mac[kHelloMacBytes];
        helloMac(t.helloKey, challenge, hello.lane, hello.ticket, mac);
        return t.lane == hello.lane &&
            constantTimeEqual(mac, hello.mac, kHelloMacBytes);
      };
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = tickets_.find(ticket);
      if (it != tickets_.end() && proves(it->second)) {
        proved = true;
        channel = it->second.channel.lock();
        lane = it->second.lane;
        tickets_.erase(it); // single use; a wrong MAC spends nothing
      } else if (
          auto r = revoked_.find(ticket);
          r != revoked_.end() && proves(r->second)) {
        proved = true; // its connection closed as its peer dialled
      }
    }
    if (!channel) {
      counters_.hellosRefused.fetch_add(1, std::memory_order_relaxed);
      if (!proved) {
        strike(source);
      }
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (!channel) {
    if (proved) {
      // A race, not a probe: the connection the ticket was for closed (or
      // gave its lanes up) as its peer dialled.
      logWarningLimited(
          "lanes_late",
          "torch_rpc_ext: tcp_lanes closed a lane from " + source +
              " whose connection had already closed");
    } else {
      logWarningLimited(
          "lanes_no_ticket",
          "torch_rpc_ext: tcp_lanes refused a lane from " + source +
              " whose hello proved no ticket of ours");
    }
    ::close(fd);
    return;
  }
  tuneLaneSocket(fd);
  channel->attachInbound(lane, fd);
}

std::shared_ptr<Context> createLanesChannel(WireIds ids) {
  return std::make_shared<LanesContext>(ids);
}

} // namespace torch_rpc_ext::channel::lanes
