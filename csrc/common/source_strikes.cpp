// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/source_strikes.h"

namespace torch_rpc_ext {

namespace {

long long wholeSeconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::seconds>(d).count();
}

} // namespace

bool SourceStrikes::heldOff(const std::string& source) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sources_.find(source);
  if (it == sources_.end() ||
      it->second.heldOffUntil <= std::chrono::steady_clock::now()) {
    return false;
  }
  refused_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool SourceStrikes::strike(const std::string& source) {
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (sources_.size() >= limits_.maxSources && sources_.count(source) == 0) {
    // Forget the sources neither striking lately nor held off.
    for (auto it = sources_.begin(); it != sources_.end();) {
      bool stale = now - it->second.since > limits_.window &&
          it->second.heldOffUntil <= now;
      it = stale ? sources_.erase(it) : std::next(it);
    }
    // Then any that is not held off; with every one held off, this
    // source goes uncounted.
    for (auto it = sources_.begin();
         sources_.size() >= limits_.maxSources && it != sources_.end();) {
      it = it->second.heldOffUntil <= now ? sources_.erase(it) : std::next(it);
    }
    if (sources_.size() >= limits_.maxSources) {
      return false;
    }
  }
  Strikes& s = sources_[source];
  if (s.count == 0 || now - s.since > limits_.window) {
    s.since = now;
    s.count = 0;
  }
  if (++s.count < limits_.maxFailures || s.heldOffUntil > now) {
    return false;
  }
  s.heldOffUntil = now + limits_.holdOff;
  s.count = 0;
  sourcesHeldOff_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::string SourceStrikes::describe(const std::string& failures) const {
  return std::to_string(limits_.maxFailures) + " " + failures + " within " +
      std::to_string(wholeSeconds(limits_.window)) + " s; held off for " +
      std::to_string(wholeSeconds(limits_.holdOff)) + " s";
}

} // namespace torch_rpc_ext
