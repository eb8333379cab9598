// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/lanes/context.h"

#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "csrc/channel/lanes/factory.h"
#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

constexpr int kHelloTimeoutMs = 5000;
constexpr int kAcceptPollMs = 200;
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

} // namespace

LanesContext::LanesContext(WireIds ids)
    : Context(ids), pool_(std::make_shared<BufferPool>(kPoolBytes, kPoolIdle)) {
  uint64_t lanes = settings_.lanes;
  unviable_ = readSetting("TORCH_RPC_EXT_LANES", 1, 16, &lanes);
  if (unviable_.empty()) {
    unviable_ = readSetting(
        "TORCH_RPC_EXT_LANES_MIN_BYTES",
        4096,
        frame::kSegmentLengthMask,
        &settings_.minBytes);
  }
  settings_.lanes = static_cast<uint16_t>(lanes);
}

LanesContext::~LanesContext() {
  stopping_ = true;
  std::map<std::string, Listener> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    listeners.swap(listeners_);
  }
  for (auto& [key, l] : listeners) {
    if (l.thread.joinable()) {
      if (l.thread.get_id() == std::this_thread::get_id()) {
        l.thread.detach(); // the last channel let go on the accept thread
      } else {
        l.thread.join();
      }
    }
    ::close(l.fd);
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
      {"bytes", counters_.bytes.load()},
      {"lanes_opened", counters_.lanesOpened.load()},
      {"lanes_failed", counters_.lanesFailed.load()},
      {"held_records", counters_.heldRecords.load()},
  };
}

uint16_t LanesContext::listenFor(const sockaddr_storage& local) {
  sockaddr_storage address = local;
  socklen_t len;
  if (address.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in&>(address).sin_port = 0;
    len = sizeof(sockaddr_in);
  } else {
    reinterpret_cast<sockaddr_in6&>(address).sin6_port = 0;
    len = sizeof(sockaddr_in6);
  }
  std::string key = describeAddress(address);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = listeners_.find(key);
  if (it != listeners_.end()) {
    return it->second.port;
  }
  int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw std::runtime_error(
        std::string("tcp_lanes: socket failed: ") + std::strerror(errno));
  }
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), len) != 0 ||
      ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &len) != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("tcp_lanes: cannot listen on " + key + ": " + why);
  }
  Listener& l = listeners_[key];
  l.fd = fd;
  l.port = address.ss_family == AF_INET
      ? ntohs(reinterpret_cast<sockaddr_in&>(address).sin_port)
      : ntohs(reinterpret_cast<sockaddr_in6&>(address).sin6_port);
  l.thread = std::thread([this, fd] { acceptLoop(fd); });
  return l.port;
}

std::string LanesContext::issueTicket(
    std::weak_ptr<LanesChannel> channel,
    uint16_t lane) {
  std::string ticket = randomBytes(kTicketBytes);
  const LanesChannel* owner = channel.lock().get();
  std::lock_guard<std::mutex> lock(mutex_);
  tickets_[ticket] = Ticket{std::move(channel), owner, lane};
  return ticket;
}

void LanesContext::revokeTickets(const LanesChannel* channel) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    it = it->second.owner == channel ? tickets_.erase(it) : std::next(it);
  }
}

void LanesContext::acceptLoop(int listenFd) {
  while (!stopping_) {
    pollfd p{listenFd, POLLIN, 0};
    int rc = ::poll(&p, 1, kAcceptPollMs);
    if (rc <= 0) {
      continue;
    }
    int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      continue;
    }
    admit(fd);
  }
}

void LanesContext::admit(int fd) {
  // The Hello comes first, at once; a dialler that sends nothing in time,
  // or anything but a live ticket, is dropped.
  timeval timeout{kHelloTimeoutMs / 1000, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  Hello hello{};
  std::string error;
  std::shared_ptr<LanesChannel> channel;
  uint16_t lane = 0;
  if (recvAll(fd, &hello, sizeof(hello), &error) &&
      hello.magic == kHelloMagic && hello.version == 1) {
    std::string ticket(
        reinterpret_cast<const char*>(hello.ticket), kTicketBytes);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = tickets_.find(ticket);
    if (it != tickets_.end() && it->second.lane == hello.lane) {
      channel = it->second.channel.lock();
      lane = it->second.lane;
      tickets_.erase(it); // single use
    }
  }
  if (!channel) {
    logWarning(
        "torch_rpc_ext: tcp_lanes refused a connection that named no ticket "
        "of ours" +
        (error.empty() ? std::string() : " (" + error + ")"));
    ::close(fd);
    return;
  }
  timeval none{0, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
  tuneLaneSocket(fd);
  channel->attachInbound(lane, fd);
}

std::shared_ptr<Context> createLanesChannel(WireIds ids) {
  return std::make_shared<LanesContext>(ids);
}

} // namespace torch_rpc_ext::channel::lanes
