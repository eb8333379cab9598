// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/staging_thread.h"
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// The staging thread (staging_thread.h); it trims the pools now and then
// (freeing memory may wait for the device: never on a transport loop).
// Leaked with the process.
class StagingThread {
 public:
  struct Item {
    int device;
    PooledEvent copied;
    std::function<void(const std::string& error)> done;
    // runOnStagingThreadWhen(): asked before `done`, less often the longer
    // it says no (a peer's event may never complete).
    std::function<bool()> ready = nullptr;
    std::chrono::steady_clock::time_point nextAsk{};
    std::chrono::microseconds backoff{0};
  };

  static StagingThread& get() {
    static StagingThread* t = new StagingThread();
    return *t;
  }

  void add(Item item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_one();
  }

 private:
  StagingThread() : thread_([this] { run(); }) {
    thread_.detach();
  }

  void run() {
    nameThisThread("rpcx-staging");
    using std::chrono::microseconds;
    std::vector<Item> pending;
    auto pause = microseconds(20);
    auto lastTrim = std::chrono::steady_clock::now();
    while (true) {
      // At exit (ExitGate: Python's atexit, before the driver shuts down)
      // the thread stops for good: a trim or a query after the driver's own
      // exit handler would fail (CUDA_ERROR_DEINITIALIZED) and say so.
      ExitGate::parkIfClosed();
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (pending.empty() && queue_.empty()) {
          // Idle: wake for new work, or to trim the pools.
          cv_.wait_for(lock, std::chrono::milliseconds(kStagedIdleMs / 5));
        } else if (queue_.empty()) {
          cv_.wait_for(lock, pause);
        }
        for (auto& item : queue_) {
          pending.push_back(std::move(item));
        }
        queue_.clear();
      }
      ExitGate::parkIfClosed(); // (the wait may have outlasted the gate)
      ExitGate::Busy busy;
      bool progressed = false;
      for (size_t i = 0; i < pending.size();) {
        if (!poll(pending[i])) {
          ++i;
          continue;
        }
        progressed = true;
        pending[i] = std::move(pending.back());
        pending.pop_back();
      }
      pause = progressed ? microseconds(20)
                         : std::min(pause * 2, microseconds(1000));
      auto now = std::chrono::steady_clock::now();
      // Only checks that said no a while ago left (teardowns waiting on a
      // peer's events): sleep until the first is due.
      if (!progressed && !pending.empty() &&
          std::all_of(pending.begin(), pending.end(), [](const Item& i) {
            return static_cast<bool>(i.ready);
          })) {
        auto first = std::min_element(
                         pending.begin(),
                         pending.end(),
                         [](const Item& a, const Item& b) {
                           return a.nextAsk < b.nextAsk;
                         })
                         ->nextAsk;
        pause = std::max(
            pause, std::chrono::duration_cast<microseconds>(first - now));
      }
      if (now - lastTrim > std::chrono::milliseconds(kStagedIdleMs / 5)) {
        lastTrim = now;
        try {
          StagingPool::trimAll();
        } catch (const CudaError& e) {
          if (e.code() != CUDA_ERROR_DEINITIALIZED) { // exiting: not an error
            logWarning(
                std::string(
                    "torch_rpc_ext: could not free idle CUDA staging "
                    "memory: ") +
                e.what());
          }
        } catch (const std::exception& e) {
          logWarning(
              std::string(
                  "torch_rpc_ext: could not free idle CUDA staging "
                  "memory: ") +
              e.what());
        }
      }
    }
  }

  // Whether `item` is done with (its copy completed, or failed; or it had
  // nothing to wait for: runOnStagingThread()).
  static bool poll(Item& item) {
    if (item.ready) {
      auto now = std::chrono::steady_clock::now();
      if (now < item.nextAsk) {
        return false;
      }
      bool ready = true;
      try {
        ready = item.ready();
      } catch (const std::exception& e) {
        logWarning(
            std::string("torch_rpc_ext: a staging thread check threw: ") +
            e.what());
      }
      if (!ready) {
        item.backoff = std::clamp(
            item.backoff * 2,
            std::chrono::microseconds(1000),
            std::chrono::microseconds(100'000));
        item.nextAsk = now + item.backoff;
        return false;
      }
    }
    std::string error;
    if (item.copied) {
      try {
        CurrentDevice current(item.device);
        CUresult rc = libcuda().cuEventQuery(item.copied.get());
        if (rc == CUDA_ERROR_NOT_READY) {
          return false;
        }
        checkCuda("cuEventQuery", rc);
      } catch (const std::exception& e) {
        error = e.what();
      }
      item.copied.reset();
    }
    auto done = std::move(item.done);
    try {
      done(error);
    } catch (const std::exception& e) {
      logWarning(
          std::string("torch_rpc_ext: work on the staging thread threw: ") +
          e.what());
    }
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::thread thread_;
};

} // namespace

void runOnStagingThread(std::function<void()> fn) {
  StagingThread::get().add(
      {-1, nullptr, [fn = std::move(fn)](const std::string&) { fn(); }});
}

void runOnStagingThreadWhen(
    std::function<bool()> ready,
    std::function<void()> fn) {
  StagingThread::Item item{
      -1, nullptr, [fn = std::move(fn)](const std::string&) { fn(); }};
  item.ready = std::move(ready);
  StagingThread::get().add(std::move(item));
}

void whenComplete(
    int device,
    PooledEvent event,
    std::function<void(const std::string& error)> done) {
  StagingThread::get().add({device, std::move(event), std::move(done)});
}

void releaseAfter(int device, CUstream stream, std::function<void()> release) {
  PooledEvent done;
  try {
    CurrentDevice current(device);
    done = StagingPool::of(device).takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, done.get(), stream);
  } catch (const std::exception&) {
    // No event: wait for the stream here (what it failed with, the stream's
    // next use reports), so that nothing it still reads goes first.
    {
      CurrentDevice current(device);
      libcuda().cuStreamSynchronize(stream);
    }
    release();
    return;
  }
  StagingThread::get().add(
      {device,
       std::move(done),
       [release = std::move(release)](const std::string&) { release(); }});
}

} // namespace torch_rpc_ext::channel::cuda
