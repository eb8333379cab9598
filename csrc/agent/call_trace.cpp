// SPDX-License-Identifier: BSD-3-Clause
// The agent's per-call stamps (call_trace.h).
#include "csrc/agent/call_trace.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace torch_rpc_ext::call_trace {

namespace {

struct Stamp {
  int64_t id;
  int64_t ns;
  int point;
};

std::array<Stamp, kRing>& ring() {
  static std::array<Stamp, kRing> r{};
  return r;
}
std::atomic<uint64_t> next{0};

} // namespace

bool on() {
  static const bool enabled = [] {
    const char* v = std::getenv("TORCH_RPC_EXT_CALL_TRACE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return enabled;
}

void stampAlways(int64_t id, Point point) {
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now().time_since_epoch())
                         .count();
  ring()[next.fetch_add(1, std::memory_order_relaxed) % kRing] =
      Stamp{id, ns, static_cast<int>(point)};
}

std::vector<std::tuple<int64_t, int, int64_t>> take() {
  const uint64_t end = next.exchange(0);
  const uint64_t begin = end > kRing ? end - kRing : 0;
  std::vector<std::tuple<int64_t, int, int64_t>> out;
  out.reserve(end - begin);
  for (uint64_t i = begin; i < end; ++i) {
    const Stamp& s = ring()[i % kRing];
    out.emplace_back(s.id, s.point, s.ns);
  }
  return out;
}

} // namespace torch_rpc_ext::call_trace
