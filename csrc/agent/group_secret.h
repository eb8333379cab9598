// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace torch_rpc_ext {

// A group's secret when the user gave none (docs/security.md, "The group
// secret"): made by one worker and sealed with X25519 to each other's
// public key, so that the store, and a reader of its traffic, hold public
// keys and sealed bytes only. In a static group rank 0 makes it and seals
// it to every rank; in a dynamic group whoever comes first makes it, and
// the members seal it to each joiner (serve(), from the group's watcher).
// group_secret.cpp says which keys of the store it uses.
//
// Threads: the init thread (forStaticGroup, forDynamicGroup, noteJoined),
// then the group's watcher thread (serve).
class SecretExchange {
 public:
  SecretExchange(
      c10::intrusive_ptr<::c10d::Store> store,
      std::string selfName,
      int64_t rank);

  // Rank 0 makes the secret and seals it to every other rank of
  // `worldSize`; the others open theirs. Throws naming the problem.
  std::string forStaticGroup(int worldSize);
  // Makes the secret if we come first (or the group lost every member),
  // else waits up to `timeout` for a member to seal it to us. Throws
  // naming the problem.
  std::string forDynamicGroup(std::chrono::milliseconds timeout);
  // We joined the dynamic group: its epoch has had a member.
  void noteJoined();
  // Seal `secret` to every joiner that asked since the last call (a no-op
  // unless forDynamicGroup gave us the secret).
  void serve(const std::string& secret);

 private:
  // How many members the dynamic group's membership log lists now.
  size_t membersListed() const;

  const c10::intrusive_ptr<::c10d::Store> store_;
  const std::string selfName_;
  const int64_t rank_;
  int64_t epoch_ = -1; // the dynamic group's secret epoch we hold
  int64_t served_ = 0; // requests of that epoch sealed (watcher thread)
};

} // namespace torch_rpc_ext
