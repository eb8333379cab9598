// SPDX-License-Identifier: BSD-3-Clause
// Connections' probes of peers for the group (GroupListener): a lapsed
// lease's, the join barrier's and the shutdown watch's; and of our own
// transports' loops, for the health endpoints (connections.h).
#include "csrc/agent/connections.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "csrc/common/crypto.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext {

GroupListener::Probe Connections::probe(const Peer& peer) {
  std::shared_ptr<transport::Connection> conn;
  try {
    conn = connectionTo(peer);
  } catch (const std::exception&) {
    return GroupListener::Probe::kUnreachable;
  }
  if (conn->isReady() && !conn->isClosed()) {
    return GroupListener::Probe::kReady;
  }
  return conn->isClosed() ? GroupListener::Probe::kUnreachable
                          : GroupListener::Probe::kConnecting;
}

std::vector<std::string> Connections::whyUnreachable(
    const std::vector<const Peer*>& peers,
    std::chrono::milliseconds within,
    bool dial) {
  // Connections opened by this probe get a moment to succeed or fail.
  // A peer no connection can be made to (departed, no route, the transport
  // stopped) is unreachable for that reason. Without `dial`, a peer we have
  // never dialled is knocked on first (a connect and a close: no handshake,
  // no channels), all of a transport's at once, within `within` (at least
  // kKnockAtLeast, so that a refusal the kernel reports a moment after the
  // connect is still seen): accepted, it is there; refused, gone; only a
  // knock that says neither (no answer yet) is followed by a dial.
  constexpr std::chrono::milliseconds kKnockAtLeast{10};
  auto settleBy = std::chrono::steady_clock::now() + within;
  std::vector<std::shared_ptr<transport::Connection>> conns(peers.size());
  std::vector<std::string> why(peers.size());
  std::vector<bool> known(peers.size(), false);
  if (!dial) {
    // Knocks, all at once per transport: peer indices and addresses.
    std::map<
        std::string,
        std::pair<std::vector<size_t>, std::vector<std::string>>>
        knocks;
    for (size_t i = 0; i < peers.size(); ++i) {
      const Peer& peer = *peers[i];
      {
        std::lock_guard<std::mutex> lock(connMutex_);
        if (outbound_.count(&peer) != 0) {
          continue; // dialled before: its connection says
        }
      }
      if (!peer.departed() && peer.route.unreachable.empty() &&
          transports_.count(peer.route.transport) != 0) {
        auto& [at, addresses] = knocks[peer.route.transport];
        at.push_back(i);
        addresses.push_back(peer.route.address);
      }
    }
    for (auto& [name, batch] : knocks) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          settleBy - std::chrono::steady_clock::now());
      auto found = transports_.at(name)->knock(
          batch.second, std::max(left, kKnockAtLeast));
      for (size_t k = 0; k < found.size(); ++k) {
        if (found[k].outcome != transport::Transport::Knock::kUnknown) {
          why[batch.first[k]] = std::move(found[k].why);
          known[batch.first[k]] = true;
        }
      }
    }
  }
  for (size_t i = 0; i < peers.size(); ++i) {
    if (known[i]) {
      continue;
    }
    try {
      conns[i] = connectionTo(*peers[i]);
    } catch (const c10::Error& e) {
      why[i] = e.what_without_backtrace();
    } catch (const std::exception& e) {
      why[i] = e.what();
    }
  }
  while (std::chrono::steady_clock::now() < settleBy &&
         std::any_of(conns.begin(), conns.end(), [](const auto& c) {
           return c && !c->isReady() && !c->isClosed();
         })) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (size_t i = 0; i < conns.size(); ++i) {
    if (conns[i] && conns[i]->isClosed()) {
      why[i] = conns[i]->closeReason();
    }
  }
  return why;
}

bool Connections::listenerAnswers(
    const std::string& name,
    const std::string& offers,
    std::chrono::milliseconds within) {
  if (transports_.empty()) {
    return knockBeforeOpen(offers, within);
  }
  try {
    Route route = routeFor(name, offers);
    auto it = transports_.find(route.transport);
    return it != transports_.end() &&
        it->second->listenerAnswers(
            route.address,
            std::min<std::chrono::milliseconds>(
                within, std::chrono::seconds(1)));
  } catch (const std::exception&) {
    return false; // no transport of ours reaches it
  }
}

bool Connections::knockBeforeOpen(
    const std::string& offers,
    std::chrono::milliseconds within) const {
  // Before open(): a dynamic group's joiner, in the secret exchange, asks
  // whether members whose lease lapsed still answer, and holds no secret
  // yet to open our transports with. A transport made for this knock alone
  // (never listening, no TLS, a secret nobody shares: it proves nothing to
  // anyone) routes and knocks as ours will, then goes.
  transport::TransportOptions topts;
  topts.selfId = self_.id_;
  topts.secret = randomBytes(32);
  topts.tls.mode = transport::parseTlsMode("off");
  topts.bindAddress = options_.address;
  const auto lines = offerLines(offers);
  for (const auto& ours : options_.transports) {
    for (const auto& [name, domain, address] : lines) {
      if (name != ours || address.empty()) {
        continue;
      }
      try {
        auto t = transport::createTransport(name, topts);
        if (!t->isViable() || domain != t->domainDescriptor()) {
          break; // not ours to reach: the next transport of our order
        }
        const bool answers = t->listenerAnswers(
            address,
            std::min<std::chrono::milliseconds>(
                within, std::chrono::seconds(1)));
        t->stop();
        return answers;
      } catch (const std::exception&) {
        // Our side failed (descriptors, threads): we cannot tell, and a
        // member counts as alive within its grace rather than gone.
        return true;
      }
    }
  }
  return false; // no transport of ours reaches it
}

namespace {

// A task posted to one loop; `ran` is when the loop ran it.
struct LoopProbe {
  std::mutex mu;
  std::condition_variable cv;
  std::chrono::steady_clock::time_point posted;
  std::optional<std::chrono::steady_clock::time_point> ran;
};

} // namespace

std::vector<std::pair<std::string, int64_t>> Connections::probeLoops(
    std::chrono::milliseconds within) const {
  const auto start = std::chrono::steady_clock::now();
  struct Posted {
    std::string name;
    transport::Transport* transport;
    std::shared_ptr<LoopProbe> probe;
  };
  std::vector<Posted> posted;
  for (const auto& [name, transport] : transports_) {
    auto probe = std::make_shared<LoopProbe>();
    probe->posted = std::chrono::steady_clock::now();
    const bool queued = transport->postToLoop([probe] {
      std::lock_guard<std::mutex> lock(probe->mu);
      probe->ran = std::chrono::steady_clock::now();
      probe->cv.notify_all();
    });
    if (queued) {
      posted.push_back({name, transport.get(), std::move(probe)});
    }
  }
  // One deadline for all: a loop that blocks costs the probe `within` once.
  const auto deadline = start + within;
  std::vector<std::pair<std::string, int64_t>> out;
  for (auto& p : posted) {
    std::unique_lock<std::mutex> lock(p.probe->mu);
    p.probe->cv.wait_until(
        lock, deadline, [&] { return p.probe->ran.has_value(); });
    const auto ran = p.probe->ran;
    lock.unlock();
    if (ran) {
      out.emplace_back(
          p.name,
          std::chrono::duration_cast<std::chrono::microseconds>(
              *ran - p.probe->posted)
              .count());
    } else if (p.transport->postToLoop([] {})) {
      out.emplace_back(p.name, -1);
    } // (else it stopped meanwhile, its task dropped: shutdown, not a block)
  }
  return out;
}

bool Connections::stallLoopForTesting(
    const std::string& transport,
    std::chrono::milliseconds duration) const {
  auto it = transports_.find(transport);
  return it != transports_.end() && it->second->postToLoop([duration] {
    std::this_thread::sleep_for(duration);
  });
}

} // namespace torch_rpc_ext
