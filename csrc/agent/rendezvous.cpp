// SPDX-License-Identifier: BSD-3-Clause
// The agent's group coordination through the c10d store handed to init_rpc:
// start-up (the group secret, our listeners, every worker's name and route)
// and join (the barrier of graceful shutdown).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <sstream>
#include <thread>

#include <c10/util/StringUtil.h>

#include "csrc/agent/agent.h"
#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/store_bytes.h"
#include "csrc/channel/registry.h"
#include "csrc/common/crypto.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext {

namespace {

constexpr const char* kSecretKey = "torch_rpc_ext/secret";
constexpr const char* kWorkerKeyPrefix = "torch_rpc_ext/worker/";
constexpr const char* kJoinKeyPrefix = "torch_rpc_ext/join/";
// How often join looks at who is missing (and probes them), at most.
constexpr auto kJoinSlice = std::chrono::milliseconds(200);
// How long rank 0 waits, after the last barrier, for the others to say they
// are done with the store.
constexpr auto kLeaveWait = std::chrono::seconds(10);
constexpr size_t kSecretBytes = 32;
// Rendezvous lines that offer a channel start with this word.
constexpr const char* kChannelLine = "channel";

} // namespace

void Agent::rendezvous() {
  const auto& self = getWorkerInfo();
  if (!options_.secret.empty()) {
    secret_ = options_.secret;
  } else if (worldSize_ == 0) {
    // A dynamic group: whoever comes first creates it (no rank is special).
    secret_ = fromBytes(
        store_->compareSet(kSecretKey, {}, toBytes(randomBytes(kSecretBytes))));
  } else if (self.id_ == 0) {
    secret_ = randomBytes(kSecretBytes);
    store_->set(kSecretKey, toBytes(secret_));
  } else {
    secret_ = fromBytes(store_->get(kSecretKey));
  }
  if (worldSize_ == 0) {
    incarnation_ = drawIncarnation(); // proven in every handshake
  }
  std::string entry = openTransports();
  if (worldSize_ == 0) {
    joinGroup(entry);
    return;
  }

  store_->set(kWorkerKeyPrefix + std::to_string(self.id_), toBytes(entry));
  auto view = std::make_shared<View>();
  view->byId.resize(worldSize_);
  for (int r = 0; r < worldSize_; ++r) {
    std::string entry =
        fromBytes(store_->get(kWorkerKeyPrefix + std::to_string(r)));
    auto nl = entry.find('\n');
    TORCH_CHECK(nl != std::string::npos, "malformed rendezvous entry ", r);
    std::string name = entry.substr(0, nl);
    auto it = view->byName.find(name);
    TORCH_CHECK(
        it == view->byName.end(),
        "RPC worker name ",
        name,
        " is not unique: ranks ",
        it == view->byName.end() ? 0 : it->second->info.id_,
        " and ",
        r,
        " both use it");
    view->byId[r] = adopt(
        rpc::WorkerInfo(name, static_cast<int64_t>(r)),
        /*incarnation=*/0,
        chooseRoute(name, entry.substr(nl + 1)));
    view->byName[name] = view->byId[r];
  }
  publish(std::move(view));
}

std::string Agent::openTransports() {
  const auto& self = getWorkerInfo();
  transport::TransportOptions topts;
  topts.selfId = self.id_;
  // A dynamic group admits any rank at the handshake; onReady then refuses
  // ids that no member holds.
  topts.peerIdLimit = worldSize_ > 0 ? worldSize_ : 32768;
  topts.selfIncarnation = incarnation_;
  if (worldSize_ == 0) {
    // Both ends: only the current holder of an id is admitted.
    topts.admit = [this](int32_t id, uint64_t incarnation) {
      return admissionError(id, incarnation);
    };
  }
  topts.secret = secret_;
  topts.limits.maxFrameBytes = options_.maxFrameBytes;
  topts.handshakeTimeout = options_.handshakeTimeout;
  topts.heartbeatTimeout = options_.heartbeatTimeout;
  topts.busyPoll = options_.busyPoll;
  // Sent messages may hold the last reference to tensors with Python
  // objects; let the pool, not the loop thread, drop them.
  topts.releaseOffLoop = [this](std::shared_ptr<void> held) {
    pool_.run([held = std::move(held)]() mutable { held.reset(); });
  };
  topts.bindAddress = options_.address;
  topts.channelsFor = [this](int32_t peerId, bool passesDescriptors) {
    return channelsFor(peerId, passesDescriptors);
  };
  TORCH_CHECK(
      !options_.transports.empty(), "RpcExtBackendOptions.transports is empty");
  // Our entry: the name, then one line per transport we listen on:
  // "<transport> <domain descriptor> <address>". A transport that is not
  // viable here is left out (with a warning); one that is viable but cannot
  // listen is an error (a wrong `address`, say).
  std::string entry = self.name_;
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
  if (!options_.devices.empty()) {
    for (const auto& name : options_.deviceChannels) {
      channelNames.push_back(name);
    }
    useTorchForChannelMemory();
  }
  for (const auto& name : channelNames) {
    if (std::any_of(channels_.begin(), channels_.end(), [&](const auto& c) {
          return c->name() == name;
        })) {
      continue; // listed twice (the Python options refuse that already)
    }
    auto c = channel::createChannel(name);
    if (!c->isViable()) {
      unavailable += " " + name + ": " + c->unviableReason();
      continue;
    }
    channels_.push_back(c);
    entry += std::string("\n") + kChannelLine + " " + name + " " +
        c->domainDescriptor();
  }
  if (!unavailable.empty()) {
    logWarning("torch_rpc_ext: " + self.name_ + " runs without" + unavailable);
  }
  if (worldSize_ == 0) {
    // A dynamic group's members learn our devices and maps from our join
    // record (static groups exchanged them before the agent existed).
    entry += deviceOfferLines(options_.devices, options_.deviceMaps);
  }
  return entry;
}

Route Agent::chooseRoute(const std::string& peerName, const std::string& offers)
    const {
  // The peer's transports whose domain matches ours (shm: the same host),
  // and the channels it offers.
  std::map<std::string, std::string> reachable;
  std::map<std::string, std::string> channels;
  std::istringstream lines(offers);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string name, domain, address;
    fields >> name >> domain >> address;
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
            reverseMapOf(parseDeviceOffer(offers), workerInfo_.name_);
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

std::vector<channel::Offer> Agent::channelsFor(
    int32_t peerId,
    bool hostPassesDescriptors) const {
  std::vector<channel::Offer> out;
  // Held while the transport sets up the connection: a peer that departs
  // meanwhile cannot be freed (peers never are; see membership.h).
  Peer* peer = peerById(peerId);
  if (!peer) {
    return out;
  }
  const auto& offered = peer->route.channels;
  for (const auto& c : channels_) {
    if (c->needsDescriptorPassing() && !hostPassesDescriptors) {
      continue;
    }
    auto it = offered.find(c->name());
    if (it != offered.end() && c->reaches(it->second)) {
      out.push_back(channel::Offer{c, it->second});
    }
  }
  return out;
}

void Agent::join(bool shutdown, float timeout) {
  // Exiting with the agent alive: its threads are parked, nothing would
  // ever complete (common/exit_gate.h).
  TORCH_CHECK(
      !ExitGate::closed(),
      "RPC join on ",
      workerInfo_.name_,
      ": the process is exiting; call rpc.shutdown() before the end of the "
      "program");
  std::optional<std::chrono::steady_clock::time_point> deadline;
  if (timeout > 0) {
    deadline = std::chrono::steady_clock::now() +
        std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  }
  auto drain = [&] {
    std::unique_lock<std::mutex> lock(callCountMutex_);
    auto idle = [this] { return clientActiveCalls_ == 0; };
    if (!deadline) {
      callCountCv_.wait(lock, idle);
    } else {
      TORCH_CHECK(
          callCountCv_.wait_until(lock, *deadline, idle),
          "RPC join timed out after ",
          timeout,
          " s: ",
          clientActiveCalls_,
          " calls of ",
          workerInfo_.name_,
          " are still waiting for responses");
    }
  };
  if (worldSize_ == 0) {
    // A dynamic group has no barrier: a member leaves alone, once its own
    // calls are answered (elastic.cpp).
    drain();
    if (shutdown) {
      leaveGroup(deadline);
      shuttingDown_ = true;
    }
    return;
  }
  while (true) {
    drain();
    // Everyone arrives with no calls of their own in flight...
    joinRound(0, deadline, timeout);
    // ...then counts what started meanwhile (nested or follow-up calls). The
    // lock keeps our count from going stale while it is summed; another round
    // runs if anybody still has calls.
    std::unique_lock<std::mutex> lock(callCountMutex_);
    if (joinRound(clientActiveCalls_, deadline, timeout) == 0) {
      if (shutdown) {
        shuttingDown_ = true;
        leaveRound(deadline, timeout);
      }
      return;
    }
  }
}

void Agent::leaveRound(
    std::optional<std::chrono::steady_clock::time_point> deadline,
    float timeout) {
  // After the last barrier of a graceful shutdown a worker may exit at
  // once, and the store's host (rank 0 under torch's rendezvous) takes the
  // store with it while another worker may still be reading that barrier's
  // keys: "Connection reset by peer" in a join that had in fact succeeded.
  // So every other worker's last store call is one set() of a "left" key,
  // and rank 0 returns only once all of them have landed (or after a
  // bounded wait, if a worker died in between: shutdown must finish).
  const std::string left =
      kJoinKeyPrefix + std::to_string(joinRounds_) + "/left/";
  joinRound(0, deadline, timeout);
  if (workerInfo_.id_ != 0) {
    // Tests only: a worker slow to leave (tests/rpc/test_rendezvous.py).
    if (const char* delay = std::getenv("TORCH_RPC_EXT_TEST_LEAVE_DELAY_MS")) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
    }
    try {
      store_->set(left + std::to_string(workerInfo_.id_), toBytes("1"));
    } catch (const std::exception& e) {
      logWarning(
          "torch_rpc_ext: " + workerInfo_.name_ +
          " could not report leaving to the store: " + e.what());
    }
    return;
  }
  std::vector<std::string> keys;
  for (int r = 1; r < worldSize_; ++r) {
    keys.push_back(left + std::to_string(r));
  }
  auto until = std::chrono::steady_clock::now() + kLeaveWait;
  if (deadline && *deadline < until) {
    until = *deadline;
  }
  auto pause = std::chrono::milliseconds(1);
  while (!keys.empty() && !store_->check(keys)) {
    if (std::chrono::steady_clock::now() >= until) {
      logWarning(
          "torch_rpc_ext: " + workerInfo_.name_ +
          " leaves before every worker reported leaving");
      return;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kJoinSlice);
  }
}

int64_t Agent::joinRound(
    int64_t value,
    std::optional<std::chrono::steady_clock::time_point> deadline,
    float timeout) {
  // Every worker runs the same sequence of rounds, so the round number
  // names the same barrier everywhere.
  std::string prefix = kJoinKeyPrefix + std::to_string(joinRounds_++) + "/";
  store_->set(
      prefix + std::to_string(workerInfo_.id_), toBytes(std::to_string(value)));
  std::vector<std::string> keys;
  for (int r = 0; r < worldSize_; ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  // Poll rather than block in store->wait(): stores differ in what a wait
  // timeout throws. The poll interval grows to kJoinSlice, so a barrier that
  // everyone reaches together costs a millisecond or two.
  auto pause = std::chrono::milliseconds(1);
  auto nextProbe = std::chrono::steady_clock::now() + kJoinSlice;
  while (!store_->check(keys)) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kJoinSlice);
    if (std::chrono::steady_clock::now() < nextProbe) {
      continue;
    }
    nextProbe = std::chrono::steady_clock::now() + kJoinSlice;
    // Who is missing, and can we still reach them? A dead peer would make
    // us wait forever: its connection fails (refused, reset, or no
    // handshake within handshake_timeout) and we say so. Connections opened
    // by this probe get a moment to succeed or fail.
    std::vector<Peer*> missingPeers;
    std::vector<std::shared_ptr<transport::Connection>> conns;
    auto v = view();
    for (int r = 0; r < worldSize_; ++r) {
      if (!store_->check({keys[r]})) {
        missingPeers.push_back(v->find(r));
        conns.push_back(connectionTo(*missingPeers.back()));
      }
    }
    auto settleBy = std::chrono::steady_clock::now() + kJoinSlice / 4;
    while (std::chrono::steady_clock::now() < settleBy &&
           std::any_of(conns.begin(), conns.end(), [](const auto& c) {
             return !c->isReady() && !c->isClosed();
           })) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::vector<std::string> missing, unreachable;
    for (size_t i = 0; i < missingPeers.size(); ++i) {
      const std::string& name = missingPeers[i]->info.name_;
      missing.push_back(name);
      if (conns[i]->isClosed() && !conns[i]->closeReason().empty()) {
        unreachable.push_back(name + " (" + conns[i]->closeReason() + ")");
      }
    }
    TORCH_CHECK(
        unreachable.empty(),
        "RPC join on ",
        workerInfo_.name_,
        ": unreachable: ",
        c10::Join(", ", unreachable),
        "; a graceful shutdown cannot complete, use "
        "rpc.shutdown(graceful=False)");
    TORCH_CHECK(
        !deadline || std::chrono::steady_clock::now() < *deadline,
        "RPC join on ",
        workerInfo_.name_,
        " timed out after ",
        timeout,
        " s waiting for ",
        c10::Join(", ", missing));
  }
  int64_t sum = 0;
  for (const auto& key : keys) {
    sum += std::stoll(fromBytes(store_->get(key)));
  }
  return sum;
}

} // namespace torch_rpc_ext
