// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>
#include <string>

#include "csrc/channel/channel.h"

namespace torch_rpc_ext::channel::cuda {

// cuda_self: CUDA tensors a worker sends to itself (docs/cuda.md, "The
// cuda_self channel"), as TensorPipe's cuda_xth moves them between two
// pipes of one process.
//
// A worker's calls to itself travel over a connection to itself, where
// cuda_ipc cannot help (the driver opens IPC handles only in a process
// other than their maker) and cuda_staged would take each tensor through
// host memory and the socket, twice per call. In one process every device
// pointer is addressable, so the sender copies the segments of a frame, on
// the stream they are ready on and with one launch per device and stream,
// into one block of the device's StagingPool (the value at the time of the
// send, as every channel takes it), records an event there, and sends a
// 16-byte record naming the block in the process's table of sends: its
// number and a 64-bit random tag. The receiver (the same process, the other
// end of the connection) takes the entry out of the table and its tensor
// views the block (PooledRegion), which its streams wait on by the event
// and which goes back to the pool once the last use of it has finished.
// Nothing crosses the socket but the records, and no host thread waits.
//
// Reach: the process itself. It publishes its boot, PID namespace, pid and
// a random number drawn at start; only the same process publishes all four
// alike. A record whose number and tag name no send of this process, or a
// segment of another size or device, breaks the protocol: the connection
// closes.
//
// Declined: strided views packed elsewhere are not (they are packed into
// the block), but a segment whose peer device differs from its own (a map
// {0: 1} to oneself) is: cuda_staged carries it.

// The process's cuda_self (registry.cpp). Loads the driver only when asked
// whether it is viable.
std::shared_ptr<Context> createSelfChannel(WireIds ids);

} // namespace torch_rpc_ext::channel::cuda
