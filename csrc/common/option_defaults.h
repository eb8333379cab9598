// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

// The one place that states the default and the limits of every
// RpcExtBackendOptions field. AgentOptions (agent/options.h) and
// transport::TransportOptions initialize from these; _C.option_spec()
// publishes them in Python units, and torch_rpc_ext/options.py takes its
// signature defaults and its validation bounds from there.
// tests/unit/test_options.py checks that README.md states the same values.
//
// Limits are inclusive. rpc_timeout's and init_method's defaults are
// torch's own (rpc::RpcBackendOptions), not repeated here.
namespace torch_rpc_ext {

// Core threads of the agent's pool. Equal to torch's default
// (agent/options.h asserts it).
inline constexpr int kDefaultNumWorkerThreads = 16;
inline constexpr int kMinNumWorkerThreads = 1;

// 0 means no timeout.
inline constexpr float kMinRpcTimeoutSeconds = 0;

// A secret the user gives must have at least this many bytes; none given
// means one is created at rendezvous.
inline constexpr size_t kMinSecretBytes = 16;

// Largest frame accepted or sent.
inline constexpr uint64_t kDefaultMaxFrameBytes = uint64_t(1) << 34; // 16 GiB
inline constexpr uint64_t kMinMaxFrameBytes = 1024;

// Time a new connection has to authenticate.
inline constexpr std::chrono::milliseconds kDefaultHandshakeTimeout{10000};
inline constexpr std::chrono::milliseconds kMinHandshakeTimeout{1};

// Silence after which a connection is declared dead. 0 disables the
// heartbeat and is always accepted; any other value is at least the minimum.
inline constexpr std::chrono::milliseconds kDefaultHeartbeatTimeout{10000};
inline constexpr std::chrono::milliseconds kMinHeartbeatTimeout{50};

// Busy-polling of a loop thread for its next input; 0 never polls.
inline constexpr std::chrono::microseconds kDefaultBusyPoll{200};
inline constexpr std::chrono::microseconds kMinBusyPoll{0};
inline constexpr std::chrono::microseconds kMaxBusyPoll{10000};
// poll_on_caller_cpu unset: on where the process may run on at most this
// many CPUs (a lone call's caller, its loop and the peer's loop outnumber
// them; docs/performance.md, "The poll on the caller's CPU").
inline constexpr int kFollowCallerMaxCpus = 2;

// Idle receive buffers kept for reuse.
inline constexpr uint64_t kDefaultMaxCachedReceiveBytes = uint64_t(1) << 31;
// Device memory cuda_ipc's blocks may hold per device (0: no bound). Blocks
// live beside torch's cache, idle ones for 5 s: the bound keeps them from
// crowding out the user's tensors.
inline constexpr uint64_t kDefaultCudaIpcMemoryLimit = uint64_t(2) << 30;
inline constexpr uint64_t kMinMaxCachedReceiveBytes = 0;
// Frame rings (transport/stream/frame_ring.h): the bytes of each direction
// of an shm connection's ring; 0 keeps its frames on the socket. A multiple
// of 4 KiB. Small: what a ring holds is frames in flight, not tensors (the
// shm channels carry those), and a host of N workers maps N x (N - 1).
inline constexpr uint64_t kDefaultShmFrameRingBytes = 64 * 1024;
inline constexpr uint64_t kMinShmFrameRingBytes = 64 * 1024;
inline constexpr uint64_t kMaxShmFrameRingBytes = uint64_t(64) << 20;

// Not a Python option: how long init waits for all peers to publish their
// address.
inline constexpr std::chrono::milliseconds kDefaultRendezvousTimeout{300000};

} // namespace torch_rpc_ext
