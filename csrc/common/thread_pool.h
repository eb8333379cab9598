// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "csrc/common/threads.h"

namespace torch_rpc_ext {

// A worker pool that cannot be starved into deadlock.
//
// It keeps `coreThreads` threads. When tasks wait in the queue and no worker
// has picked one up for `stallTimeout` (every worker is blocked, e.g. in a
// nested rpc_sync), a supervisor adds a thread, up to `maxThreads`. Threads
// above the core count exit after being idle for a while. This is what keeps
// nested RPCs and many concurrent blocking calls from deadlocking a pool of
// fixed size (upstream #26362, #85607).
class ThreadPool {
 public:
  ThreadPool(
      size_t coreThreads,
      size_t maxThreads,
      std::chrono::milliseconds stallTimeout = std::chrono::milliseconds(20),
      std::string name = "rpcx-pool");
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queue a task. Tasks must not throw. Once stop() has begun, a task that
  // no worker will see any more is dropped (destroyed here, not run).
  void run(std::function<void()> task);

  // Block until the queue is empty and no task is running.
  void waitIdle();

  // Finish queued tasks, then join every thread. Idempotent; a second
  // caller returns once the first has joined them (a task of the pool's
  // own that calls it returns at once).
  void stop();

  size_t size() const;
  size_t idle() const;
  // Tasks waiting for a thread (not the ones running).
  size_t queued() const;

 private:
  void workerLoop(bool core);
  void supervisorLoop();
  // Starts a worker; "" or why none could be started (counts unchanged).
  std::string spawnLocked(bool core);
  void reapLocked();

  const size_t coreThreads_;
  const size_t maxThreads_;
  const std::chrono::milliseconds stallTimeout_;
  // Its threads' names: the workers' and, with "-sup", the supervisor's.
  const std::string name_;

  mutable std::mutex mutex_;
  std::condition_variable workCv_;
  std::condition_variable idleCv_;
  std::condition_variable supervisorCv_;
  std::condition_variable stoppedCv_;
  std::deque<std::function<void()>> queue_;
  ThreadsById threads_;
  // Extra threads that have exited and are waiting to be joined.
  std::vector<std::thread::id> finished_;
  std::thread supervisor_;
  size_t alive_ = 0;
  // Workers that have not yet decided to exit: a task queued while one is
  // left will be run. (alive_ still counts a worker in its exit hook.)
  size_t serving_ = 0;
  size_t idle_ = 0;
  size_t running_ = 0;
  uint64_t taken_ = 0;
  bool stopping_ = false;
  bool stopped_ = false; // every thread joined or detached
  bool supervisorIdle_ = false; // in its untimed wait (queue empty)
};

} // namespace torch_rpc_ext
