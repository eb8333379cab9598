// SPDX-License-Identifier: BSD-3-Clause
// The callee's work in the caller's torch.profiler (Kineto) trace
// (docs/profiling.md).
//
// Upstream profiles the worker of an RPC only under the legacy autograd
// profiler: the caller wraps the request in RUN_WITH_PROFILING_REQ, the
// callee serves it under a thread-local legacy profiler and sends its events
// back. Under Kineto it profiles the caller alone. This agent sends the same
// wrapped request when Kineto profiles the calling thread, so the callee is
// upstream's (any TORCH_RPC_EXT worker serves it, nothing of Kineto starts
// there); on the response it unwraps the original reply and reports into
// the caller's profiler:
//   - torch_rpc_ext::encode and torch_rpc_ext::send, ranges on the calling
//     thread (around encoding and handing the frame to the transport);
//   - torch_rpc_ext::wait (sent .. response read) and torch_rpc_ext::decode
//     (unwrapping the reply and its events), and every range the callee
//     recorded for the call (operators, record_function ranges), on a
//     thread of this process named "rpc:<worker>": one track per remote
//     worker in the exported trace.
// Remote times are moved onto the caller's clock: unchanged when the
// callee's events fall inside the wait (one host, one clock), else shifted by
// the NTP estimate ((first - sent) + (last - received)) / 2 of the call with
// the shortest round trip seen from that peer, and clamped into the wait.
// Calls made while no Kineto profiler runs on the calling thread take none
// of this: one thread-local read in send().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/rpc/message.h>

#include "csrc/common/thread_pool.h"

namespace torch_rpc_ext {

// A range of the callee, in microseconds.
struct Range {
  std::string name;
  int64_t startUs;
  int64_t endUs;
};

// What a profiled call keeps from send() to its response.
struct CallProfile {
  at::ThreadLocalState callerState; // the caller's profiler, for reporting
  int64_t sentUs = 0; // set by markSent()
};

class RemoteProfiling {
 public:
  // Caller thread: whether Kineto profiles this thread and `message` is a
  // call whose callee can be profiled; then wraps `message` for the callee.
  static std::shared_ptr<CallProfile> begin(
      c10::intrusive_ptr<torch::distributed::rpc::Message>& message);

  // The wait starts: the frame is about to be handed to the transport.
  static void markSent(CallProfile* profile);

  // A range on the calling thread while profiling; a no-op otherwise.
  static std::unique_ptr<at::RecordFunction> span(
      const CallProfile* profile,
      const char* name);

  // Called when the response to a profiled call has been read: on the
  // track thread of `peerName`, under the caller's profiler, report the
  // wait, the callee's events and the decode, then call `complete(reply)`
  // with the unwrapped reply (outside the caller's profiler state), so the
  // caller's future completes after the events are in its profile.
  // `complete` must not block: it should hand the completion to a thread
  // that may (the track has one thread). Never throws.
  // `incarnation`: the peer process's (membership.h), which its clock
  // estimate belongs to (a rank taken by a new process, elsewhere perhaps,
  // starts a new one).
  void finish(
      int32_t peerId,
      uint64_t incarnation,
      const std::string& peerName,
      std::shared_ptr<CallProfile> profile,
      c10::intrusive_ptr<torch::distributed::rpc::Message> response,
      std::function<void(c10::intrusive_ptr<torch::distributed::rpc::Message>)>
          complete);

  // A profiled call that ends with no response (timed out, its connection
  // lost, the agent stopping): its wait, from the send to now, under the
  // caller's profiler, on the track of the thread that found the failure
  // (the agent's timer thread for a timeout, a loop thread for a lost
  // connection), not the remote worker's. Any thread; never throws.
  static void reportUnanswered(
      const CallProfile& profile,
      const std::string& peerName);

  // Join the track threads (agent shutdown). Idempotent.
  void stop();

 private:
  struct ClockSample {
    int64_t offsetUs = 0; // callee clock - caller clock
    int64_t roundTripUs = 0;
  };
  ThreadPool& trackOf(int32_t peerId);
  // Track thread: callee times -> caller times (see above).
  void toCallerClock(
      int32_t peerId,
      uint64_t incarnation,
      std::vector<Range>& ranges,
      int64_t sentUs,
      int64_t readUs);

  std::mutex mutex_;
  // The best sample per peer process: its rank and incarnation (0 for
  // every member of a static group; a dynamic group's new process on a
  // rank has a new one).
  std::map<std::pair<int32_t, uint64_t>, ClockSample> clocks_;
  bool stopped_ = false;
  std::unordered_map<int32_t, std::unique_ptr<ThreadPool>> tracks_;
};

} // namespace torch_rpc_ext
