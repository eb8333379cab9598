// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <optional>

namespace torch_rpc_ext {

// How busy this host's CPUs have been lately: the share of the last ~10 s
// (0-100) during which some runnable task waited for a CPU, from Linux's
// pressure stall information (/proc/pressure/cpu, "some avg10"); -1 where
// the kernel does not report it. A peer that is silent while this is high
// is more likely starved than gone: the handshake and heartbeat timeouts
// (transport/stream/connection.cpp) and tcp_lanes' stall check
// (channel/lanes/lanes_watch.cpp) then give it more time.
double cpuPressurePercent();

// At or above this pressure a silent peer is presumed starved.
constexpr double kStarvedPressurePercent = 50.0;

// Tests only (`_testing.set_cpu_pressure`): what cpuPressurePercent() says
// instead of the kernel, for every check that asks it, until set to none.
void setCpuPressureForTests(std::optional<double> percent);

} // namespace torch_rpc_ext
