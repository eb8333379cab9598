// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

namespace torch_rpc_ext::call_trace {

// Where a small call's time goes (issue 48; docs/performance.md, "A small
// call, hand-off by hand-off"): with TORCH_RPC_EXT_CALL_TRACE=1 in the
// environment, the agent stamps every call at its hand-offs, caller and
// callee, with CLOCK_MONOTONIC nanoseconds (std::chrono::steady_clock here;
// Python's time.perf_counter_ns() reads the same clock, in every process of
// the host), into a ring of the last kRing stamps of this process.
// benchmarks/small_call_breakdown.py reads both ends' rings and joins them
// by call id. Off (the default): one read of a constant per point.
//
// The ring is written without a lock (a relaxed counter picks the slot): a
// measurement tool's, read when no call is in flight.
enum Point : uint8_t {
  kSendEntry = 0, // caller: Agent::send, torch's frontend done
  kEncoded, // caller: the request's frame made
  kWritten, // caller: the frame written (or queued) to the connection
  kRequestRead, // callee: the whole request read (Agent::onFrame)
  kServeStart, // callee: its thread starts the function (Server::serve)
  kServeDone, // callee: the function's future completed (Server::respond)
  kResponseWritten, // callee: the response's frame written (or queued)
  kResponseRead, // caller: the whole response read (Calls::respond)
  kCompleting, // caller: the call's future about to be completed
  kCompleted, // caller: completed, its callbacks run (torch's conversions)
  // callee: torch's request callback returned (Server::serve), its future
  // completed or not: it splits kServeStart..kServeDone into the function's
  // run and what follows (the future's completion, for a device-aware one
  // its events, and the stream waits of the callback that responds). Last,
  // so that the points above keep their numbers.
  kServeReturned,
  kPoints
};

constexpr size_t kRing = 1 << 16;

bool on();
void stampAlways(int64_t id, Point point);
inline void stamp(int64_t id, Point point) {
  if (on()) {
    stampAlways(id, point);
  }
}
// The stamps recorded (id, point, ns), oldest first, and an empty ring.
std::vector<std::tuple<int64_t, int, int64_t>> take();

} // namespace torch_rpc_ext::call_trace
