// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/rpc/message.h>

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

// Fault injection for tests, with the knobs of upstream's FAULTY_TENSORPIPE
// (torch_rpc_ext.testing registers it as FAULTY_TORCH_RPC_EXT): fail the
// first `numFailSends` sends of every distinct message of the listed types,
// and hold messages of other listed types back for a number of seconds
// before they are written (on the agent's pool; Agent::send() waits only for
// a call that times out before its message is written, and returns it
// failed, as FAULTY_TENSORPIPE does). Names are rpc::MessageType names
// ("RREF_FORK_REQUEST", "SCRIPT_CALL", ...).
struct FaultInjection {
  int numFailSends = 0;
  std::vector<std::string> messagesToFail;
  std::unordered_map<std::string, float> messagesToDelay;

  bool empty() const {
    return messagesToFail.empty() && messagesToDelay.empty();
  }
};

class FaultInjector {
 public:
  // Throws std::invalid_argument naming an unknown message type or a
  // negative delay or count.
  explicit FaultInjector(const FaultInjection& spec);

  // The error text if this send of `message` must fail, else nullopt.
  // Counts per distinct payload, so a retried message fails numFailSends
  // times and then goes through.
  std::optional<std::string> failure(const rpc::Message& message);

  // How long to hold a message of `type` back before writing it.
  std::chrono::milliseconds delay(rpc::MessageType type) const;

 private:
  const int numFailSends_;
  std::vector<rpc::MessageType> failTypes_;
  std::map<rpc::MessageType, std::chrono::milliseconds> delays_;
  std::mutex mutex_;
  std::unordered_map<std::string, int> failedSoFar_;
};

} // namespace torch_rpc_ext
