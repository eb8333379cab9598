// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/source_strikes.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace torch_rpc_ext {

namespace {

long long wholeSeconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::seconds>(d).count();
}

// An address literal's bytes (4 or 16): false where `text` is none.
bool addressBytes(const std::string& text, bool* v6, uint8_t* bytes) {
  if (::inet_pton(AF_INET, text.c_str(), bytes) == 1) {
    *v6 = false;
    return true;
  }
  *v6 = true;
  return ::inet_pton(AF_INET6, text.c_str(), bytes) == 1;
}

// The first 12 bytes of an IPv4 address mapped into IPv6 (::ffff:a.b.c.d).
constexpr uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

bool prefixMatches(const uint8_t* a, const uint8_t* b, uint32_t bits) {
  uint32_t whole = bits / 8;
  if (std::memcmp(a, b, whole) != 0) {
    return false;
  }
  uint32_t rest = bits % 8;
  uint8_t mask = static_cast<uint8_t>(0xff00 >> rest);
  return rest == 0 || ((a[whole] ^ b[whole]) & mask) == 0;
}

} // namespace

AddressRanges AddressRanges::parse(const std::vector<std::string>& entries) {
  AddressRanges out;
  for (const auto& entry : entries) {
    if (entry.find('\0') != std::string::npos) {
      throw std::invalid_argument(
          "an entry holding a NUL byte is not an address or a network");
    }
    auto bad = [&](const std::string& why) {
      return std::invalid_argument(
          "'" + entry + "' is not an address or a network (" + why + ")");
    };
    auto slash = entry.find('/');
    Range r;
    if (!addressBytes(entry.substr(0, slash), &r.v6, r.bytes)) {
      throw bad("an IPv4 or IPv6 address, then /bits for a network");
    }
    const uint32_t width = r.v6 ? 128 : 32;
    r.prefix = width;
    if (slash != std::string::npos) {
      auto bits = entry.substr(slash + 1);
      if (bits.empty() || bits.size() > 3 ||
          bits.find_first_not_of("0123456789") != std::string::npos ||
          std::stoul(bits) > width) {
        throw bad("its prefix is not 0 to " + std::to_string(width));
      }
      r.prefix = static_cast<uint32_t>(std::stoul(bits));
      for (uint32_t bit = r.prefix; bit < width; ++bit) {
        if (r.bytes[bit / 8] & (0x80 >> (bit % 8))) {
          throw bad("host bits set beyond /" + bits);
        }
      }
    }
    // An IPv4 network written mapped (::ffff:10.0.0.0/104) holds the IPv4
    // sources it names, as they are named: 10.0.0.0/8.
    if (r.v6 && r.prefix >= 96 && std::memcmp(r.bytes, kMapped, 12) == 0) {
      std::memmove(r.bytes, r.bytes + 12, 4);
      std::memset(r.bytes + 4, 0, 12);
      r.v6 = false;
      r.prefix -= 96;
    }
    out.ranges_.push_back(r);
  }
  return out;
}

bool AddressRanges::contains(std::string_view source) const {
  if (ranges_.empty()) {
    return false;
  }
  // "[v6%scope]:0" and "a.b.c.d:0" as the lanes name a source, the
  // listener's "a.b.c.d" or "[v6%scope]": the port and the scope left out.
  if (!source.empty() && source.front() == '[') {
    source = source.substr(1, source.find(']') - 1);
  } else if (std::count(source.begin(), source.end(), ':') == 1) {
    source = source.substr(0, source.find(':'));
  }
  source = source.substr(0, source.find('%'));
  bool v6 = false;
  uint8_t bytes[16] = {};
  if (!addressBytes(std::string(source), &v6, bytes)) {
    return false;
  }
  // An IPv4 peer of a dual-stack socket (::ffff:a.b.c.d) is that IPv4
  // address to the IPv4 networks.
  const bool mapped = v6 && std::memcmp(bytes, kMapped, 12) == 0;
  for (const auto& r : ranges_) {
    if (r.v6 == v6 && prefixMatches(r.bytes, bytes, r.prefix)) {
      return true;
    }
    if (!r.v6 && mapped && prefixMatches(r.bytes, bytes + 12, r.prefix)) {
      return true;
    }
  }
  return false;
}

void SourceStrikes::exempt(AddressRanges ranges) {
  std::lock_guard<std::mutex> lock(mutex_);
  exempt_ = std::move(ranges);
}

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
  if (exempt_.contains(source)) {
    exemptFailures_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
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
