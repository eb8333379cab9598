// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// A wake-up between two processes that neither side can turn into a
// blocking call for the other: one end each of a Unix stream socket pair,
// a byte sent for "look again".
//
// Why not an eventfd (or a pipe): a descriptor handed to a peer shares its
// open file description, flags included, so the peer can clear O_NONBLOCK
// or fill it to its maximum, and our next read() or write() on it blocks the
// loop or staging thread that made it. Each end of a socket pair is a file of
// its own whose flags the other side cannot touch, and every call here
// passes MSG_DONTWAIT besides. Used by the frame ring, the shm_ring channel
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

// Read the signals that came (never blocks; at most ~1 KiB a call, the rest
// keeps the descriptor readable). False once the other end has closed.
bool drainSignals(int fd);

// A peer's descriptor is one end of such a pair: a Unix stream socket.
bool isSignalSocket(int fd);

} // namespace torch_rpc_ext
