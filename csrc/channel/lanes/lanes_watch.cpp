// SPDX-License-Identifier: BSD-3-Clause
// LanesChannel, watching what arrives: a held record whose stripes stopped
// coming (a stalled lane, or a device copy that never ends), and a lane
// that ended while the others still bring the rest of a segment.
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "csrc/channel/lanes/lane.h"
#include "csrc/channel/lanes/lanes_channel.h"
#include "csrc/common/host_load.h"

namespace torch_rpc_ext::channel::lanes {

namespace {

// heartbeat_timeouts more for a stalled-looking lane while this host's CPUs
// are saturated (host_load.h): its sender's thread may be starved.
constexpr int kSaturatedTimeouts = 2;

// How long a lane that ended with a segment not all in waits for the lanes
// still open to bring the rest while they bring nothing (lingerLocked()).
constexpr std::chrono::seconds kLingerQuiet{1};

} // namespace

std::string LanesChannel::stalledLanding() {
  auto host = host_.lock();
  const std::chrono::milliseconds timeout =
      host ? host->heartbeatTimeout() : std::chrono::milliseconds(0);
  if (timeout.count() <= 0) {
    return ""; // no liveness asked for: a record waits as long as it takes
  }
  // Twice the heartbeat's timeout: a link back from an outage shorter than
  // one resends only after TCP's backoff. Never under three keepalive
  // intervals (the sender's, which neither end's option sets).
  const auto quiet =
      std::max<std::chrono::milliseconds>(2 * timeout, 3 * kKeepAliveEvery);
  // A sender that only says its device copy is under way: as long as the
  // heartbeat gives a busy peer (a copy that never ends would hold the
  // frame and every one behind it).
  const auto patience = std::max<std::chrono::milliseconds>(6 * timeout, quiet);
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  auto at = [](const std::atomic<int64_t>& ticks) {
    return Clock::time_point(
        Clock::duration(ticks.load(std::memory_order_relaxed)));
  };
  auto secs = [](Clock::duration d) {
    char text[32];
    std::snprintf(
        text, sizeof(text), "%.1f s", std::chrono::duration<double>(d).count());
    return std::string(text);
  };
  auto of = [&](std::chrono::milliseconds limit, int times) {
    return secs(limit) +
        (limit == times * timeout
             ? std::string(times == 2 ? " (twice" : " (six") +
                 " heartbeat_timeout)"
             : std::string());
  };
  // What a silent landing was given: twice the timeout, and two more on a
  // saturated host (`pressure` >= 0 then).
  auto given = [&](double pressure) {
    if (pressure < 0) {
      return of(quiet, 2);
    }
    char load[96];
    std::snprintf(
        load,
        sizeof(load),
        "this host's CPUs were saturated, %.0f%% pressure)",
        pressure);
    return secs(quiet + kSaturatedTimeouts * timeout) +
        (quiet == 2 * timeout ? " (twice heartbeat_timeout, and two more: "
                              : " (two heartbeat_timeouts more: ") +
        load;
  };
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [token, landing] : landings_) {
    if (closing_ || !landing->held || landing->received == landing->size) {
      continue;
    }
    // Its own progress: while its record is held, every segment before it
    // is in, so what its lanes carry next is its own.
    const auto bytes = std::max(landing->heldSince, at(landing->bytesAt));
    const auto kept = at(landing->keptAt);
    const auto last = std::max(bytes, kept);
    bool silent = now - last >= quiet && !lanesReceivingLocked(quiet, token);
    // As the heartbeat does for a silent peer: on a host whose CPUs are
    // saturated, a lane's sender may be starved rather than its path
    // stalled. Two timeouts more (still under the heartbeat's six).
    double pressure = -1;
    if (silent) {
      if (const double p = cpuPressurePercent(); p >= kStarvedPressurePercent) {
        pressure = p;
        const auto longer = quiet + kSaturatedTimeouts * timeout;
        silent = now - last >= longer && !lanesReceivingLocked(longer, token);
      }
    }
    const bool copyOnly = !silent && kept > bytes && now - bytes >= patience;
    if (!silent && !copyOnly) {
      continue;
    }
    std::string byLane;
    for (size_t l = 0; l < std::min(inLanes_, kMaxLanes); ++l) {
      byLane += (l == 0 ? "" : ", ") + std::to_string(l) + ": " +
          std::to_string(landing->laneBytes[l]);
    }
    std::string head = "tcp_lanes: segment " + std::to_string(token) + " (" +
        std::to_string(landing->size) + " bytes, " +
        std::to_string(landing->received) + " in) waited " +
        secs(now - landing->heldSince) + " for its stripes";
    if (silent) {
      return head + ", and no lane carried anything of it for " +
          given(pressure) + "; its bytes by lane: " +
          (byLane.empty() ? std::string("none") : byLane) +
          ": a lane stalled (a middlebox holding it, or its path down)";
    }
    return head + "; for " + of(patience, 6) +
        " the peer's lanes said only that its bytes were on their way to "
        "them (keepalives): a copy out of a device, or a read of "
        "memory-mapped pages, that does not end (a stream stuck behind "
        "work that never completes? storage that stopped answering?)";
  }
  return "";
}

bool LanesChannel::lanesReceivingLocked(
    std::chrono::milliseconds within,
    uint64_t token) const {
  for (size_t slot = 0; slot < inFds_.size(); ++slot) {
    if (slot < inSlots_.size() && inSlots_[slot].token &&
        *inSlots_[slot].token > token) {
      continue; // on a later segment: it sent all it had of this one
    }
    tcp_info info{};
    socklen_t length = sizeof(info);
    if (::getsockopt(inFds_[slot], IPPROTO_TCP, TCP_INFO, &info, &length) ==
            0 &&
        info.tcpi_last_data_recv < static_cast<uint32_t>(within.count())) {
      return true;
    }
  }
  return false;
}

void LanesChannel::lingerLocked(std::unique_lock<std::mutex>& lock) {
  // Until the landings are whole, every lane has ended, or the lanes still
  // open bring nothing for a second (then what this lane owed is lost).
  using Clock = std::chrono::steady_clock;
  const auto endedAt = Clock::now();
  auto quiet = [&] {
    auto last = endedAt;
    for (const auto& [token, landing] : landings_) {
      if (landing->received < landing->size) {
        last = std::max(
            last,
            Clock::time_point(
                Clock::duration(
                    landing->bytesAt.load(std::memory_order_relaxed))));
      }
    }
    return Clock::now() - last >= kLingerQuiet;
  };
  auto anyOpen = [&] {
    for (const auto& s : inSlots_) {
      if (!s.ended) {
        return true;
      }
    }
    return false;
  };
  while (!closing_ && !host_.expired() && !landingsCompleteLocked() &&
         anyOpen() && !quiet()) {
    budget_.wait_for(lock, std::chrono::milliseconds(20));
  }
}

} // namespace torch_rpc_ext::channel::lanes
