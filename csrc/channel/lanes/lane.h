// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// One lane of tcp_lanes: a TCP connection that carries stripes of large
// segments one way, beside the connection whose channel owns it
// (docs/architecture.md, "Lanes"; docs/wire-format.md, "tcp_lanes").
//
// On the wire, the dialling end (the sender of the bytes) opens with a
// Hello naming the single-use ticket its peer offered for that lane; then
// chunks follow, each a ChunkHeader and its bytes. On a connection that is
// encrypted (TLS), each chunk is an AES-128-GCM record under the key the
// receiver offered inside TLS: header (authenticated, not secret), the
// bytes encrypted, a 16-byte tag; its nonce is the lane's index and the
// record's sequence number on the lane, so a record replayed, reordered or
// moved to another lane fails its tag.
//
// These helpers block; lanes run on threads of their own.

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace torch_rpc_ext::channel::lanes {

constexpr uint32_t kHelloMagic = 0x4e4c5254; // "TRLN", little-endian
constexpr size_t kTicketBytes = 16;

#pragma pack(push, 1)
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t lane;
  uint8_t ticket[kTicketBytes];
};
static_assert(sizeof(Hello) == 24, "Hello is 24 bytes");

struct ChunkHeader {
  uint64_t token; // the segment, as its record names it
  uint64_t segmentSize; // the whole segment
  uint64_t offset; // of these bytes in the segment
  uint32_t length; // bytes that follow (before the tag, if encrypted)
  uint32_t flags; // 0
};
static_assert(sizeof(ChunkHeader) == 32, "ChunkHeader is 32 bytes");
#pragma pack(pop)

// An encrypted record's bytes at most, and a chunk's in the clear.
constexpr uint64_t kRecordBytes = 256 * 1024;
constexpr uint64_t kClearChunkBytes = 64ull << 20;
// The largest segment a sender stripes (larger ones ride the stream), and
// the bytes a receiver lets arrive ahead of the records that claim them.
constexpr uint64_t kMaxStripedBytes = 2ull << 30;
constexpr uint64_t kMaxUnclaimedBytes = 4ull << 30;
// The smallest segment a sender stripes (TORCH_RPC_EXT_LANES_MIN_BYTES may
// go no lower), the unclaimed segments a receiver holds at most, and the
// byte ranges one segment's chunks may leave apart (each lane's stripe
// lands as one range; adjacent chunks merge).
constexpr uint64_t kMinStripedBytes = 4096;
constexpr size_t kMaxUnclaimedSegments = 1024;
constexpr size_t kMaxRangesPerSegment = 64;
// A body is sent and received in slices of this size at most, each telling
// the connection's heartbeat that the peer is alive, however slow the link.
constexpr uint64_t kProgressSliceBytes = 1 << 20;

// The channel's control frame, by offset among its kinds: the receiver's
// offer of its lanes (port, tickets, key).
constexpr uint8_t kOfferFrame = 0;

// What a segment's record in the stream says (a frame::SegmentRecord).
struct LaneRecord {
  uint64_t token; // numbers the sender's striped segments, from 1, in the
                  // order their records go on the wire
  uint64_t size;
};
static_assert(sizeof(LaneRecord) == 16, "LaneRecord is a SegmentRecord");

// The nonce of record `sequence` on lane `lane`.
void laneNonce(uint16_t lane, uint64_t sequence, uint8_t out[12]);

// "10.0.0.2:41234", "[fe80::1%eth0]:41234".
std::string describeAddress(const sockaddr_storage& address);

// A blocking TCP socket connected to `address` within `timeoutMs`, with
// TCP_NODELAY and large buffers; -1 with `error` set, also as soon as
// `cancelled()` says so (it is asked every 100 ms).
int dialLane(
    const sockaddr_storage& address,
    int timeoutMs,
    const std::function<bool()>& cancelled,
    std::string* error);

// Large socket buffers and no Nagle (both ends).
void tuneLaneSocket(int fd);

// The port of an IPv4 or IPv6 address (host order), and setting it.
uint16_t portOf(const sockaddr_storage& address);
void setPort(sockaddr_storage* address, uint16_t port);

// A TCP socket bound to `local`'s address (its port aside) on a port the
// kernel picks, which `port` gets; -1 with `error` set.
int bindAnyPort(
    const sockaddr_storage& local,
    uint16_t* port,
    std::string* error);

// Send or receive exactly `size` bytes on a blocking socket: false with
// `error` set (the peer closed: "closed").
bool sendAll(int fd, const void* data, size_t size, std::string* error);
bool recvAll(int fd, void* data, size_t size, std::string* error);

} // namespace torch_rpc_ext::channel::lanes
