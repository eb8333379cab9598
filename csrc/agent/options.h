// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include "csrc/agent/faults.h"
#include "csrc/channel/registry.h"
#include "csrc/common/option_defaults.h"
#include "csrc/transport/registry.h"

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

static_assert(
    kDefaultNumWorkerThreads == rpc::kDefaultNumWorkerThreads,
    "num_worker_threads defaults to torch's value");

// Everything the agent takes from RpcExtBackendOptions. It is the C++ base
// of that Python class (bound as _C._RpcExtBackendOptionsBase, a subclass of
// torch's RpcBackendOptions, as TensorPipe's options are), so the options
// given to init_rpc reach Agent::create as they are. Defaults come from
// csrc/common/option_defaults.h; torch_rpc_ext/options.py checks values
// against the limits there before storing them. rpcTimeoutSeconds and
// initMethod are RpcBackendOptions' fields, with torch's defaults.
struct AgentOptions : rpc::RpcBackendOptions {
  AgentOptions() = default;
  // Throws if rpcTimeoutSeconds < 0 (RpcBackendOptions).
  AgentOptions(float rpcTimeoutSeconds, std::string initMethod)
      : rpc::RpcBackendOptions(rpcTimeoutSeconds, std::move(initMethod)) {}

  int numWorkerThreads = kDefaultNumWorkerThreads;
  // Transports by preference; the first one both peers have is used.
  std::vector<std::string> transports = transport::transportNames();
  // Channels for CPU tensor bytes by preference (channel/registry.h); the
  // stream carries what none of them takes. Empty: the stream carries all.
  std::vector<std::string> channels =
      channel::defaultChannelNames(channel::DeviceKind::kCpu);
  // tcp_lanes besides, on encrypted connections only (the Python options
  // set it when `channels` is left at its default): across hosts with TLS
  // one stream is bound by the cipher on one thread at each end; lanes
  // spread it. Lanes listed in `channels` serve every TCP connection.
  bool lanesWhenEncrypted = false;
  // Channels for CUDA tensor bytes by preference, used by an agent with
  // devices: cuda_ipc (same host), cuda_staged (any peer, through host
  // memory). Never empty when devices are in use.
  std::vector<std::string> deviceChannels =
      channel::channelNames(channel::DeviceKind::kCuda);
  // Address to bind and advertise; empty means defaultAdvertisedAddress().
  std::string address;
  // Shared secret; empty means "create one at rendezvous, share via store".
  std::string secret;
  // TLS on TCP connections (transport/tls.h): "auto" (peers whose address
  // is not loopback), "always", "off"; mutual TLS with these PEM files when
  // tlsCert is set, else a key derived from the secret.
  std::string encryption = "auto";
  std::string tlsCert;
  std::string tlsKey;
  std::string tlsCa;
  // Mutual TLS: patterns one of a peer certificate's names must match
  // (TlsOptions::peerNames); empty: any the CA signed.
  std::vector<std::string> tlsPeerNames;
  // Networks whose refused proofs never hold their sources off
  // (AddressRanges; checked when set).
  std::vector<std::string> holdOffExempt;
  uint64_t maxFrameBytes = kDefaultMaxFrameBytes;
  std::chrono::milliseconds handshakeTimeout = kDefaultHandshakeTimeout;
  // See TransportOptions::heartbeatTimeout.
  std::chrono::milliseconds heartbeatTimeout = kDefaultHeartbeatTimeout;
  // See TransportOptions::busyPoll.
  std::chrono::microseconds busyPoll = kDefaultBusyPoll;
  // TransportOptions::followCaller; unset: where this process may run on at
  // most kFollowCallerMaxCpus CPUs (at init_rpc).
  std::optional<bool> pollOnCallerCpu;
  // Idle receive buffers kept for reuse (released after 2 s unused).
  uint64_t maxCachedReceiveBytes = kDefaultMaxCachedReceiveBytes;
  // See TransportOptions::frameRingBytes.
  uint64_t shmFrameRingBytes = kDefaultShmFrameRingBytes;
  // Test-only fault injection (torch_rpc_ext.testing); empty in production.
  FaultInjection faults;
  // CUDA (torch_rpc_ext/backend.py fills these from device_maps and
  // devices after checking them as TensorPipe does): the devices this agent
  // uses, its maps to each peer (its device -> the peer's), and the reverse
  // maps its responses follow (peer -> {our device: the peer's}).
  std::vector<c10::Device> devices;
  std::unordered_map<std::string, rpc::DeviceMap> deviceMaps;
  std::unordered_map<std::string, rpc::DeviceMap> reverseDeviceMaps;
  // Received CUDA tensors view the channel's device memory instead of a
  // copy in torch's allocator (AgentDevices::land): one device copy fewer,
  // but record_stream cannot see them (docs/guide.md, "Streams").
  bool cudaZeroCopy = false;
  // Per device, the torch memory pool the landing memory we grant peers is
  // allocated from (the landing pool, landing_pool.h;
  // torch_rpc_ext/_cuda/landing_pool.py makes them); empty: no grants.
  std::map<int, std::pair<unsigned long long, unsigned long long>> landingPools;
  // The shm transport admits local connections from processes of other
  // users too (by default, only our user's and root's: SO_PEERCRED).
  bool shmPeersAnyUser = false;
  // Bound, per device, on the device memory cuda_ipc's blocks hold in this
  // process (channel/cuda/device_memory.h); 0: none.
  uint64_t cudaIpcMemoryLimit = kDefaultCudaIpcMemoryLimit;
  // Limit on how long init waits for all peers to publish their address.
  std::chrono::milliseconds rendezvousTimeout = kDefaultRendezvousTimeout;
};

} // namespace torch_rpc_ext
