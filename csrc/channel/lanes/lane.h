// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// One lane of tcp_lanes: a TCP connection that carries stripes of large
// segments one way, beside the connection whose channel owns it
// (docs/architecture.md, "Lanes"; docs/wire-format.md, "tcp_lanes").
//
// On the wire, the listening end (the receiver of the bytes) opens with a
// fresh 16-byte challenge; the dialling end (the sender) answers with a
// Hello naming the single-use ticket its peer offered for that lane and a
// MAC over the challenge, the lane and the ticket under a key derived from
// the lane secret the receiver offered inside the connection (so inside
// TLS where it has TLS): a hello seen on the wire is worth nothing on
// another connection, and one without the secret is refused before any
// ticket is spent. The listener answers a hello it took with kAdmitted
// (one it refused is closed). Then chunks follow, each a ChunkHeader and
// its bytes. On
// a connection that is encrypted (TLS), each chunk is an AES-128-GCM record
// under a key of that lane's own, derived from the lane secret with HKDF
// and replaced after every `recordsPerKey` records (the receiver's offer
// says how many): header (authenticated, not secret), the bytes encrypted,
// a 16-byte tag; its nonce is the lane's index and the record's sequence
// number on the lane, so a record replayed, reordered or moved to another
// lane fails its tag.
//
// These helpers block; lanes run on threads of their own.

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "csrc/common/crypto.h"

namespace torch_rpc_ext::channel::lanes {

constexpr uint32_t kHelloMagic = 0x4e4c5254; // "TRLN", little-endian
constexpr uint16_t kHelloVersion = 3;
// Lanes a connection has at most each way (an offer's tickets).
constexpr size_t kMaxLanes = 16;
// The listener's one byte after a hello it took (its lane thread runs): the
// dialler counts the lane up only then (hello version 3; before, a lane the
// listener dropped after the hello was striped onto all the same).
constexpr uint8_t kAdmitted = 0x41;
constexpr size_t kTicketBytes = 16;
constexpr size_t kChallengeBytes = 16;
constexpr size_t kHelloMacBytes = 16;
// The lane secret a receiver offers per connection (its keys derive from
// it), and the records under one lane key at most (16 GiB of 256 KiB
// records; GCM's bounds allow far more under one key).
constexpr size_t kLaneSecretBytes = 32;
constexpr uint32_t kMaxRecordsPerKey = 1u << 16;

#pragma pack(push, 1)
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t lane;
  uint8_t ticket[kTicketBytes];
  uint8_t mac[kHelloMacBytes];
};
static_assert(sizeof(Hello) == 40, "Hello is 40 bytes");

struct ChunkHeader {
  uint64_t token; // the segment, as its record names it
  uint64_t segmentSize; // the whole segment
  uint64_t offset; // of these bytes in the segment
  uint32_t length; // bytes that follow (before the tag, if encrypted)
  uint32_t flags; // 0, or kChunkKeepAlive
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

// A chunk of no bytes (length 0): the sender still waits for this stripe's
// bytes to be copied out of a device (cuda_staged), or for its pages to be
// read into memory (a memory-mapped tensor), and the lane is alive.
// Sent every kKeepAliveEvery while it waits, so that the receiver, holding
// the segment's record, does not take the lane for stalled.
constexpr uint32_t kChunkKeepAlive = 1;
constexpr auto kKeepAliveEvery = std::chrono::milliseconds(500);

// The channel's control frame, by offset among its kinds: the receiver's
// offer of its lanes (port, tickets, key).
constexpr uint8_t kOfferFrame = 0;
// The dialler's word, once a dial of the offered lanes failed, that it
// stripes onto none of them (its large segments ride the stream): the
// offerer revokes the tickets not spent and gives their lanes back to its
// cap. No head.
constexpr uint8_t kDeclineFrame = 1;

// What a segment's record in the stream says (a frame::SegmentRecord).
struct LaneRecord {
  uint64_t token; // numbers the sender's striped segments, from 1, in the
                  // order their records go on the wire
  uint64_t size;
};
static_assert(sizeof(LaneRecord) == 16, "LaneRecord is a SegmentRecord");

// The nonce of record `sequence` on lane `lane`.
void laneNonce(uint16_t lane, uint64_t sequence, uint8_t out[12]);

// The key a lane hello's MAC is made under, from the lane secret.
std::string helloKey(std::string_view laneSecret);
// The MAC a hello for `lane` and `ticket` carries, answering `challenge`.
void helloMac(
    std::string_view helloKey,
    const uint8_t challenge[kChallengeBytes],
    uint16_t lane,
    const uint8_t ticket[kTicketBytes],
    uint8_t out[kHelloMacBytes]);

// One lane's records, one way: AES-128-GCM under the lane's key for the
// current epoch (records / recordsPerKey), derived from the lane secret
// with HKDF and replaced as the sequence crosses into the next epoch; each
// replacement counts in `rekeys`. One per lane thread.
class LaneCipher {
 public:
  LaneCipher(
      std::string laneSecret,
      uint16_t lane,
      uint32_t recordsPerKey,
      std::atomic<uint64_t>* rekeys);
  void seal(
      std::string_view aad,
      const void* in,
      void* out,
      size_t size,
      uint8_t* tag);
  // False if the tag does not match (see Aead::open).
  bool open(
      std::string_view aad,
      const void* in,
      void* out,
      size_t size,
      const uint8_t* tag);

 private:
  // The nonce of the next record, under the right key.
  void next(uint8_t nonce[Aead::kNonceBytes]);

  const std::string secret_;
  const uint16_t lane_;
  const uint32_t recordsPerKey_;
  std::atomic<uint64_t>* const rekeys_;
  uint64_t sequence_ = 0;
  std::unique_ptr<Aead> aead_;
};

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
// recvAll within `timeoutMs` in all ("timed out": not all came in time),
// or until `cancelled()` says so (asked every 100 ms: "closing").
bool recvWithin(
    int fd,
    void* data,
    size_t size,
    int timeoutMs,
    const std::function<bool()>& cancelled,
    std::string* error);

} // namespace torch_rpc_ext::channel::lanes
