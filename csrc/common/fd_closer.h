// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

// Closing, off the caller's thread, the descriptors a peer handed us.
//
// The last close of a file runs that file's release, and a peer chooses the
// file: a TCP socket it set to linger (SO_LINGER) with bytes the other end
// will never acknowledge holds close() for the linger time, a file on a
// FUSE mount the peer serves holds it until the daemon answers the flush.
// A loop thread that closed such a descriptor (a refused setup, a ring or a
// slab let go, a connection's leftovers) would stop serving every
// connection it owns. So every descriptor that came from a peer is closed
// here: a closer thread takes it, and a closer stuck on one file starts
// another (up to kMaxClosers) for the rest. A close that took long is
// logged, naming the time. Only descriptors that came from a peer need
// this; classes that hold a mix of theirs and ours may send both.

namespace torch_rpc_ext {

// Closes `fd` (>= 0) on a closer thread; never blocks the caller. After a
// fork the child starts closers of its own.
void closeOffThread(int fd);
// The same for each; `fds` is cleared.
void closeOffThread(std::vector<int>& fds);

// Closes a socket of ours whose receive queue may hold a peer's messages,
// and with them descriptors, whose last close then comes with ours: shut
// down first (nothing more can come), then closed here if it is not a Unix
// socket or nothing is queued (the usual case), else by a closer.
void closeSocket(int fd);

struct FdCloserStats {
  uint64_t closed = 0; // closes that returned (those via children included)
  uint64_t pending = 0; // handed over, not yet closed (stuck ones included)
  uint64_t viaChildren = 0; // handed to a child process, every closer stuck
  uint64_t children = 0; // such children not yet gone
  bool handOver = false; // this build hands over (not under a sanitizer)
};
FdCloserStats fdCloserStats();

// Waits until as many closes have returned as descriptors had been handed
// over when it was called, or `timeout` passed: true if they have. With no
// close stuck, every descriptor handed over so far is then closed. For
// tests that check a descriptor is gone.
bool waitForFdClosers(std::chrono::milliseconds timeout);

// The kernel's SCM_MAX_FD: the most descriptors one message carries, and a
// Unix stream socket hands over one message's at most per recvmsg(). A
// control buffer of CMSG_SPACE(kMaxFdsPerMessage * sizeof(int)) is never
// truncated, so the kernel never drops (and closes, on our thread)
// descriptors that did not fit.
constexpr size_t kMaxFdsPerMessage = 253;

// Appends to `into` the descriptors (SCM_RIGHTS) recvmsg() put in `msg`.
void collectPassedFds(const msghdr& msg, std::vector<int>& into);

// Closers at most: each one stuck on a close holds one. Descriptors handed
// over while every closer is stuck go to a short-lived child process whose
// exit makes the last closes (a socket's does not linger then; a file
// whose flush never returns holds the child); should no child be had, they
// wait, open, for a closer.
constexpr int kMaxClosers = 16;

} // namespace torch_rpc_ext
