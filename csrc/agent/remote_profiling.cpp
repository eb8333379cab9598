// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/remote_profiling.h"

#include <pthread.h>

#include <algorithm>
#include <map>
#include <vector>

#include <c10/util/ApproximateClock.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/csrc/distributed/autograd/rpc_messages/rpc_with_profiling_req.h>
#include <torch/csrc/distributed/autograd/rpc_messages/rpc_with_profiling_resp.h>
#include <torch/csrc/distributed/rpc/profiler/remote_profiler_manager.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include "csrc/agent/torch_version.h"

namespace torch_rpc_ext {

namespace {

namespace rpc = torch::distributed::rpc;
namespace autograd = torch::distributed::autograd;
namespace profiler = torch::profiler::impl;
using torch::autograd::profiler::LegacyEvent;

int64_t nowUs() {
  return c10::getTime() / 1000; // the clock Kineto's own events use
}

bool profilable(rpc::MessageType type) {
  switch (type) {
    case rpc::MessageType::SCRIPT_CALL:
    case rpc::MessageType::PYTHON_CALL:
    case rpc::MessageType::SCRIPT_REMOTE_CALL:
    case rpc::MessageType::PYTHON_REMOTE_CALL:
    case rpc::MessageType::FORWARD_AUTOGRAD_REQ:
      return true;
    default:
      return false;
  }
}

// The callee's push/pop pairs as ranges (marks and unmatched halves, e.g. of
// a range still open when the response left, are dropped).
std::vector<Range> rangesOf(const std::vector<LegacyEvent>& events) {
  std::map<std::pair<uint64_t, at::RecordFunctionHandle>, const LegacyEvent*>
      open;
  std::vector<Range> out;
  for (const auto& e : events) {
    auto key = std::make_pair(e.threadId(), e.handle());
    if (e.kind() == torch::autograd::profiler::EventKind::PushRange) {
      open[key] = &e;
    } else if (e.kind() == torch::autograd::profiler::EventKind::PopRange) {
      auto it = open.find(key);
      if (it != open.end()) {
        out.push_back(
            Range{
                it->second->name(),
                static_cast<int64_t>(it->second->cpuUs()),
                static_cast<int64_t>(e.cpuUs())});
        open.erase(it);
      }
    }
  }
  return out;
}

void report(const Range& r, const std::string& backend, at::RecordScope scope) {
  torch::autograd::profiler::reportBackendEventToActiveKinetoProfiler(
      r.startUs, r.endUs, /*debug_handle=*/-1, scope, r.name, backend);
}

} // namespace

void RemoteProfiling::toCallerClock(
    int32_t peerId,
    uint64_t incarnation,
    std::vector<Range>& ranges,
    int64_t sentUs,
    int64_t readUs) {
  if (ranges.empty()) {
    return;
  }
  int64_t first = ranges.front().startUs, last = ranges.front().endUs;
  for (const auto& r : ranges) {
    first = std::min(first, r.startUs);
    last = std::max(last, r.endUs);
  }
  // This call's NTP sample: the offset, and the round trip it is good to
  // (wait minus the callee's work). The sample with the shortest round trip
  // seen from this peer is the best estimate (as NTP filters).
  ClockSample sample{
      ((first - sentUs) + (last - readUs)) / 2,
      (readUs - sentUs) - (last - first)};
  ClockSample best;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, fresh] =
        clocks_.emplace(std::make_pair(peerId, incarnation), sample);
    if (!fresh && sample.roundTripUs < it->second.roundTripUs) {
      it->second = sample;
    }
    best = it->second;
  }
  if (first >= sentUs && last <= readUs) {
    return; // consistent with one clock: nothing to correct
  }
  for (auto& r : ranges) {
    r.startUs = std::clamp(r.startUs - best.offsetUs, sentUs, readUs);
    r.endUs = std::clamp(r.endUs - best.offsetUs, r.startUs, readUs);
  }
}

std::shared_ptr<CallProfile> RemoteProfiling::begin(
    c10::intrusive_ptr<rpc::Message>& message) {
  if (profiler::profilerType() != profiler::ActiveProfilerType::KINETO ||
      torch_version::globalProfilerActive() || !profilable(message->type())) {
    return nullptr;
  }
  auto profile = std::make_shared<CallProfile>();
  message = autograd::RpcWithProfilingReq(
                rpc::MessageType::RUN_WITH_PROFILING_REQ,
                std::move(message),
                torch::autograd::profiler::ProfilerConfig(
                    torch::autograd::profiler::ProfilerState::CPU),
                rpc::RemoteProfilerManager::getInstance().getNextProfilerId())
                .toMessage();
  return profile;
}

void RemoteProfiling::markSent(CallProfile* profile) {
  if (profile != nullptr) {
    profile->sentUs = nowUs();
  }
}

std::unique_ptr<at::RecordFunction> RemoteProfiling::span(
    const CallProfile* profile,
    const char* name) {
  std::unique_ptr<at::RecordFunction> range;
  if (profile != nullptr) {
    range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (range->isActive()) {
      range->before(name);
    }
  }
  return range;
}

ThreadPool& RemoteProfiling::trackOf(int32_t peerId) {
  auto& pool = tracks_[peerId];
  if (!pool) {
    pool = std::make_unique<ThreadPool>(1, 1);
  }
  return *pool;
}

void RemoteProfiling::finish(
    int32_t peerId,
    uint64_t incarnation,
    const std::string& peerName,
    std::shared_ptr<CallProfile> profile,
    c10::intrusive_ptr<rpc::Message> response,
    std::function<void(c10::intrusive_ptr<rpc::Message>)> complete) {
  int64_t readUs = nowUs();
  auto task = [this,
               peerId,
               incarnation,
               peerName,
               profile = std::move(profile),
               readUs,
               response = std::move(response),
               complete = std::move(complete)](bool onTrack) mutable {
    if (onTrack) {
      // Kineto names a track after its thread: "thread N (rpc:<worker>)"
      // (at most 15 characters: longer worker names are cut). Named again
      // when the rank's worker is another (an elastic group's new member).
      static thread_local std::string namedFor;
      if (namedFor != peerName) {
        std::string threadName = ("rpc:" + peerName).substr(0, 15);
        pthread_setname_np(pthread_self(), threadName.c_str());
        namedFor = peerName;
      }
    }
    if (response->type() != rpc::MessageType::RUN_WITH_PROFILING_RESP) {
      // An error (the callee's, or one torch's profiling wrapper passed
      // on): no events came back, but the caller did wait (before session
      // 94 such a call showed only its encode and send).
      try {
        at::ThreadLocalStateGuard guard(profile->callerState);
        report(
            Range{"torch_rpc_ext::wait", profile->sentUs, readUs},
            "torch_rpc_ext:" + peerName,
            at::RecordScope::USER_SCOPE);
      } catch (const std::exception&) {
        // (the profiler stopped meanwhile: nothing to report to)
      }
      complete(std::move(response));
      return;
    }
    c10::intrusive_ptr<rpc::Message> reply;
    try {
      // The caller's profiler is the active one here, for this block only:
      // the caller's callbacks run elsewhere (complete()), unprofiled.
      at::ThreadLocalStateGuard guard(profile->callerState);
      auto wrapped = autograd::RpcWithProfilingResp::fromMessage(*response);
      std::vector<Range> ranges = rangesOf(wrapped->getProfiledEvents());
      reply = std::move(*std::move(*wrapped).moveWrappedRpc()).toMessage();
      reply->setId(response->id());
      int64_t decodedUs = nowUs();
      const std::string backend = "torch_rpc_ext:" + peerName;
      toCallerClock(peerId, incarnation, ranges, profile->sentUs, readUs);
      report(
          Range{"torch_rpc_ext::wait", profile->sentUs, readUs},
          backend,
          at::RecordScope::USER_SCOPE);
      for (const auto& r : ranges) {
        report(r, backend, at::RecordScope::FUNCTION);
      }
      report(
          Range{"torch_rpc_ext::decode", readUs, decodedUs},
          backend,
          at::RecordScope::USER_SCOPE);
    } catch (const std::exception& e) {
      // The reply, if it was read, still completes the call: only its
      // events are lost (e.g. an on-demand profiler started meanwhile).
      if (!reply) {
        reply = rpc::createExceptionResponse(
            std::string(
                "torch_rpc_ext: a profiled response could not be "
                "read: ") +
                e.what(),
            response->id());
      }
    }
    complete(std::move(reply));
  };
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopped_) {
    lock.unlock();
    task(/*onTrack=*/false);
    return;
  }
  trackOf(peerId).run([task = std::move(task)]() mutable { task(true); });
}

void RemoteProfiling::reportUnanswered(
    const CallProfile& profile,
    const std::string& peerName) {
  if (profile.sentUs == 0) {
    return; // never sent: no wait
  }
  try {
    at::ThreadLocalStateGuard guard(profile.callerState);
    report(
        Range{"torch_rpc_ext::wait", profile.sentUs, nowUs()},
        "torch_rpc_ext:" + peerName,
        at::RecordScope::USER_SCOPE);
  } catch (const std::exception&) {
    // (the profiler stopped meanwhile: nothing to report to)
  }
}

void RemoteProfiling::stop() {
  std::unordered_map<int32_t, std::unique_ptr<ThreadPool>> tracks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    tracks.swap(tracks_);
  }
  for (auto& [peer, pool] : tracks) {
    pool->stop();
  }
}

} // namespace torch_rpc_ext
