// SPDX-License-Identifier: BSD-3-Clause
// Per-thread trace contexts (tracing.h).
#include "csrc/agent/tracing.h"

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

} // namespace torch_rpc_ext::tracing
