// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <torch/csrc/distributed/rpc/message.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch_rpc_ext {

// Distributions of what calls cost, per peer and kind (issue 47): lock-free
// on the hot path (relaxed atomic adds into fixed exponential buckets), read
// whole by torch_rpc_ext.metrics (Prometheus histograms) through
// Agent::histograms().

namespace rpc = torch::distributed::rpc;

// What a call is, by its request's message type.
enum class CallKind : uint8_t {
  kScript = 0, // builtin operators and TorchScript functions (SCRIPT_CALL)
  kPython, // Python functions (PYTHON_CALL)
  kRRef, // remote(), to_here(), RRef forks and deletes
  kAutograd, // distributed autograd: forward, backward, cleanup
  kOther, // the rest
};
constexpr size_t kCallKinds = 5;

// Whether call costs are counted in this process: yes, unless
// TORCH_RPC_EXT_CALL_COSTS=0 (read once; what the benchmark's "metrics
// off" rows measure the histograms against).
bool callCostsOn();
CallKind callKindOf(rpc::MessageType type);
// A message's kind: a profiled call's (RUN_WITH_PROFILING_REQ) is the kind
// of the call it wraps, read from the small pickle torch appends to its
// payload (kOther where that does not parse).
CallKind callKindOf(const rpc::Message& message);
const char* callKindName(CallKind kind);

// Counts of values in buckets whose upper bounds are base * 2^k, k = 0 ..
// kBuckets - 2, and a last one for the rest; their sum.
class Histogram {
 public:
  static constexpr size_t kBuckets = 28;
  void observe(uint64_t value, uint64_t base) {
    counts_[bucketOf(value, base)].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(value, std::memory_order_relaxed);
  }
  static size_t bucketOf(uint64_t value, uint64_t base) {
    const uint64_t units = (value + base - 1) / base; // ceil
    if (units <= 1) {
      return 0;
    }
    const size_t k = 64 - __builtin_clzll(units - 1); // ceil(log2(units))
    return k < kBuckets - 1 ? k : kBuckets - 1;
  }
  uint64_t count(size_t bucket) const {
    return counts_[bucket].load(std::memory_order_relaxed);
  }
  uint64_t sum() const {
    return sum_.load(std::memory_order_relaxed);
  }
  bool empty() const {
    for (const auto& c : counts_) {
      if (c.load(std::memory_order_relaxed) != 0) {
        return false;
      }
    }
    return true;
  }

 private:
  std::array<std::atomic<uint64_t>, kBuckets> counts_{};
  std::atomic<uint64_t> sum_{0};
};

// What a peer's calls cost, by kind. Times in nanoseconds (buckets from
// 1 us to 67 s), sizes in bytes (from 64 B to 4 GiB).
struct CallCosts {
  static constexpr uint64_t kTimeBase = 1000; // ns: 1 us
  static constexpr uint64_t kBytesBase = 64;
  enum Metric : size_t {
    kCallSeconds = 0, // made: request sent to response received
    kQueueSeconds, // served: request arrived to its function started
    kServeSeconds, // served: function started to response queued
    kRequestBytes, // made: the request's frame
    kResponseBytes, // made: the response's
    kServedRequestBytes, // served: the request's
    kServedResponseBytes, // served: the response's
    kMetrics,
  };
  static const char* metricName(Metric m);
  static bool isTime(Metric m) {
    return m <= kServeSeconds;
  }
  void observe(Metric m, CallKind kind, uint64_t value) {
    if (!callCostsOn()) {
      return;
    }
    histograms[m][static_cast<size_t>(kind)].observe(
        value, isTime(m) ? kTimeBase : kBytesBase);
  }
  void observeTime(
      Metric m,
      CallKind kind,
      std::chrono::steady_clock::duration d) {
    if (!callCostsOn()) {
      return;
    }
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
    observe(m, kind, ns < 0 ? 0 : static_cast<uint64_t>(ns));
  }
  std::array<std::array<Histogram, kCallKinds>, kMetrics> histograms;
};

// One histogram as read: by peer name, kind and metric, its buckets' upper
// bounds (seconds or bytes; the last bucket, +Inf, has none), per-bucket
// counts (not cumulative) and the sum of the values (seconds or bytes).
struct CostSnapshot {
  std::string peer;
  std::string kind;
  std::string metric;
  std::vector<double> bounds;
  std::vector<uint64_t> counts;
  double sum = 0;
};
// Every histogram with a value, of `peers` (name, costs), those of one
// name summed (a dynamic group's rejoined worker).
std::vector<CostSnapshot> snapshotCosts(
    const std::vector<std::pair<std::string, const CallCosts*>>& peers);

} // namespace torch_rpc_ext
