// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <pthread.h>

#include <atomic>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace torch_rpc_ext {

// Names the calling thread as `top -H`, `ps -L`, perf, gdb and py-spy show
// it ("rpcx-<role>"; Linux keeps 15 characters, so a longer name is cut).
// Every thread of ours names itself as it starts: a new thread otherwise
// inherits its creator's name (a pool worker started by a loop thread would
// read as the loop).
inline thread_local bool tlsThreadOfOurs = false;
inline void nameThisThread(const std::string& name) {
  tlsThreadOfOurs = true;
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

// Whether the calling thread is one the agent started (it named itself, or
// runs ThreadHooksScope), not a user's.
inline bool isThreadOfOurs() {
  return tlsThreadOfOurs;
}

// Threads by id, as the thread pool and the transport loop keep them.
using ThreadsById = std::unordered_map<std::thread::id, std::thread>;

// Join and forget the threads listed in `finished` (each has left its work
// for good, so joining is prompt), then clear the list.
inline void reapFinished(
    ThreadsById& threads,
    std::vector<std::thread::id>& finished) {
  for (auto id : finished) {
    auto it = threads.find(id);
    if (it != threads.end()) {
      it->second.join();
      threads.erase(it);
    }
  }
  finished.clear();
}

// Run at the start and at the end of every thread that executes user work
// (transport loop threads, pool workers). The core never touches Python;
// the bindings install a pair that gives each such thread one Python thread
// state for its whole life (bindings/python_threads.cpp). Without it, every
// GIL acquisition on one of our threads created and destroyed a thread
// state: half of a small Python UDF call's time.
struct ThreadHooks {
  void (*onStart)() = nullptr;
  void (*onExit)() = nullptr;
};

inline std::atomic<void (*)()> gThreadStartHook{nullptr};
inline std::atomic<void (*)()> gThreadExitHook{nullptr};

// Install once, before the first thread starts (at module import).
inline void setThreadHooks(ThreadHooks hooks) {
  gThreadStartHook.store(hooks.onStart);
  gThreadExitHook.store(hooks.onExit);
}

inline thread_local bool tlsThreadExitHookDone = false;

// Run onExit now rather than when the thread's body ends. A thread must do
// this before it tells anyone it is finished: onExit may wait for the GIL,
// and whoever joins the thread must not be kept waiting on that (a loop's
// monitor joining a retired leader while a Python thread holds the GIL for
// seconds). Idempotent.
inline void runThreadExitHook() {
  if (!tlsThreadExitHookDone) {
    tlsThreadExitHookDone = true;
    if (auto exitHook = gThreadExitHook.load()) {
      exitHook();
    }
  }
}

// Declare first thing in a thread's body: runs onStart now, and onExit when
// the body ends unless runThreadExitHook() ran it earlier.
class ThreadHooksScope {
 public:
  ThreadHooksScope() {
    tlsThreadOfOurs = true;
    tlsThreadExitHookDone = false;
    if (auto start = gThreadStartHook.load()) {
      start();
    }
  }
  ~ThreadHooksScope() {
    runThreadExitHook();
  }
  ThreadHooksScope(const ThreadHooksScope&) = delete;
  ThreadHooksScope& operator=(const ThreadHooksScope&) = delete;
};

} // namespace torch_rpc_ext
