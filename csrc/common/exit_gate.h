// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>

namespace torch_rpc_ext {

// Process exit with agents still running (a script that ends, or calls
// exit(), without rpc.shutdown()). From the moment the process starts to
// exit, Python finalises and libtorch's static objects are destroyed while
// our threads may still be decoding frames, serving requests or taking the
// GIL: a crash (SIGSEGV in a deregistered kernel) or, for a thread Python
// ends during finalisation, std::terminate. So the exit hooks (Python's
// atexit and C's, see bindings/module.cpp) close this gate first: every
// thread of ours that reaches the top of its loop afterwards parks for good
// without touching anything, and stop()/join() of our threads detaches
// instead of waiting for parked threads. Closing waits a bounded grace for
// the pieces of work in progress to finish.
class ExitGate {
 public:
  static bool closed() {
    return closed_.load(std::memory_order_relaxed);
  }
  // At the top of a thread's loop, holding no lock: parks for good once
  // the gate is closed.
  static void parkIfClosed();
  // Close the gate; wait up to `grace` for the work in progress (Busy
  // scopes) to end. Idempotent. The exit hooks give kGrace: a piece still
  // running after that is blocked (on a call that will never complete) and
  // stays so.
  static constexpr std::chrono::milliseconds kGrace{1000};
  static void close(std::chrono::milliseconds grace = kGrace);

  // Marks one piece of work (a handler, a task) in progress; parks for
  // good instead if the gate closed. Counted first, then the gate read
  // (both sequentially consistent, as close() stores, then reads): either
  // close() sees this piece and waits for it, or the piece sees the gate
  // closed. (Before session 94 a thread that passed parkIfClosed() and was
  // preempted before it counted itself ran its piece while the process
  // exited; a helper's reading.)
  class Busy {
   public:
    Busy() {
      busy_.fetch_add(1, std::memory_order_seq_cst);
      if (closed_.load(std::memory_order_seq_cst)) {
        busy_.fetch_sub(1, std::memory_order_release);
        parkIfClosed(); // never returns
      }
    }
    ~Busy() {
      busy_.fetch_sub(1, std::memory_order_release);
    }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;
  };

 private:
  static inline std::atomic<bool> closed_{false};
  static inline std::atomic<int> busy_{0};
};

} // namespace torch_rpc_ext
