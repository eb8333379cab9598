// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/faults.h"

#include <algorithm>
#include <stdexcept>

#include <torch/csrc/distributed/rpc/utils.h>

namespace torch_rpc_ext {

namespace {

rpc::MessageType typeNamed(const std::string& name) {
  using T = rpc::MessageType;
  static const std::map<std::string, T> types = {
      {"SCRIPT_CALL", T::SCRIPT_CALL},
      {"PYTHON_CALL", T::PYTHON_CALL},
      {"SCRIPT_REMOTE_CALL", T::SCRIPT_REMOTE_CALL},
      {"PYTHON_REMOTE_CALL", T::PYTHON_REMOTE_CALL},
      {"SCRIPT_RREF_FETCH_CALL", T::SCRIPT_RREF_FETCH_CALL},
      {"PYTHON_RREF_FETCH_CALL", T::PYTHON_RREF_FETCH_CALL},
      {"RREF_USER_DELETE", T::RREF_USER_DELETE},
      {"RREF_FORK_REQUEST", T::RREF_FORK_REQUEST},
      {"RREF_CHILD_ACCEPT", T::RREF_CHILD_ACCEPT},
      {"CLEANUP_AUTOGRAD_CONTEXT_REQ", T::CLEANUP_AUTOGRAD_CONTEXT_REQ},
      {"FORWARD_AUTOGRAD_REQ", T::FORWARD_AUTOGRAD_REQ},
      {"BACKWARD_AUTOGRAD_REQ", T::BACKWARD_AUTOGRAD_REQ},
  };
  auto it = types.find(name);
  if (it == types.end()) {
    throw std::invalid_argument(
        "fault injection: no request message type named '" + name + "'");
  }
  return it->second;
}

} // namespace

FaultInjector::FaultInjector(const FaultInjection& spec)
    : numFailSends_(spec.numFailSends) {
  if (numFailSends_ < 0) {
    throw std::invalid_argument("num_fail_sends must be >= 0");
  }
  for (const auto& name : spec.messagesToFail) {
    failTypes_.push_back(typeNamed(name));
  }
  for (const auto& [name, seconds] : spec.messagesToDelay) {
    if (!(seconds >= 0)) {
      throw std::invalid_argument(
          "messages_to_delay['" + name + "'] must be >= 0 seconds");
    }
    delays_[typeNamed(name)] = std::chrono::milliseconds(
        static_cast<int64_t>(static_cast<double>(seconds) * 1000));
  }
}

std::optional<std::string> FaultInjector::failure(const rpc::Message& message) {
  if (std::find(failTypes_.begin(), failTypes_.end(), message.type()) ==
      failTypes_.end()) {
    return std::nullopt;
  }
  const auto& payload = message.payload();
  std::string key(payload.begin(), payload.end());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    int& n = failedSoFar_[key];
    if (n >= numFailSends_) {
      return std::nullopt;
    }
    ++n;
  }
  return rpc::makeRPCError(
      "Send attempt failed intentionally for message type " +
          std::to_string(static_cast<int>(message.type())),
      rpc::RPCErrorType::INTENTIONAL_FAILURE);
}

std::chrono::milliseconds FaultInjector::delay(rpc::MessageType type) const {
  auto it = delays_.find(type);
  return it == delays_.end() ? std::chrono::milliseconds(0) : it->second;
}

} // namespace torch_rpc_ext
