// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace torch_rpc_ext::transport::tcp {

// Something with a file descriptor the loop watches.
class Pollable {
 public:
  virtual ~Pollable() = default;
  // Loop thread: `events` (EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP) are ready.
  virtual void handleEventsFromLoop(uint32_t events) = 0;
};

// One epoll thread that owns readiness dispatch, deferred work and timers.
// Handlers run on this thread one at a time; they must not block.
class Loop {
 public:
  Loop();
  ~Loop();

  // Watch `fd` (level-triggered) and keep `p` alive until removeFromLoop().
  // Loop thread only.
  void addFromLoop(int fd, std::shared_ptr<Pollable> p, uint32_t events);
  // Change the watched events of an added fd; safe from any thread.
  void modify(int fd, uint32_t events);
  // Stop watching `fd`. Loop thread only.
  void removeFromLoop(int fd);

  // Run `fn` on the loop thread, soon. After stop(), `fn` is dropped.
  void post(std::function<void()> fn);
  // Run `fn` on the loop thread after `delay`.
  void runAfter(std::chrono::milliseconds delay, std::function<void()> fn);

  bool inLoop() const;

  // Run pending work, drop every handler and join the thread. Idempotent.
  void stop();

 private:
  void run();
  void wake();

  int epollFd_ = -1;
  int wakeFd_ = -1;
  std::thread thread_;
  std::thread::id threadId_;

  std::mutex mutex_;
  bool stopping_ = false;
  std::vector<std::function<void()>> posted_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>>
      timers_;
  // Loop thread only.
  std::unordered_map<int, std::shared_ptr<Pollable>> handlers_;
};

} // namespace torch_rpc_ext::transport::tcp
