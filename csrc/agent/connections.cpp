// SPDX-License-Identifier: BSD-3-Clause
// The agent's connections (connections.h): opening the transports and
// channels, routes to peers, the connection per peer, and connections
// arriving and going.
#include "csrc/agent/connections.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include <c10/util/StringUtil.h>

#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/thread_state.h"
#include "csrc/channel/registry.h"
#include "csrc/common/cpus.h"
#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext {

namespace {

// Rendezvous lines that offer a channel start with this word.
constexpr const char* kChannelLine = "channel";

} // namespace

Connections::Connections(
    const AgentOptions& options,
    rpc::WorkerInfo self,
    int worldSize,
    const Group& group,
    FrameSink& sink,
    ThreadPool& pool)
    : options_(options),
      self_(std::move(self)),
      worldSize_(worldSize),
      group_(group),
      sink_(sink),
      pool_(pool) {}

std::string Connections::open(const std::string& secret, uint64_t incarnation) {
  const auto& self = self_;
  transport::TransportOptions topts;
  topts.selfId = self.id_;
  // A dynamic group admits any rank at the handshake; onReady then refuses
  // ids that no member holds.
  topts.peerIdLimit = worldSize_ > 0 ? worldSize_ : 32768;
  topts.selfIncarnation = incarnation;
  if (worldSize_ == 0) {
    // Both ends: only the current holder of an id is admitted.
    topts.admit = [this](int32_t id, uint64_t incarnation) {
      return group_.admissionError(id, incarnation);
    };
  }
  topts.secret = secret;
  topts.tls.mode = transport::parseTlsMode(options_.encryption);
  topts.tls.certFile = options_.tlsCert;
  topts.tls.keyFile = options_.tlsKey;
  topts.tls.caFile = options_.tlsCa;
  topts.tls.peerNames = options_.tlsPeerNames;
  topts.holdOffExempt = AddressRanges::parse(options_.holdOffExempt);
  topts.limits.maxFrameBytes = options_.maxFrameBytes;
  topts.handshakeTimeout = options_.handshakeTimeout;
  topts.heartbeatTimeout = options_.heartbeatTimeout;
  topts.busyPoll = options_.busyPoll;
  topts.followCaller =
      options_.pollOnCallerCpu.value_or(allowedCpus() <= kFollowCallerMaxCpus);
  topts.frameRingBytes = options_.shmFrameRingBytes;
  // Sent messages may hold the last reference to tensors with Python
  // objects; let the pool, not the loop thread, drop them.
  topts.releaseOffLoop = [this](std::vector<std::shared_ptr<void>> held) {
    pool_.run([held = std::move(held)]() mutable {
      thread_state::CheckedScope checked; // (a Python destructor may run)
      held.clear();
    });
  };
  topts.bindAddress = options_.address;
  topts.localPeersAnyUser = options_.shmPeersAnyUser;
  topts.channelsFor = [this](int32_t peerId, bool passesDescriptors) {
    return channelsFor(peerId, passesDescriptors);
  };
  TORCH_CHECK(
      !options_.transports.empty(), "RpcExtBackendOptions.transports is empty");
  // Our entry: the name, then one line per transport we listen on:
  // "<transport> <domain descriptor> <address>". A transport that is not
  // viable here is left out (with a warning); one that is viable but cannot
  // listen is an error (a wrong `address`, say).
  std::string entry;
  std::string unavailable;
  for (const auto& name : options_.transports) {
    auto t = transport::createTransport(name, topts);
    if (!t->isViable()) {
      unavailable += " " + name + ": " + t->unviableReason();
      continue;
    }
    auto l = t->listen();
    transports_[name] = t;
    listeners_.push_back(l);
    listenAddresses_[name] = l->address();
    entry += "\n" + name + " " + t->domainDescriptor() + " " + l->address();
    if (address_.empty() || t->crossesHosts()) {
      address_ = l->address();
    }
  }
  TORCH_CHECK(
      !transports_.empty(),
      "torch_rpc_ext: none of the transports ",
      c10::Join(",", options_.transports),
      " is usable on this host:",
      unavailable);
  // Then one line per channel we can use: "channel <name> <domain>". As for
  // transports, one that is not viable here is left out with a warning: the
  // next one (at last the stream) carries its segments.
  // The device channels join the CPU ones for an agent with devices (a
  // program without device maps loads no CUDA library).
  std::vector<std::string> channelNames = options_.channels;
  const bool lanesOnlyEncrypted = options_.lanesWhenEncrypted &&
      std::find(channelNames.begin(), channelNames.end(), "tcp_lanes") ==
          channelNames.end();
  if (lanesOnlyEncrypted) {
    channelNames.push_back("tcp_lanes");
  }
  if (!options_.devices.empty()) {
    for (const auto& name : options_.deviceChannels) {
      channelNames.push_back(name);
    }
  }
  for (const auto& name : channelNames) {
    if (std::any_of(channels_.begin(), channels_.end(), [&](const auto& c) {
          return c->name() == name;
        })) {
      continue; // listed twice (the Python options refuse that already)
    }
    auto c = channel::createChannel(name);
    if (lanesOnlyEncrypted && name == "tcp_lanes") {
      c->setEncryptedOnly(true);
    }
    c->exemptFromHoldOff(topts.holdOffExempt);
    if (!c->isViable()) {
      if (!(lanesOnlyEncrypted && name == "tcp_lanes")) {
        unavailable += " " + name + ": " + c->unviableReason();
      }
      continue;
    }
    channels_.push_back(c);
    entry += std::string("\n") + kChannelLine + " " + name + " " +
        c->domainDescriptor();
  }
  if (!unavailable.empty()) {
    logWarning("torch_rpc_ext: " + self.name_ + " runs without" + unavailable);
  }
  return entry;
}

std::vector<OfferLine> offerLines(const std::string& offers) {
  std::vector<OfferLine> out;
  std::istringstream lines(offers);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    OfferLine l;
    fields >> l.name >> l.domain >> l.address;
    out.push_back(std::move(l));
  }
  return out;
}

Route Connections::routeFor(
    const std::string& peerName,
    const std::string& offers) const {
  // The peer's transports whose domain matches ours (shm: the same host),
  // and the channels it offers.
  std::map<std::string, std::string> reachable;
  std::map<std::string, std::string> channels;
  for (const auto& [name, domain, address] : offerLines(offers)) {
    if (name == kChannelLine) {
      channels[domain] = address; // "channel <name> <domain>"
      continue;
    }
    auto it = transports_.find(name);
    if (it != transports_.end() && !address.empty() &&
        domain == it->second->domainDescriptor()) {
      reachable[name] = address;
    }
  }
  for (const auto& name : options_.transports) {
    auto it = reachable.find(name);
    if (it != reachable.end()) {
      Route route{name, it->second, std::move(channels)};
      if (worldSize_ == 0) {
        route.reverseDeviceMap =
            reverseMapOf(parseDeviceOffer(offers), self_.name_);
      } else if (
          auto m = options_.reverseDeviceMaps.find(peerName);
          m != options_.reverseDeviceMaps.end()) {
        route.reverseDeviceMap = m->second;
      }
      return route;
    }
  }
  TORCH_CHECK(
      false,
      "torch_rpc_ext: no transport in common with worker ",
      peerName,
      ": it offers [",
      offers,
      "] and this worker uses ",
      c10::Join(",", options_.transports),
      " (a transport is shared only within its domain, e.g. one host)");
}

std::vector<channel::Offer> Connections::channelsFor(
    int32_t peerId,
    bool hostPassesDescriptors) const {
  std::vector<channel::Offer> out;
  // Held while the transport sets up the connection: a peer that departs
  // meanwhile cannot be freed (peers never are; see membership.h).
  Peer* peer = group_.peerById(peerId);
  if (!peer) {
    return out;
  }
  const auto& offered = peer->route.channels;
  for (const auto& c : channels_) {
    // Only a transport that can host it: descriptors need a Unix socket,
    // lanes a network one.
    if ((c->needsDescriptorPassing() && !hostPassesDescriptors) ||
        (c->needsNetworkHost() && hostPassesDescriptors)) {
      continue;
    }
    auto it = offered.find(c->name());
    if (it != offered.end() && c->reaches(it->second)) {
      out.push_back(channel::Offer{c, it->second});
    }
  }
  return out;
}

void Connections::start() {
  for (auto& l : listeners_) {
    l->start(this);
  }
}

void Connections::settleChannels(std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  for (auto& [name, t] : transports_) {
    t->settleChannels();
  }
  auto settled = [&] {
    return std::all_of(transports_.begin(), transports_.end(), [](auto& t) {
      return t.second->channelsSettled();
    });
  };
  while (!settled() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Connections::stop() {
  for (auto& [name, t] : transports_) {
    t->stop();
  }
}

void Connections::dropAll() {
  std::lock_guard<std::mutex> lock(connMutex_);
  outbound_.clear();
}

Peer* Connections::memberOn(const transport::Connection& conn) const {
  // A dead holder's connections are closed as it is declared dead; one that
  // left closes its own once its last responses are out.
  return group_.memberOn(conn.peerId(), conn.peerIncarnation());
}

std::shared_ptr<transport::Connection> Connections::connectionTo(
    const Peer& peer) {
  std::lock_guard<std::mutex> lock(connMutex_);
  // A departing peer's connection is closed under this lock after it is
  // marked departed (dropPeer()), so none is opened to it afterwards.
  TORCH_CHECK(
      !peer.departed(),
      "RPC to ",
      peer.info.name_,
      " failed: ",
      peer.departure());
  TORCH_CHECK(
      peer.route.unreachable.empty(),
      "RPC to ",
      peer.info.name_,
      " failed: ",
      peer.route.unreachable);
  auto& slot = outbound_[&peer];
  if (!slot || slot->isClosed()) {
    // (Statistics are the name's: a reconnect is one to this holder.)
    peer.stats.dials.fetch_add(1, std::memory_order_relaxed);
    if (peer.dialed.exchange(true, std::memory_order_relaxed)) {
      peer.stats.reconnects.fetch_add(1, std::memory_order_relaxed);
    }
    const Route& route = peer.route;
    slot = transports_.at(route.transport)
               ->connect(route.address, peer.info.id_, this);
  }
  return slot;
}

void Connections::onReady(const std::shared_ptr<transport::Connection>& conn) {
  if (conn->isOutbound()) {
    std::lock_guard<std::mutex> lock(connMutex_);
    readyOutbound_.insert(conn.get());
    return;
  }
  // Ids the handshake admitted (it knew the secret) but no member holds:
  // a departed worker's process, or one whose join we have not applied.
  if (Peer* p = memberOn(*conn); !p || p->departed()) {
    conn->close(
        "worker id " + std::to_string(conn->peerId()) +
        " is not a member of the group at epoch " +
        std::to_string(group_.view()->epoch));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(connMutex_);
    // Departures sweep inbound_ under this lock after marking the peer: one
    // that departed meanwhile is refused below (outside the lock: closing on
    // the loop thread reports onClosed, which takes it), not left open.
    if (Peer* p = memberOn(*conn); p && !p->departed()) {
      inbound_.emplace(conn->peerId(), conn);
      p->stats.accepted.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  conn->close("worker id " + std::to_string(conn->peerId()) + " departed");
}

void Connections::onClosed(
    transport::Connection& conn,
    const std::string& reason) {
  const Peer* dialed = nullptr; // the callee of an outbound connection
  bool wasReady = false;
  {
    std::lock_guard<std::mutex> lock(connMutex_);
    for (auto it = outbound_.begin(); it != outbound_.end(); ++it) {
      if (it->second.get() == &conn) {
        dialed = it->first;
        outbound_.erase(it);
        break;
      }
    }
    wasReady = readyOutbound_.erase(&conn) > 0;
    auto range = inbound_.equal_range(conn.peerId());
    for (auto it = range.first; it != range.second;) {
      auto held = it->second.lock();
      wasReady |= held.get() == &conn;
      it = !held || held.get() == &conn ? inbound_.erase(it) : std::next(it);
    }
  }
  // Connection events (an empty reason: closed by us, at shutdown).
  if (!reason.empty()) {
    const Peer* peer = dialed ? dialed : memberOn(conn);
    if (peer && wasReady) {
      peer->stats.connectionsLost.fetch_add(1, std::memory_order_relaxed);
    } else if (dialed) {
      dialed->stats.dialFailures.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (conn.rejectedPeer()) {
    if (Peer* p = memberOn(conn)) {
      p->stats.rejectedFrames.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (conn.knockOnly()) {
    knocks_.fetch_add(1, std::memory_order_relaxed);
  } else if (!conn.isOutbound() && conn.peerId() < 0 && !reason.empty()) {
    rejectedConnections_.fetch_add(1, std::memory_order_relaxed);
    // Rate-limited: whoever can reach the port decides how often.
    logWarningLimited(
        "refused_connection",
        "torch_rpc_ext: " + self_.name_ + " refused connection " +
            conn.describe() + ": " + reason);
  }
  sink_.onConnectionClosed(conn, reason);
}

frame::InboundBuffers Connections::onFrameHead(
    transport::Connection& conn,
    const std::string& head,
    const std::vector<uint64_t>& segmentSizes,
    const std::vector<bool>& provided) {
  return sink_.onFrameHead(conn, head, segmentSizes, provided);
}

void Connections::onFrame(
    const std::shared_ptr<transport::Connection>& conn,
    std::string head,
    frame::InboundBuffers buffers) {
  sink_.onFrame(conn, std::move(head), std::move(buffers));
}

// ---- For the group ----------------------------------------------------------

void Connections::dropPeer(const Peer& peer, bool closeNow) {
  // The peer is marked departed already: under connMutex_, no connection to
  // it is opened afterwards (connectionTo), and calls on the closed ones
  // fail naming why (onClosed).
  const auto id = static_cast<int32_t>(peer.info.id_);
  std::vector<std::shared_ptr<transport::Connection>> closing;
  {
    std::lock_guard<std::mutex> lock(connMutex_);
    auto out = outbound_.find(&peer);
    if (out != outbound_.end()) {
      closing.push_back(out->second);
      outbound_.erase(out);
    }
    auto range = inbound_.equal_range(id);
    for (auto it = range.first; it != range.second; ++it) {
      if (auto conn = it->second.lock()) {
        closing.push_back(std::move(conn));
      }
    }
    inbound_.erase(id);
  }
  if (closeNow) {
    const std::string why = peer.departure();
    for (auto& conn : closing) {
      conn->close(why);
    }
  }
}

void Connections::closeOutbound(const std::string& reason) {
  std::lock_guard<std::mutex> lock(connMutex_);
  for (auto& [p, conn] : outbound_) {
    conn->close(reason);
  }
}

// ---- What it reports --------------------------------------------------------

void Connections::addMetrics(
    std::unordered_map<std::string, std::string>& m) const {
  m["rpc_ext.rejected_connections"] =
      std::to_string(rejectedConnections_.load());
  m["rpc_ext.knocks"] = std::to_string(knocks_.load());
  for (const auto& [name, t] : transports_) {
    for (const auto& [counter, value] : t->counters()) {
      m["rpc_ext." + name + "." + counter] = std::to_string(value);
    }
  }
  for (const auto& c : channels_) {
    for (const auto& [counter, value] : c->counters()) {
      m["rpc_ext.channel." + c->name() + "." + counter] = std::to_string(value);
    }
  }
}

std::string Connections::securityOf(const Peer& peer) const {
  if (peer.info.id_ == self_.id_) {
    return "none (self: no connection)";
  }
  std::shared_ptr<transport::Connection> conn;
  {
    std::lock_guard<std::mutex> lock(connMutex_);
    auto out = outbound_.find(&peer);
    if (out != outbound_.end() && out->second->isReady()) {
      conn = out->second;
    } else {
      auto range = inbound_.equal_range(peer.info.id_);
      for (auto it = range.first; it != range.second && !conn; ++it) {
        auto in = it->second.lock();
        if (in && in->isReady()) {
          conn = in;
        }
      }
    }
  }
  if (!conn) {
    return "not connected";
  }
  std::string s = conn->security();
  if (!s.empty()) {
    return s;
  }
  auto t = transports_.find(peer.route.transport);
  if (t != transports_.end() && !t->second->crossesHosts()) {
    return "none (" + peer.route.transport + ": one host)";
  }
  return options_.encryption == "off" ? "none (encryption off)"
                                      : "none (loopback)";
}

void Connections::addDebugInfo(
    std::unordered_map<std::string, std::string>& m) const {
  m["rpc_ext.address"] = address_;
  m["rpc_ext.encryption"] =
      options_.encryption + (options_.tlsCert.empty() ? "" : " (mutual TLS)");
  for (const auto& [name, address] : listenAddresses_) {
    m["rpc_ext.listen." + name] = address;
  }
  std::string ours;
  for (const auto& c : channels_) {
    ours += c->name() + ",";
  }
  m["rpc_ext.channels"] = ours + channel::kStreamChannelName;
  // Descriptors peers handed us, closed off the loops (process-wide; a
  // pending one that stays is a close a peer's file holds up).
  FdCloserStats closes = fdCloserStats();
  m["rpc_ext.peer_fds.closed"] = std::to_string(closes.closed);
  m["rpc_ext.peer_fds.pending"] = std::to_string(closes.pending);
  m["rpc_ext.peer_fds.via_children"] = std::to_string(closes.viaChildren);
  auto v = group_.view(); // held: a range-for does not keep a temporary alive
  for (const auto& peer : v->byId) {
    if (!peer) {
      continue;
    }
    std::string p = "rpc_ext.peer." + peer->info.name_ + ".";
    m[p + "transport"] = peer->route.transport;
    // What our connection to it uses, in order; the stream comes last.
    std::string used;
    auto t = transports_.find(peer->route.transport);
    if (t != transports_.end()) {
      for (const auto& c :
           channelsFor(peer->info.id_, t->second->passesDescriptors())) {
        used += c.context->name() + ",";
      }
    }
    m[p + "channels"] = used + channel::kStreamChannelName;
    m[p + "security"] = securityOf(*peer);
  }
}

} // namespace torch_rpc_ext
