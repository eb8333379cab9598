// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace torch_rpc_ext {

// Sources (addresses without their port) that failed to prove themselves
// lately: one that fails `maxFailures` times within `window` is held off
// for `holdOff` (its next connections closed unread), so that guessing a
// secret costs a prober its address. What counts as a failure is the
// caller's: a hello or proof that proved nothing, never a timeout or a
// race. At most `maxSources` are remembered; with that many held off at
// once, a new source goes uncounted (a hold-off is never cut short).
// Thread-safe.
class SourceStrikes {
 public:
  struct Limits {
    uint32_t maxFailures = 8;
    std::chrono::steady_clock::duration window = std::chrono::seconds(10);
    std::chrono::steady_clock::duration holdOff = std::chrono::seconds(30);
    size_t maxSources = 4096;
  };
  SourceStrikes() : SourceStrikes(Limits{}) {}
  explicit SourceStrikes(Limits limits) : limits_(limits) {}

  // Whether `source` is held off now (counted in refused()).
  bool heldOff(const std::string& source);
  // `source` failed once more. True where that began its hold-off (the
  // caller says so in its log).
  bool strike(const std::string& source);

  // Hold-offs begun, and connections closed for one.
  uint64_t sourcesHeldOff() const {
    return sourcesHeldOff_.load(std::memory_order_relaxed);
  }
  uint64_t refused() const {
    return refused_.load(std::memory_order_relaxed);
  }
  // "8 failures within 10 s ... for 30 s": the limits in words, for logs.
  std::string describe(const std::string& failures) const;

 private:
  struct Strikes {
    std::chrono::steady_clock::time_point since; // the window's start
    uint32_t count = 0;
    std::chrono::steady_clock::time_point heldOffUntil;
  };

  const Limits limits_;
  std::mutex mutex_;
  std::map<std::string, Strikes> sources_; // (mutex_)
  std::atomic<uint64_t> sourcesHeldOff_{0};
  std::atomic<uint64_t> refused_{0};
};

} // namespace torch_rpc_ext
