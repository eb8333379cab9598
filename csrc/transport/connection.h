// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "csrc/frame/frame.h"

namespace torch_rpc_ext::transport {

class Connection;

// What a connection reports upward. Every method runs on the transport's
// loop thread, must not block and must not take the GIL.
class ConnectionObserver {
 public:
  virtual ~ConnectionObserver() = default;

  // The handshake succeeded; conn.peerId() is now authenticated.
  virtual void onReady(const std::shared_ptr<Connection>& conn) = 0;

  // The head of a frame has arrived. Return where its segments go (one
  // pointer per entry of `segmentSizes`; nullptr where `provided` is true:
  // the transport then brings that segment's memory itself, in
  // InboundBuffers::provided). Throwing rejects the frame: the connection
  // closes with the exception's text as reason.
  virtual frame::InboundBuffers onFrameHead(
      Connection& conn,
      const std::string& head,
      const std::vector<uint64_t>& segmentSizes,
      const std::vector<bool>& provided) = 0;

  // Every segment of the frame is in place.
  virtual void onFrame(
      const std::shared_ptr<Connection>& conn,
      std::string head,
      frame::InboundBuffers buffers) = 0;

  // The connection is gone, reported exactly once. `reason` is empty only
  // for a local close() during shutdown.
  virtual void onClosed(Connection& conn, const std::string& reason) = 0;
};

// A reliable, ordered, authenticated stream of frames to one peer.
//
// Frames written before the handshake completes are queued and sent once it
// does. write() is thread-safe and never blocks: it writes what the socket
// takes at once and leaves the rest to the loop thread.
class Connection {
 public:
  virtual ~Connection() = default;

  // Queue `frame`. Returns false (and drops it) if the connection is closed.
  virtual bool write(frame::OutboundFrame frame) = 0;

  // Close now; queued frames are dropped. Idempotent.
  virtual void close(const std::string& reason) = 0;

  // True while a frame (or control frame) queued by write() is not yet
  // wholly handed to the socket (or, for a segment a channel carries on
  // sockets of its own, to those). A caller that wants its last frames to
  // reach the peer waits for false before close().
  virtual bool hasQueuedWrites() const = 0;

  // The peer's worker id once authenticated, else -1 (also after a close
  // that happened before authentication).
  virtual int32_t peerId() const = 0;
  // The peer's incarnation (handshake.h), once authenticated.
  virtual uint64_t peerIncarnation() const = 0;

  virtual bool isReady() const = 0;
  virtual bool isClosed() const = 0;
  // True for connections this process opened, false for accepted ones.
  virtual bool isOutbound() const = 0;

  // Why the connection closed ("" while open, or after a local close()).
  virtual std::string closeReason() const = 0;

  // True if it was closed because the peer broke the protocol (a frame
  // rejected by the transport or by the observer's onFrameHead).
  virtual bool rejectedPeer() const = 0;

  // True for an accepted connection that the peer closed before sending a
  // byte: a knock on the listener (Transport::knock, listenerAnswers; a
  // port scan, a load balancer's health check), not a failed handshake.
  virtual bool knockOnly() const {
    return false;
  }

  // Human-readable endpoints, for logs and errors.
  virtual std::string describe() const = 0;

  // How the bytes are protected on the wire once ready: the TLS version,
  // cipher and how the peer was authenticated (tls.h), or "" in the clear.
  virtual std::string security() const {
    return {};
  }

  // From an observer callback only: run `fn` on the calling (loop) thread
  // once the current round of reads is over: no thread hop. Unlike the
  // callbacks, `fn` may block and take the GIL: if it runs for more than a
  // couple of milliseconds, a new thread takes over the loop (stream/loop.h).
  // It is never dropped, not even by a concurrent shutdown. `expectMore`:
  // more input is likely soon (a request being served), so the loop may
  // busy-poll briefly (TransportOptions::busyPoll) before sleeping.
  virtual void runAfterDispatch(
      std::function<void()> fn,
      bool expectMore = false) = 0;

  // Any thread: a response is expected soon. A transport may start polling
  // for it now rather than be woken by it (TransportOptions::busyPoll).
  virtual void expectInput() = 0;

  // A graceful shutdown, the group idle: the connection's channels give
  // back what the peer holds of theirs (channel::Channel::settleFromLoop(),
  // on the loop); channelsSettled(), any thread: all have, or the
  // connection is closed.
  virtual void settleChannels() {}
  virtual bool channelsSettled() {
    return true;
  }
};

// From a thread running work handed to runAfterDispatch() (a request being
// served on a loop) that is about to make a call of its own: the loop goes
// to another thread now rather than after the stall the transport would
// wait for (a nested rpc_sync waits for a response that loop may have to
// read). Elsewhere, nothing.
void handOffServingLoop();

} // namespace torch_rpc_ext::transport
