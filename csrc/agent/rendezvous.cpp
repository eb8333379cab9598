// SPDX-License-Identifier: BSD-3-Clause
// Agent start-up: the group secret, our listeners, and every worker's name
// and route, exchanged through the c10d store handed to init_rpc.
#include <map>
#include <sstream>

#include <c10/util/StringUtil.h>

#include "csrc/agent/agent.h"
#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"
#include "csrc/transport/registry.h"
#include "csrc/transport/tcp/address.h"

namespace torch_rpc_ext {

namespace {

constexpr const char* kSecretKey = "torch_rpc_ext/secret";
constexpr const char* kWorkerKeyPrefix = "torch_rpc_ext/worker/";
constexpr size_t kSecretBytes = 32;

std::string fromBytes(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

std::vector<uint8_t> toBytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

} // namespace

void Agent::rendezvous() {
  const auto& self = getWorkerInfo();
  if (!options_.secret.empty()) {
    secret_ = options_.secret;
  } else if (self.id_ == 0) {
    secret_ = randomBytes(kSecretBytes);
    store_->set(kSecretKey, toBytes(secret_));
  } else {
    secret_ = fromBytes(store_->get(kSecretKey));
  }

  transport::TransportOptions topts;
  topts.selfId = self.id_;
  topts.secret = secret_;
  topts.limits.maxFrameBytes = options_.maxFrameBytes;
  topts.handshakeTimeout = options_.handshakeTimeout;
  topts.heartbeatTimeout = options_.heartbeatTimeout;
  // Sent messages may hold the last reference to tensors with Python
  // objects; let the pool, not the loop thread, drop them.
  topts.releaseOffLoop = [this](std::shared_ptr<void> held) {
    pool_.run([held = std::move(held)]() mutable { held.reset(); });
  };
  topts.bindAddress = options_.address.empty()
      ? transport::tcp::defaultAdvertisedAddress()
      : options_.address;
  TORCH_CHECK(
      !options_.transports.empty(), "RpcExtBackendOptions.transports is empty");
  // Our entry: the name, then one line per transport we listen on:
  // "tcp <host:port>" or "shm <same-host key> <@abstract name>".
  const std::string hostKey = transport::tcp::sameHostKey();
  std::string entry = self.name_;
  std::string unavailable;
  for (const auto& name : options_.transports) {
    if (name == "shm" && hostKey.empty()) {
      unavailable += " shm: cannot identify this host";
      continue;
    }
    try {
      auto t = transport::createTransport(name, topts);
      auto l = t->listen();
      transports_[name] = t;
      listeners_.push_back(l);
      listenAddresses_[name] = l->address();
      entry += "\n" + name + " " + (name == "shm" ? hostKey + " " : "") +
          l->address();
      if (address_.empty() || name == "tcp") {
        address_ = l->address();
      }
    } catch (const std::exception& e) {
      // Shared memory may be unavailable (seccomp, no memfd); TCP may not.
      if (name != "shm") {
        throw;
      }
      unavailable += std::string(" shm: ") + e.what();
    }
  }
  TORCH_CHECK(
      !transports_.empty(),
      "torch_rpc_ext: none of the transports ",
      c10::Join(",", options_.transports),
      " is usable on this host:",
      unavailable);
  if (!unavailable.empty()) {
    logWarning("torch_rpc_ext: " + self.name_ + " runs without" + unavailable);
  }

  store_->set(
      kWorkerKeyPrefix + std::to_string(self.id_), toBytes(entry));
  workers_.reserve(worldSize_);
  routes_.resize(worldSize_);
  for (int r = 0; r < worldSize_; ++r) {
    std::string entry =
        fromBytes(store_->get(kWorkerKeyPrefix + std::to_string(r)));
    auto nl = entry.find('\n');
    TORCH_CHECK(nl != std::string::npos, "malformed rendezvous entry ", r);
    std::string name = entry.substr(0, nl);
    auto [it, fresh] = idByName_.emplace(name, static_cast<rpc::worker_id_t>(r));
    TORCH_CHECK(
        fresh,
        "RPC worker name ",
        name,
        " is not unique: ranks ",
        it->second,
        " and ",
        r,
        " both use it");
    workers_.emplace_back(name, static_cast<int64_t>(r));
    routes_[r] = chooseRoute(name, entry.substr(nl + 1), hostKey);
  }
}

Agent::Route Agent::chooseRoute(
    const std::string& peerName,
    const std::string& offers,
    const std::string& hostKey) const {
  std::map<std::string, std::string> offered;
  std::istringstream lines(offers);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string name, a, b;
    fields >> name >> a >> b;
    if (name == "shm") {
      if (a == hostKey && !b.empty()) {
        offered[name] = b;
      }
    } else if (!name.empty()) {
      offered[name] = a;
    }
  }
  for (const auto& name : options_.transports) {
    auto it = offered.find(name);
    if (it != offered.end() && transports_.count(name) != 0) {
      return Route{name, it->second};
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
      " (shm needs both on one host)");
}

} // namespace torch_rpc_ext
