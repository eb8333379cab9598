// SPDX-License-Identifier: BSD-3-Clause
// Per-thread trace contexts (tracing.h).
#include "csrc/agent/tracing.h"

#include <chrono>
#include <mutex>
#include <utility>

namespace torch_rpc_ext::tracing {

namespace {
thread_local std::string tOutgoing;
thread_local std::string tIncoming;
thread_local SendPhases tPhases;
thread_local Landing tLanding;
} // namespace

SendPhases& sendPhases() {
  return tPhases;
}

SendPhases takeSendPhases() {
  return std::exchange(tPhases, SendPhases{});
}

int64_t wallNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void setOutgoing(std::string traceparent) {
  tOutgoing = std::move(traceparent);
}

const std::string& outgoing() {
  return tOutgoing;
}

Incoming::Incoming(const std::string& traceparent, Landing landing)
    : set_(!traceparent.empty()) {
  if (set_) {
    tIncoming = traceparent;
    tLanding = landing;
  }
}

Incoming::~Incoming() {
  if (set_) {
    tIncoming.clear();
    tLanding = {};
  }
}

const std::string& incoming() {
  return tIncoming;
}

const Landing& incomingLanding() {
  return tLanding;
}

namespace {
thread_local ScriptNaming* tNaming = nullptr;
} // namespace

ScriptNaming::ScriptNaming(Sink sink)
    : sink_(std::move(sink)), outer_(tNaming) {
  tNaming = this;
}

ScriptNaming::~ScriptNaming() {
  tNaming = outer_;
}

bool ScriptNaming::wanted() {
  return tNaming != nullptr && tNaming->sink_;
}

void ScriptNaming::named(const std::string& name) {
  if (!wanted()) {
    return;
  }
  Sink sink = std::exchange(tNaming->sink_, nullptr);
  sink(name);
}

namespace {
std::mutex hookMu;
std::shared_ptr<const ServeHook> hook; // replaced whole, read under hookMu
} // namespace

void setServeHook(ServeHook h) {
  auto fresh = h ? std::make_shared<const ServeHook>(std::move(h)) : nullptr;
  std::lock_guard<std::mutex> lock(hookMu);
  hook = std::move(fresh);
}

std::unique_ptr<ServeSpan> beginServe(
    const std::string& traceparent,
    const std::string& name) {
  std::shared_ptr<const ServeHook> h;
  {
    std::lock_guard<std::mutex> lock(hookMu);
    h = hook;
  }
  return h ? (*h)(traceparent, name) : nullptr;
}

} // namespace torch_rpc_ext::tracing
