// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/common/option_defaults.h"
#include "csrc/common/source_strikes.h"
#include "csrc/transport/connection.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/tls.h"

namespace torch_rpc_ext::transport {

// What every transport needs to authenticate and bound its connections.
struct TransportOptions {
  int32_t selfId = 0;
  // Peers' worker ids are below this (the group's size); a peer that claims
  // another id is refused in the handshake, even if it knows the secret.
  // 0: any id.
  int32_t peerIdLimit = 0;
  // The group secret; both ends prove knowledge of it in the handshake.
  std::string secret;
  // This worker's incarnation (0 in a static group), proven in the
  // handshake, and the check of each peer's (handshake.h). Unset: any.
  uint64_t selfIncarnation = 0;
  AdmitFn admit;
  frame::FrameLimits limits;
  // A connection that has not authenticated within this time is closed.
  std::chrono::milliseconds handshakeTimeout = kDefaultHandshakeTimeout;
  // A ready connection that shows no sign of life (no byte received, none of
  // ours taken by the socket) for this long is closed, failing its calls.
  // Idle connections are pinged every heartbeatTimeout / 5. 0 disables it.
  std::chrono::milliseconds heartbeatTimeout = kDefaultHeartbeatTimeout;
  // After serving a request, a loop thread polls for the next input this
  // long before sleeping in the kernel: on a ping-pong workload that saves
  // the wake-up (tens of microseconds on a VM). Adaptive, see stream/loop.h.
  // 0 never spins.
  std::chrono::microseconds busyPoll = kDefaultBusyPoll;
  // Poll for a lone call's response on the calling thread's CPU
  // (stream::Loop::expectInput).
  bool followCaller = false;
  // A connection that passes descriptors (shm) sends its frames through a
  // shared ring of this many bytes instead of its socket (0: the socket).
  uint64_t frameRingBytes = kDefaultShmFrameRingBytes;
  // Address to bind and advertise (an IP literal), for transports that need
  // one; empty: the transport's default (stream/address.h).
  std::string bindAddress;
  // Receives the keepAlives of the outbound frames that finish (or are
  // dropped) on the loop thread, those of one flush together, so its owner
  // can destroy them elsewhere: dropping the last reference to a tensor that
  // has a Python object takes the GIL, which the loop thread must never do.
  // Unset: destroyed in place.
  std::function<void(std::vector<std::shared_ptr<void>>)> releaseOffLoop;
  // Encryption of connections for transports that cross hosts (tls.h); the
  // pre-shared key comes from `secret`.
  TlsOptions tls;
  // The channels a connection to a peer uses (channel/channel.h), asked
  // once the peer is known. Unset: every byte travels in the stream.
  channel::ChannelsFor channelsFor;
  // Accepted connections that have not authenticated yet, at most, in all
  // and from one source address (IP; every local socket counts as one):
  // past either, the oldest such connection is closed for the new one.
  size_t maxUnauthenticated = 512;
  size_t maxUnauthenticatedPerHost = 128;
  // Sources whose refused proofs never hold them off (SourceStrikes).
  AddressRanges holdOffExempt;
  // A local (Unix) socket is accepted from a process of our own user or
  // root only (SO_PEERCRED), unless this is set.
  bool localPeersAnyUser = false;
};

// Accepts connections for one transport until close().
class Listener {
 public:
  virtual ~Listener() = default;
  // The address peers pass to Transport::connect().
  virtual std::string address() const = 0;
  // Start accepting; accepted connections report to `observer`, which must
  // outlive the transport.
  virtual void start(ConnectionObserver* observer) = 0;
  virtual void close() = 0;
};

// A way of moving frames between two processes: the factory of listeners and
// connections, and the owner of their loop thread.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string name() const = 0;

  // Why this transport cannot work in this process ("" when it can): shm
  // needs memfds and an identity of this host. The agent goes on without a
  // transport that is not viable, and says why.
  virtual std::string unviableReason() const = 0;
  bool isViable() const {
    return unviableReason().empty();
  }

  // Two processes whose transports of one name report equal descriptors can
  // connect with it (TensorPipe's Context::domainDescriptor()): shm's names
  // this host's kernel and network namespace, tcp's is the same everywhere.
  virtual std::string domainDescriptor() const = 0;

  // Whether processes on other hosts can reach this transport's listeners
  // (the agent advertises such an address as its own).
  virtual bool crossesHosts() const = 0;

  // Whether its connections pass descriptors, so that channels which hand
  // over shared memory that way can use them.
  virtual bool passesDescriptors() const = 0;

  // Bind and listen now (connections wait in the backlog until start()).
  virtual std::shared_ptr<Listener> listen() = 0;

  // Open a connection to `address`, expecting to authenticate worker
  // `expectedPeerId`. Returns at once; writes queue until the handshake ends.
  virtual std::shared_ptr<Connection> connect(
      const std::string& address,
      int32_t expectedPeerId,
      ConnectionObserver* observer) = 0;

  // Whether something listens at `address` now: a connection to it is
  // accepted within `timeout` (no handshake; nothing is sent). A process
  // that died no longer listens; one that is alive, even stopped, does (its
  // kernel accepts for it).
  virtual bool listenerAnswers(
      const std::string& address,
      std::chrono::milliseconds timeout) const = 0;
  // Per address, a connect and a close, nothing sent (the peer sees a
  // socket close before its first byte), all at once: kAccepted within
  // `timeout`;
  // kRefused, with why as a connection's close reason would say it
  // ("connect to A failed: Connection refused"), if it is refused or reset
  // or its host unreachable; else kUnknown (no answer by then proves no
  // death: a lossy network or a full backlog delays it; nor does an error
  // of this host's own).
  struct Knock {
    enum Outcome { kAccepted, kRefused, kUnknown } outcome;
    std::string why;
  };
  virtual std::vector<Knock> knock(
      const std::vector<std::string>& addresses,
      std::chrono::milliseconds timeout) const = 0;

  // A graceful shutdown, the group idle: every live connection's channels
  // give back what its peer holds of theirs (Connection::settleChannels());
  // channelsSettled(): all have.
  virtual void settleChannels() {}
  virtual bool channelsSettled() {
    return true;
  }

  // Run `fn` on the transport's loop thread, soon (a health probe's task,
  // Connections::probeLoops; a test's stalled handler): false where it has
  // no loop or has stopped (`fn` is then dropped).
  virtual bool postToLoop(std::function<void()> fn) {
    return false;
  }

  // Close every listener and connection, then join the loop thread.
  virtual void stop() = 0;

  // Counters for RpcAgent::getMetrics(), by name.
  virtual std::map<std::string, uint64_t> counters() const = 0;
};

} // namespace torch_rpc_ext::transport
