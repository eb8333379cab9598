// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// What a departed member of a dynamic group leaves behind in torch's RRef
// and distributed autograd state here (docs/elastic.md, "Incarnations"),
// and the requests that would reach for it:
//  - the forks of our RRefs it held: it will never delete them, so they
//    are dropped as it departs (release());
//  - the autograd contexts it created here: dropped with them;
//  - the RRefs we use that it owned: their values are gone, and a later
//    holder of its id must never be asked for them (refuse()).
//
// A fork id names the worker that forked the RRef, not the one holding it,
// so the guard attributes forks as messages pass (trackForks(),
// trackOwnForks()). Only a dynamic group's members depart: in a static
// group the guard does nothing but drop the forks of a message never
// delivered (dropCarried()).
//
// Threads: trackForks() runs on the pool threads serving requests,
// trackOwnForks() on senders' threads and pool threads writing responses,
// refuse() on senders' threads, release() on the membership watcher (or the
// thread joining or leaving). holdersMutex_ guards holders_; staleMutex_
// guards stale_. release() calls into torch's RRefContext and autograd
// container, which take their own locks, never under ours.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/rpc/message.h>
#include <torch/csrc/distributed/rpc/types.h>

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

class RRefGuard {
 public:
  // `self`, `selfName`: our worker id and name. `dynamicGroup`: whether
  // members can depart (else every call but dropCarried() is a no-op).
  // `offThread` runs a task on another thread (the agent's pool): Python
  // values are dropped there, with the GIL.
  RRefGuard(
      rpc::worker_id_t self,
      std::string selfName,
      bool dynamicGroup,
      std::function<void(std::function<void()>)> offThread)
      : self_(self),
        selfName_(std::move(selfName)),
        enabled_(dynamicGroup),
        offThread_(std::move(offThread)) {}

  // Whether torch's RRef state may be touched: set once torch has made us
  // its agent, cleared before it tears that state down.
  void setLive(bool live) {
    running_.store(live);
    live_.store(live && enabled_);
  }

  // A request served: a fork request registers a fork that `from` holds;
  // a user deletion forgets one.
  void trackForks(const rpc::Message& request, rpc::worker_id_t from);
  // A message we send to `to`: the forks of our RRefs that we minted
  // ourselves and that it carries (pickled) are held by `to`. Returns
  // those forks: where `to` departed before they were attributed to it (a
  // response pickled after its requester's death was applied), release()
  // has run already, and the caller drops them (dropForks).
  std::vector<rpc::ForkId> trackOwnForks(
      const rpc::Message& message,
      rpc::worker_id_t to);
  // Forks of ours whose holder departed: dropped now, as release() drops
  // those it knows of.
  void dropForks(const std::vector<rpc::ForkId>& forks);
  // A message carrying forks of ours that will never be sent or delivered
  // (its destination departed, it was refused as too large): they are
  // dropped, since nobody will hold them. In any group, static too; forks
  // already attributed to a holder are dropForks()'.
  void dropCarried(const rpc::Message& message);
  // A message that reached nobody (no connection for it, one that refused
  // it or closed before queueing it): `attributed`, the forks trackOwnForks()
  // attributed to its destination, and those it carries otherwise go (kept,
  // they held a graceful shutdown 100 s: "Leaking RRef").
  void dropUndelivered(
      const std::vector<rpc::ForkId>& attributed,
      const rpc::Message& message) {
    dropForks(attributed); // (a dynamic group's)
    dropCarried(message);
  }
  // dropUndelivered() for a message whose frame its connection queued and
  // then dropped unwritten (frame::OutboundFrame::ifUnsent), while `owner`
  // (the agent that holds us) lives. The frame's keepAlive holds `message`
  // too, so this never drops its last reference on a loop thread.
  std::function<void()> ifUnsent(
      std::weak_ptr<void> owner,
      std::vector<rpc::ForkId> attributed,
      c10::intrusive_ptr<rpc::Message> message);
  // What trackForks() does once it has parsed a request (torch's parser
  // needs a running agent): `holder` registered `forkId`, or deleted it.
  void forkRegistered(const rpc::ForkId& forkId, rpc::worker_id_t holder);
  void forkDeleted(const rpc::ForkId& forkId);
  // A remote() request that arrived whole but could not land here (its
  // tensors: devices.h, ReceiveFailure): as for a function that fails, its
  // OwnerRRef is made holding `error` and the reply is the usual RemoteRet,
  // so the caller's fork is confirmed and to_here() raises `error` (a plain
  // exception response would leave the caller's pending fork behind, and
  // to_here() waiting out its timeout); also one wrapped for dist autograd
  // or the legacy profiler. `request` carries the payload and placeholders
  // for the tensors. Null for any other request, or if the request does
  // not parse.
  static c10::intrusive_ptr<rpc::Message> failRemote(
      const rpc::Message& request,
      const std::string& error);
  // Who holds `forkId` of our RRefs, as the guard knows it: the worker it
  // was attributed to, else the one that minted it.
  rpc::worker_id_t holderOf(const rpc::ForkId& forkId) const;

  // Member `departed` left or died (`why`: the reason calls to it fail
  // with): drop the forks it held and the autograd contexts it created,
  // mark the RRefs it owned stale. Never throws (a failure is logged).
  void release(
      rpc::worker_id_t departed,
      const std::string& name,
      const std::string& why);

  // A request naming an RRef a departed member owned (a fetch, fork or
  // deletion, sent to a later holder of its id): a completed future (an
  // error; a deletion succeeds), or null for any other message. `devices`:
  // the future's.
  c10::intrusive_ptr<c10::ivalue::Future> refuse(
      const std::string& to,
      const rpc::Message& message,
      const std::vector<c10::Device>& devices);

  // rpc_ext.membership.dropped_* (get_metrics; dynamic groups).
  void addMetrics(std::unordered_map<std::string, std::string>& m) const;

 private:
  const rpc::worker_id_t self_;
  const std::string selfName_;
  const bool enabled_;
  const std::function<void(std::function<void()>)> offThread_;
  std::atomic<bool> live_{false};
  std::atomic<bool> running_{false}; // torch's RRef state is up (any group)
  void dropNow(const std::vector<rpc::ForkId>& forks);
  // The holders of forks of our RRefs whose ids do not name them: those
  // registered by a fork request, by the worker that sent it, and those we
  // forked ourselves, by the peer the message that carried them went to.
  mutable std::mutex holdersMutex_;
  std::unordered_map<rpc::ForkId, rpc::worker_id_t, rpc::ForkId::Hash> holders_;
  // RRefs a departed member owned, with why it departed.
  std::mutex staleMutex_;
  std::unordered_map<rpc::RRefId, std::string, rpc::RRefId::Hash> stale_;
  std::atomic<bool> hasStale_{false};
  // Our forks, minted by us, that `message` carries and that nobody holds
  // yet; attributed to `to`, if given. Takes holdersMutex_ (after torch's
  // RRef lock, never under it: release() takes them in that order).
  std::vector<rpc::ForkId> claimCarried(
      const rpc::Message& message,
      std::optional<rpc::worker_id_t> to);
  // torch's owner forks that `drop` picks, dropped; returns how many.
  size_t dropOwnerForks(const std::function<bool(const rpc::ForkId&)>& drop);
  std::atomic<uint64_t> droppedForks_{0};
  std::atomic<uint64_t> droppedAutogradContexts_{0};
};

// The forks among `forks` (of our RRefs, minted by us, worker `self`) whose
// fork data `payload` carries as Python's or TorchScript's pickler writes
// it. (RRefGuard::trackOwnForks; apart, so tests can drive it with bytes.)
std::vector<rpc::ForkId> forksCarried(
    std::string_view payload,
    rpc::worker_id_t self,
    const std::vector<std::pair<rpc::RRefId, rpc::ForkId>>& forks);

} // namespace torch_rpc_ext
