// SPDX-License-Identifier: BSD-3-Clause
// Call kinds and metric names (latency.h).
#include "csrc/agent/latency.h"

#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

namespace torch_rpc_ext {

bool callCostsOn() {
  static const bool on = [] {
    const char* v = std::getenv("TORCH_RPC_EXT_CALL_COSTS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

CallKind callKindOf(rpc::MessageType type) {
  using T = rpc::MessageType;
  switch (type) {
    case T::SCRIPT_CALL:
      return CallKind::kScript;
    case T::PYTHON_CALL:
      return CallKind::kPython;
    case T::SCRIPT_REMOTE_CALL:
    case T::PYTHON_REMOTE_CALL:
    case T::SCRIPT_RREF_FETCH_CALL:
    case T::PYTHON_RREF_FETCH_CALL:
    case T::RREF_USER_DELETE:
    case T::RREF_CHILD_ACCEPT:
    case T::RREF_FORK_REQUEST:
      return CallKind::kRRef;
    case T::FORWARD_AUTOGRAD_REQ:
    case T::BACKWARD_AUTOGRAD_REQ:
    case T::CLEANUP_AUTOGRAD_CONTEXT_REQ:
      return CallKind::kAutograd;
    default:
      return CallKind::kOther;
  }
}

CallKind callKindOf(const rpc::Message& message) {
  if (message.type() != rpc::MessageType::RUN_WITH_PROFILING_REQ) {
    return callKindOf(message.type());
  }
  // torch's writeWrappedPayload: the wrapped call's payload, then a pickled
  // tuple (its type, the profiling key, the profiler's config), then that
  // tuple's size as a big-endian int64. The tuple is a few dozen bytes.
  constexpr size_t kMaxTail = 4096;
  const auto& payload = message.payload();
  if (payload.size() < 8) {
    return CallKind::kOther;
  }
  uint64_t tail = 0;
  for (size_t i = payload.size() - 8; i < payload.size(); ++i) {
    tail = (tail << 8) | static_cast<uint8_t>(payload[i]);
  }
  if (tail == 0 || tail > kMaxTail || tail > payload.size() - 8) {
    return CallKind::kOther;
  }
  try {
    const c10::IValue fields =
        torch::jit::unpickle(payload.data() + payload.size() - 8 - tail, tail);
    if (!fields.isTuple() || fields.toTupleRef().elements().empty() ||
        !fields.toTupleRef().elements()[0].isInt()) {
      return CallKind::kOther;
    }
    const auto wrapped = static_cast<rpc::MessageType>(
        fields.toTupleRef().elements()[0].toInt());
    return wrapped == rpc::MessageType::RUN_WITH_PROFILING_REQ
        ? CallKind::kOther
        : callKindOf(wrapped);
  } catch (const std::exception&) {
    return CallKind::kOther;
  }
}

const char* callKindName(CallKind kind) {
  switch (kind) {
    case CallKind::kScript:
      return "script";
    case CallKind::kPython:
      return "python";
    case CallKind::kRRef:
      return "rref";
    case CallKind::kAutograd:
      return "autograd";
    case CallKind::kOther:
      break;
  }
  return "other";
}

const char* CallCosts::metricName(Metric m) {
  static const char* const kNames[kMetrics] = {
      "call_seconds",
      "queue_seconds",
      "serve_seconds",
      "request_bytes",
      "response_bytes",
      "served_request_bytes",
      "served_response_bytes",
  };
  return m < kMetrics ? kNames[m] : "";
}

std::vector<CostSnapshot> snapshotCosts(
    const std::vector<std::pair<std::string, const CallCosts*>>& peers) {
  std::map<std::tuple<std::string, size_t, size_t>, CostSnapshot> byKey;
  for (const auto& [name, costs] : peers) {
    for (size_t m = 0; m < CallCosts::kMetrics; ++m) {
      const auto metric = static_cast<CallCosts::Metric>(m);
      const bool time = CallCosts::isTime(metric);
      const uint64_t base = time ? CallCosts::kTimeBase : CallCosts::kBytesBase;
      // Divided, not multiplied by 1e-9: the bounds read 0.016384, not
      // 0.016384000000000003 (an `le` a query can name).
      const double perUnit = time ? 1e9 : 1.0;
      for (size_t k = 0; k < kCallKinds; ++k) {
        const Histogram& h = costs->histograms[m][k];
        if (h.empty()) {
          continue;
        }
        auto [it, fresh] = byKey.try_emplace({name, m, k});
        CostSnapshot& s = it->second;
        if (fresh) {
          s.peer = name;
          s.kind = callKindName(static_cast<CallKind>(k));
          s.metric = CallCosts::metricName(metric);
          s.counts.assign(Histogram::kBuckets, 0);
          for (size_t b = 0; b + 1 < Histogram::kBuckets; ++b) {
            s.bounds.push_back(static_cast<double>(base << b) / perUnit);
          }
        }
        for (size_t b = 0; b < Histogram::kBuckets; ++b) {
          s.counts[b] += h.count(b);
        }
        s.sum += static_cast<double>(h.sum()) / perUnit;
      }
    }
  }
  std::vector<CostSnapshot> out;
  out.reserve(byKey.size());
  for (auto& [key, s] : byKey) {
    out.push_back(std::move(s));
  }
  return out;
}

} // namespace torch_rpc_ext
