// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/call_table.h"

#include <algorithm>

#include "csrc/common/exit_gate.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext {

namespace {
constexpr auto kTick = std::chrono::seconds(1);
} // namespace

CallTable::CallTable(ExpireFn onExpired, std::function<void()> onTick)
    : onExpired_(std::move(onExpired)), onTick_(std::move(onTick)) {
  thread_ = std::thread([this] {
    nameThisThread("rpcx-timeouts");
    timeoutLoop();
  });
}

CallTable::~CallTable() {
  stop();
}

size_t CallTable::add(int64_t id, Call call) {
  bool wakeTimer = false;
  size_t before;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    before = calls_.size();
    call.sentAlone = before == 0;
    if (call.timeout.count() != 0) {
      // Wake the timeout thread only if it sleeps past this deadline: it
      // wakes at least once a second anyway, and waking it for every call
      // (a context switch each) was a third of a small call's switches.
      wakeTimer = call.deadline < wakeAt_;
      deadlines_.emplace(call.deadline, id);
    }
    calls_.emplace(id, std::move(call));
  }
  if (wakeTimer) {
    cv_.notify_one();
  }
  return before;
}

std::optional<CallTable::Call> CallTable::take(int64_t id, size_t* remaining) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = calls_.find(id);
  if (it == calls_.end()) {
    return std::nullopt;
  }
  Call call = std::move(it->second);
  calls_.erase(it);
  if (remaining != nullptr) {
    *remaining = calls_.size();
  }
  if (call.timeout.count() != 0) {
    auto range = deadlines_.equal_range(call.deadline);
    for (auto d = range.first; d != range.second; ++d) {
      if (d->second == id) {
        deadlines_.erase(d);
        break;
      }
    }
  }
  return call;
}

std::vector<std::pair<int64_t, CallTable::Call>> CallTable::takeConnection(
    const void* connection) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, call] : calls_) {
      if (call.connection == connection) {
        ids.push_back(id);
      }
    }
  }
  std::vector<std::pair<int64_t, Call>> out;
  for (auto id : ids) {
    if (auto c = take(id)) {
      out.emplace_back(id, std::move(*c));
    }
  }
  return out;
}

std::vector<std::pair<int64_t, CallTable::Call>> CallTable::takeAll() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<int64_t, Call>> out;
  out.reserve(calls_.size());
  for (auto& [id, call] : calls_) {
    out.emplace_back(id, std::move(call));
  }
  calls_.clear();
  deadlines_.clear();
  return out;
}

size_t CallTable::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_.size();
}

std::unordered_map<const Peer*, CallTable::PeerPending> CallTable::
    pendingByPeer() const {
  std::unordered_map<const Peer*, PeerPending> out;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [id, call] : calls_) {
    auto& p = out[call.peer];
    ++p.count;
    p.oldest = std::min(p.oldest, call.sentAt);
  }
  return out;
}

std::pair<std::vector<CallTable::Pending>, size_t> CallTable::oldest(
    size_t limit) const {
  // The id breaks ties between calls sent in one clock tick (one thread's
  // calls take ids in order).
  auto older = [](const Pending& a, const Pending& b) {
    return a.sentAt != b.sentAt ? a.sentAt < b.sentAt : a.id < b.id;
  };
  // A heap of the `limit` oldest seen so far, the youngest of them on top:
  // the walk under the lock that senders and responses take allocates
  // nothing past `limit` entries.
  std::vector<Pending> out;
  size_t total;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    total = calls_.size();
    limit = std::min(limit, total);
    out.reserve(limit);
    for (const auto& [id, call] : calls_) {
      if (limit == 0) {
        break;
      }
      Pending p{id, call.peer, call.kind, call.sentAt, call.timeout};
      if (out.size() < limit) {
        out.push_back(p);
        std::push_heap(out.begin(), out.end(), older);
      } else if (older(p, out.front())) {
        std::pop_heap(out.begin(), out.end(), older);
        out.back() = p;
        std::push_heap(out.begin(), out.end(), older);
      }
    }
  }
  std::sort_heap(out.begin(), out.end(), older);
  return {std::move(out), total};
}

void CallTable::timeoutLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  auto nextTick = std::chrono::steady_clock::now() + kTick;
  while (!stopping_) {
    auto now = std::chrono::steady_clock::now();
    if (now >= nextTick) {
      nextTick = now + kTick;
      lock.unlock();
      ExitGate::parkIfClosed();
      {
        ExitGate::Busy busy;
        onTick_();
      }
      lock.lock();
      continue;
    }
    if (deadlines_.empty() || deadlines_.begin()->first > now) {
      auto wake = nextTick;
      if (!deadlines_.empty() && deadlines_.begin()->first < wake) {
        wake = deadlines_.begin()->first;
      }
      wakeAt_ = wake;
      cv_.wait_until(lock, wake);
      if (ExitGate::closed()) {
        lock.unlock();
        ExitGate::parkIfClosed();
      }
      // Awake, it reads deadlines_ again before it next sleeps.
      wakeAt_ = std::chrono::steady_clock::time_point::max();
      continue;
    }
    std::vector<std::pair<int64_t, Call>> expired;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      int64_t id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      auto it = calls_.find(id);
      if (it != calls_.end()) {
        expired.emplace_back(id, std::move(it->second));
        calls_.erase(it);
      }
    }
    // Settle futures outside the lock: their callbacks may send new RPCs.
    lock.unlock();
    ExitGate::parkIfClosed();
    {
      ExitGate::Busy busy;
      for (auto& [id, call] : expired) {
        onExpired_(id, std::move(call));
      }
      expired.clear();
    }
    lock.lock();
  }
}

void CallTable::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (ExitGate::closed()) {
      // Exiting: the thread is parked for good (common/exit_gate.h).
      if (thread_.joinable()) {
        thread_.detach();
      }
      return;
    }
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

} // namespace torch_rpc_ext
