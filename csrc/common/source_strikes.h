// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace torch_rpc_ext {

// Networks of IPv4 or IPv6 addresses ("10.0.0.0/8", "fd00::/8", or one
// address: all its bits), for sources a SourceStrikes never holds off.
class AddressRanges {
 public:
  AddressRanges() = default;
  // Throws std::invalid_argument naming an entry that is no address or
  // network, or one whose host bits are set ("10.0.0.5/8").
  static AddressRanges parse(const std::vector<std::string>& entries);

  // Whether `source` (an address as the transports and channels name it,
  // a port and an IPv6 scope left out: the listener's "10.0.0.7" and
  // "[fd00::7%eth0]", tcp_lanes' "10.0.0.7:0" and "[fd00::7%eth0]:0"; an
  // IPv4 address of a dual-stack socket as "[::ffff:10.0.0.7]") lies in
  // one of the networks. A name that is no address ("local") lies in none.
  bool contains(std::string_view source) const;
  bool empty() const {
    return ranges_.empty();
  }

 private:
  struct Range {
    bool v6 = false;
    uint8_t bytes[16] = {};
    uint32_t prefix = 0;
  };
  std::vector<Range> ranges_;
};

// Sources (addresses without their port) that failed to prove themselves
// lately: one that fails `maxFailures` times within `window` is held off
// for `holdOff` (its next connections closed unread), so that guessing a
// secret costs a prober its address. What counts as a failure is the
// caller's: for the listeners, a hello or proof that proved nothing, never
// a timeout or a race; for a transport's dials, a server's TLS handshake
// left unfinished after our key exchange, however it ended. At most
// `maxSources` are remembered; with that many held off at once, a new source
// goes uncounted (a hold-off is never cut short). The exempt sources' failures
// are counted apart and hold nothing off (the peers of a NAT, or the job's own
// hosts, where one worker with a wrong secret would otherwise hold its
// neighbours off). Thread-safe.
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

  // Sources never held off from now on (set before the first strike).
  void exempt(AddressRanges ranges);

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
  // Failures of exempt sources (each would have been a strike).
  uint64_t exemptFailures() const {
    return exemptFailures_.load(std::memory_order_relaxed);
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
  AddressRanges exempt_; // (mutex_)
  std::atomic<uint64_t> sourcesHeldOff_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> exemptFailures_{0};
};

} // namespace torch_rpc_ext
