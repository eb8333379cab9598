// SPDX-License-Identifier: BSD-3-Clause
// Per-thread trace contexts (tracing.h).
#include "csrc/agent/tracing.h"

#include <mutex>

namespace torch_rpc_ext::tracing {

namespace {
thread_local std::string tOutgoing;
thread_local std::string tIncoming;
} // namespace

void setOutgoing(std::string traceparent) {
  tOutgoing = std::move(traceparent);
}

const std::string& outgoing() {
  return tOutgoing;
}

Incoming::Incoming(const std::string& traceparent)
    : set_(!traceparent.empty()) {
  if (set_) {
    tIncoming = traceparent;
  }
}

Incoming::~Incoming() {
  if (set_) {
    tIncoming.clear();
  }
}

const std::string& incoming() {
  return tIncoming;
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
