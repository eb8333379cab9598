// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The requests a worker is serving, from when one is read until its answer
// is written (or dropped): the callee's side of the calls in flight
// (call_table.h). What torch_rpc_ext.metrics.requests_being_served and the
// metrics endpoint's /serving list: when a job hangs on a call, its callee
// says which requests it holds, from whom, in what stage and on which
// thread, and for how long (docs/observability.md, "Requests being
// served"). A request's id is the one its caller's calls_in_flight shows.
//
// Entries live in one list in arrival order, so the oldest are its head (a
// listing walks `limit` entries, never the whole table); a removed entry's
// node is kept for the next request (list splices: no allocation once as
// many requests have been served at once as ever will be, up to kMaxSpare).
//
// Threads: add() runs on the loop thread that read a request; enter() on
// the thread serving it at each stage; remove() on the thread its answer
// completes on; oldest() and the rest on a scrape's. mutex_ guards both
// lists and an entry's place in them; an entry's stage and thread are one
// atomic word, set without it (a listing reads it once: a stage a moment
// old at worst, never one stage with another's thread). enter() must come
// before the entry's remove(): the server's stages are ordered by the
// request's future (server.cpp), a resumed handler's by its continuation
// (serve_callback.cpp).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "csrc/agent/latency.h"

namespace torch_rpc_ext {

struct Peer; // membership.h

class ServingTable {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Stage : uint8_t {
    kQueued, // read; its serve waits for the loop's read pass to end
    kRunning, // in its handler (a Python function runs, an operator...)
    // The handler returned a future not yet complete (an
    // @async_execution function's, or RRef arguments awaiting their
    // owner's confirmation, until the function runs): no thread holds it.
    kWaiting,
    kResponding, // its answer is being encoded and written
  };
  static const char* stageName(Stage stage);

  struct Entry {
    int64_t id = 0;
    const Peer* caller = nullptr; // peers live as long as the agent
    CallKind kind = CallKind::kOther;
    Clock::time_point arrived{};
    // The stage (low byte) and the Linux id of the thread in the handler or
    // writing the answer (above it; as threading.get_native_id() and gdb
    // show it; 0: none).
    std::atomic<uint64_t> state{0};
  };
  // Where a request's entry is, from add() to remove() (list iterators stay
  // valid across splices).
  using Ticket = std::list<Entry>::iterator;

  // A request just read: its entry, and its arrival (now, read under the
  // lock so that the list stays in arrival order).
  std::pair<Ticket, Clock::time_point> add(
      int64_t id,
      const Peer* caller,
      CallKind kind);
  // The request moves to `stage`; its thread is the caller's for kRunning
  // and kResponding, none otherwise.
  static void enter(Ticket ticket, Stage stage);
  // The request's handler returned on this thread with its answer not ready:
  // waiting, unless the entry moved on meanwhile (a handler whose work
  // resumed on another thread marked it running there: serve_callback.cpp).
  static void leaveRunning(Ticket ticket);
  // While a request's handler runs (Server::serve), its entry is the
  // calling thread's: a handler whose work resumes later on another thread
  // (RRef arguments awaiting their owner's confirmation) takes it along to
  // mark itself running there. Nests (a handler may serve another request
  // while it waits on a call of its own).
  class InHandler {
   public:
    explicit InHandler(Ticket ticket);
    ~InHandler();
    InHandler(const InHandler&) = delete;
    InHandler& operator=(const InHandler&) = delete;

   private:
    std::optional<Ticket> outer_;
  };
  // The entry of the request whose handler the calling thread runs, if any.
  static std::optional<Ticket> inHandler();
  // Its answer went (or was dropped): the entry goes. Once per add().
  void remove(Ticket ticket);

  size_t size() const;
  // When the oldest request still served arrived; nullopt if none is.
  std::optional<Clock::time_point> oldestArrival() const;
  // A request being served as oldest() lists it.
  struct Serving {
    int64_t id = 0;
    const Peer* caller = nullptr;
    CallKind kind = CallKind::kOther;
    Clock::time_point arrived{};
    Stage stage = Stage::kQueued;
    int32_t thread = 0;
  };
  // The `limit` requests served longest, oldest first, and how many are
  // being served in all.
  std::pair<std::vector<Serving>, size_t> oldest(size_t limit) const;

  // Nodes kept for reuse past a burst (about 100 bytes each).
  static constexpr size_t kMaxSpare = 1024;

 private:
  mutable std::mutex mutex_;
  std::list<Entry> live_; // arrival order
  std::list<Entry> spare_;
};

} // namespace torch_rpc_ext
