// SPDX-License-Identifier: BSD-3-Clause
// The requests a worker is serving (serving_table.h).
#include "csrc/agent/serving_table.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>

namespace torch_rpc_ext {

namespace {

// The calling thread's Linux id, read once per thread: a process forked
// after this thread read it (its only thread now, with an id of its own)
// reads it again.
thread_local int32_t tlsThreadId = 0;
int32_t thisThreadsId() {
  static const bool forgetsAtFork = [] {
    ::pthread_atfork(nullptr, nullptr, [] { tlsThreadId = 0; });
    return true;
  }();
  (void)forgetsAtFork;
  if (tlsThreadId == 0) {
    tlsThreadId = static_cast<int32_t>(::syscall(SYS_gettid));
  }
  return tlsThreadId;
}

thread_local std::optional<ServingTable::Ticket> tlsInHandler;

uint64_t packed(ServingTable::Stage stage, int32_t thread) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(thread)) << 8) |
      static_cast<uint64_t>(stage);
}

} // namespace

const char* ServingTable::stageName(Stage stage) {
  switch (stage) {
    case Stage::kQueued:
      return "queued";
    case Stage::kRunning:
      return "running";
    case Stage::kWaiting:
      return "waiting";
    case Stage::kResponding:
      return "responding";
  }
  return "unknown";
}

std::pair<ServingTable::Ticket, ServingTable::Clock::time_point> ServingTable::
    add(int64_t id, const Peer* caller, CallKind kind) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (spare_.empty()) {
    live_.emplace_back();
  } else {
    live_.splice(live_.end(), spare_, spare_.begin());
  }
  auto ticket = std::prev(live_.end());
  ticket->id = id;
  ticket->caller = caller;
  ticket->kind = kind;
  ticket->arrived = Clock::now();
  ticket->state.store(packed(Stage::kQueued, 0), std::memory_order_relaxed);
  return {ticket, ticket->arrived};
}

void ServingTable::enter(Ticket ticket, Stage stage) {
  const bool held = stage == Stage::kRunning || stage == Stage::kResponding;
  ticket->state.store(
      packed(stage, held ? thisThreadsId() : 0), std::memory_order_relaxed);
}

void ServingTable::leaveRunning(Ticket ticket) {
  uint64_t running = packed(Stage::kRunning, thisThreadsId());
  ticket->state.compare_exchange_strong(
      running, packed(Stage::kWaiting, 0), std::memory_order_relaxed);
}

ServingTable::InHandler::InHandler(Ticket ticket) : outer_(tlsInHandler) {
  tlsInHandler = ticket;
}

ServingTable::InHandler::~InHandler() {
  tlsInHandler = outer_;
}

std::optional<ServingTable::Ticket> ServingTable::inHandler() {
  return tlsInHandler;
}

void ServingTable::remove(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (spare_.size() < kMaxSpare) {
    spare_.splice(spare_.begin(), live_, ticket);
  } else {
    live_.erase(ticket);
  }
}

size_t ServingTable::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.size();
}

std::optional<ServingTable::Clock::time_point> ServingTable::oldestArrival()
    const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (live_.empty()) {
    return std::nullopt;
  }
  return live_.front().arrived;
}

std::pair<std::vector<ServingTable::Serving>, size_t> ServingTable::oldest(
    size_t limit) const {
  std::vector<Serving> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.reserve(std::min(limit, live_.size()));
  for (const auto& e : live_) {
    if (out.size() == limit) {
      break;
    }
    const uint64_t state = e.state.load(std::memory_order_relaxed);
    out.push_back(
        Serving{
            e.id,
            e.caller,
            e.kind,
            e.arrived,
            static_cast<Stage>(state & 0xff),
            static_cast<int32_t>(static_cast<uint32_t>(state >> 8))});
  }
  return {std::move(out), live_.size()};
}

} // namespace torch_rpc_ext
