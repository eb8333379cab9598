// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// A wake-up between two processes that neither side can turn into a
// blocking call for the other: one end each of a Unix stream socket pair,
// a byte sent for "look again".
//
// Why not an eventfd (or a pipe): a descriptor handed to a peer shares its
// open file description, flags included, so the peer can clear O_NONBLOCK
// or fill it to its maximum, and our next read() or write() on it blocks the
// loop or staging thread that made it. Here every send and receive passes
// MSG_DONTWAIT, which no flag of the descriptor overrides: no call blocks,
// whatever the peer does to an end it holds (the frame ring's receiver
// reads the end the sender made and handed it; the rings' senders read an
// end they never hand out). What a peer can still do is shut its end
// down (our end then reads as ended: drainSignals() says so, and the caller
// stops watching it), pass descriptors with a byte (refused the same way)
// or send bytes in bulk (a drain reads up to 256 KiB,
// more than a Unix socket's send buffer holds by default, so a flood costs
// a drain per 256 KiB sent). Used by the frame ring, the shm_ring channel
// and the cuda_ring channel (docs/wire-format.md, docs/security.md).

namespace torch_rpc_ext {

struct SignalPair {
  int ours = -1; // kept: readable when the other side signalled
  int theirs = -1; // handed to the peer (SCM_RIGHTS)
};

// A new pair (both ends non-blocking, close-on-exec). Throws
// std::runtime_error naming the failing call.
SignalPair makeSignalPair();

// Signal the other end. True if a byte went out or signals are pending
// already (the socket's buffer is full); false if the other end is gone or
// the send failed otherwise (errno set).
bool sendSignal(int fd);

// What a drain found.
enum class SignalDrain {
  kOpen, // signals (or none): keep watching
  kEnded, // the other end closed or shut down its sending side: the
          // descriptor stays readable for good, so stop watching it
  kDescriptors, // a byte carried descriptors (closed off this thread,
                // fd_closer.h): not a wake-up, the peer broke the protocol
};

// Read the signals that came (never blocks; at most 256 KiB a call, the
// rest keeps the descriptor readable: its watcher must be level-triggered,
// as every one of ours is, since a read that comes back short ends the
// drain without a last read to see EAGAIN). Read with a control buffer: a byte
// that carries descriptors hands them to us, where recv() would have the
// kernel close them on this thread (fd_closer.h says why that can block).
SignalDrain drainSignals(int fd);

// For an error naming what the peer did to a wake-up socket: "shut down"
// or "sent descriptors over" (kOpen: "used").
const char* signalMisuseText(SignalDrain drain);

// A peer's descriptor is one end of such a pair: a Unix stream socket.
bool isSignalSocket(int fd);

} // namespace torch_rpc_ext
