// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes the stream core's incremental frame parser as an authenticated
// shm peer reaches it (csrc/transport/stream/connection_reader.cpp and
// connection_headers.cpp hosting the channels of csrc/channel/shm/): frame
// headers and segment lengths and the channel ids in them, every control frame
// (ping, pong, ring setup and drop, slab setup, release and drop), and message
// frames whose segments travel in the stream, in chunks through the peer's ring
// (shm_ring), in the peer's slabs (shm_slab), or staged (cuda_staged: bytes in
// the stream that the channel lands on a device: with no driver, refused; with
// the fake, in its device memory), and, with a CUDA driver (run.sh points
// TORCH_RPC_EXT_LIBCUDA at the fake of tests/cuda_fake), cuda_ipc: block
// setups, block records of every kind (views, hand-backs, copies out of legacy
// blocks), releases and drops; and cuda_ring: ring setups (garbage ones
// too), chunk records and drops.
//
// Input: one setup byte, then the bytes the peer sends, fed to a fresh
// connection in pieces of up to 257 bytes at a time (so every phase of the
// parser is also entered mid-way). Setup bit 0: before the input, the peer
// hands over a real sealed 64 KiB ring (a kRing frame with the ring's memfd
// and wake-up socket), so chunk records are checked against a mapped ring; bit
// 1: likewise a real sealed 64 KiB slab, id 1; with the driver, bit 2: a real
// 2 MiB cuda_ipc block (the fake's memory exported as a descriptor), id 1,
// bit 3: a real 2 MiB legacy block (a legacy IPC handle), id 2, and bit 4:
// a real cuda_ring of 2 slots of 64 KiB, generation 1 (its memfd and
// wake-up socket), and bit 5: a cuda_ring setup whose wake-up is an eventfd
// (refused, checked). Bits 2-7 also pick the piece size. The layout of a frame
// is in docs/wire-format.md; make_seeds.py writes valid ones.
//
// A finding: a sanitizer report, a crash or a hang; a frame delivered with a
// segment count other than announced; provided (slab) memory that cannot be
// read end to end; a closed connection, its imports of the peer's blocks,
// or those blocks, not let go within 10 s.

#include <dlfcn.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "csrc/channel/cuda_ipc/block.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/cuda_ring/cuda_ring_channel.h"
#include "csrc/channel/registry.h"
#include "csrc/channel/shm/context.h"
#include "csrc/channel/shm/ring.h"
#include "csrc/channel/shm/ring_channel.h"
#include "csrc/channel/shm/slab.h"
#include "csrc/channel/shm/slab_channel.h"
#include "csrc/transport/shm/connection.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/stream_peer.h"

namespace torch_rpc_ext::fuzz {
namespace {

using frame::FrameHeader;
using frame::FrameKind;
using frame::InboundBuffers;
using transport::ConnectionObserver;

// Receives what the parser delivers; owns the segment buffers it hands out.
class Observer final : public ConnectionObserver {
 public:
  void onReady(const std::shared_ptr<transport::Connection>&) override {}

  InboundBuffers onFrameHead(
      transport::Connection&,
      const std::string& /*head*/,
      const std::vector<uint64_t>& sizes,
      const std::vector<bool>& provided) override {
    InboundBuffers b = ownedBuffers(sizes, provided);
    // Odd segments go to cuda:0 (a staged one lands in the fake driver's
    // device memory, or is refused with no driver; a cuda_ipc one views a
    // block), even ones stay on the host (a staged or cuda_ipc one there is
    // refused before any driver call).
    for (size_t i = 1; i < sizes.size(); i += 2) {
      b.devices[i] = 0;
    }
    announced_ = sizes;
    return b;
  }

  void onFrame(
      const std::shared_ptr<transport::Connection>&,
      std::string /*head*/,
      InboundBuffers buffers) override {
    checkDelivered(buffers, announced_, sink_);
  }

  void onClosed(transport::Connection&, const std::string&) override {}

 private:
  std::vector<uint64_t> announced_;
  volatile char sink_ = 0;
};

// The peer's cuda_ipc blocks: one allocation granule (the fake's and most
// GPUs'), as make_seeds.py assumes.
constexpr uint64_t kIpcBlockBytes = uint64_t(2) << 20;

// Stand-ins for the copy kernels' PTX that the fake driver loads and runs by
// entry name (three .u64 parameters each, as torch_rpc_ext/_cuda/abi.py).
std::map<std::string, std::pair<std::string, std::string>> fakeKernels() {
  std::map<std::string, std::pair<std::string, std::string>> k;
  for (const char* name :
       {"copy_contiguous", "copy_segments", "pack_strided", "unpack_strided"}) {
    std::string entry = name; // the fake runs a kernel by its name
    k[name] = {
        entry,
        ".version 8.0\n.target sm_70\n.address_size 64\n.visible .entry " +
            entry +
            "(.param .u64 a, .param .u64 b, .param .u64 c)\n{\n ret;\n}\n"};
  }
  return k;
}

struct Harness : PeerHarness {
  Harness() {
    options.selfId = 1;
    options.limits.maxFrameBytes = 1 << 20;
    // Both shm channels, as negotiated between two workers of one host, and
    // cuda_staged (its segments' bytes follow in the stream); cuda_ipc with
    // a driver, as between two processes of this host (the peer publishes
    // our own descriptor, the same boot, devices and PID namespace, under
    // another pid: cuda_ipc never serves a process's calls to itself).
    // And tcp_lanes: its offers, abandons and records (on this connection
    // without a socket, an offer is refused: no IP address).
    std::vector<const char*> names = {
        "shm_slab", "shm_ring", "cuda_staged", "tcp_lanes"};
    const char* lib = std::getenv("TORCH_RPC_EXT_LIBCUDA");
    if (lib != nullptr && *lib != '\0') {
      auto ipc = channel::createChannel("cuda_ipc");
      FUZZ_CHECK(
          ipc->unviableReason().empty(),
          "cuda_ipc is not viable with the driver named by "
          "TORCH_RPC_EXT_LIBCUDA");
      channel::setCudaKernels(fakeKernels());
      names.push_back("cuda_ipc");
      names.push_back("cuda_ring");
      cuda = true;
    }
    for (const char* name : names) {
      auto c = channel::createChannel(name);
      std::string descriptor = c->domainDescriptor();
      if (std::string(name) == "cuda_ipc") {
        descriptor = descriptor.substr(0, descriptor.rfind(';') + 1) +
            std::to_string(::getpid() + 1);
      }
      channels.push_back(channel::Offer{c, descriptor});
    }
  }
  Observer observer;
  bool cuda = false;
};

// The fake driver's count of this process's imports of its peers' blocks
// (IPC events opened and memory mapped from another process's handle), or
// -1 without the fake (tests/cuda_fake/fake_libcuda.cpp, fake_cuda_stats).
int64_t liveImports() {
  using Stats = int (*)(char*, size_t);
  static const Stats stats = []() -> Stats {
    const char* lib = std::getenv("TORCH_RPC_EXT_LIBCUDA");
    void* handle = lib != nullptr && *lib != '\0'
        ? ::dlopen(lib, RTLD_NOW | RTLD_NOLOAD)
        : nullptr;
    return handle != nullptr
        ? reinterpret_cast<Stats>(::dlsym(handle, "fake_cuda_stats"))
        : nullptr;
  }();
  if (stats == nullptr) {
    return -1;
  }
  std::string json(1 << 16, '\0');
  json.resize(std::min<size_t>(stats(json.data(), json.size()), json.size()));
  int64_t total = 0;
  for (const char* key :
       {"\"opened_ipc_events\": ", "\"ipc_mem_mappings\": "}) {
    const size_t at = json.find(key);
    FUZZ_CHECK(at != std::string::npos, std::string("no ") + key);
    total += std::strtoll(json.c_str() + at + std::strlen(key), nullptr, 10);
  }
  return total;
}

// Waits up to 10 s for `done`; a finding past that, naming `what`.
template <typename Done>
void awaitTeardown(Done done, const char* what) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    FUZZ_CHECK(std::chrono::steady_clock::now() < deadline, what);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

Harness& harness() {
  static Harness* h = new Harness(); // never destroyed: its loop keeps running
  return *h;
}

} // namespace
} // namespace torch_rpc_ext::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace torch_rpc_ext;
  using namespace torch_rpc_ext::fuzz;
  auto& h = harness();
  FuzzInput in(data, size);
  uint8_t setup = in.take<uint8_t>();
  auto conn = std::make_shared<transport::shm::ShmConnection>(
      h.loop,
      h.options,
      /*fd=*/-1,
      /*outbound=*/false,
      /*expectedPeerId=*/0,
      "fuzz peer",
      &h.observer);
  bool open = true;
  // The sender's side of the ring and slab stay ours; the connection maps
  // its own views from duplicates of their descriptors.
  channel::shm::Ring ring;
  std::shared_ptr<channel::shm::Slab> slab;
  if (setup & 1) {
    ring = channel::shm::Ring::create(channel::shm::kMinRingBytes);
    uint64_t cap = ring.capacity();
    std::string frame = frameHeader(
        harness().channel("shm_ring").wireIds().kind(channel::shm::kRingSetup),
        sizeof(cap));
    frame.append(reinterpret_cast<const char*>(&cap), sizeof(cap));
    open = conn->feedForTesting(
        frame.data(),
        frame.size(),
        {::dup(ring.fd()), ::dup(ring.peerWakeFd())});
    FUZZ_CHECK(open, "a valid ring setup was refused");
  }
  if (open && (setup & 2)) {
    slab = channel::shm::Slab::create(channel::shm::kSlabMinSegment);
    uint32_t id = 1;
    uint64_t cap = slab->capacity();
    std::string frame = frameHeader(
        harness().channel("shm_slab").wireIds().kind(channel::shm::kSlabSetup),
        sizeof(id) + sizeof(cap));
    frame.append(reinterpret_cast<const char*>(&id), sizeof(id));
    frame.append(reinterpret_cast<const char*>(&cap), sizeof(cap));
    open =
        conn->feedForTesting(frame.data(), frame.size(), {::dup(slab->fd())});
    FUZZ_CHECK(open, "a valid slab setup was refused");
  }
  // The peer's blocks stay ours (the owner's side) until the input is done.
  std::vector<std::shared_ptr<channel::cuda::Block>> blocks;
  for (int bit = 0; bit < 2 && h.cuda; ++bit) {
    if (!open || !(setup & (4 << bit))) {
      continue;
    }
    const uint32_t id = 1 + bit;
    auto sharing = bit == 0 ? channel::cuda::Sharing::kFd
                            : channel::cuda::Sharing::kLegacy;
    auto block = channel::cuda::Block::create(0, kIpcBlockBytes, sharing);
    std::string head = block->describe(id);
    std::string frame = frameHeader(
        h.channel("cuda_ipc").wireIds().kind(channel::cuda::kBlockSetup),
        head.size());
    frame += head;
    std::vector<int> fds;
    if (sharing == channel::cuda::Sharing::kFd) {
      fds.push_back(block->exportFd());
    }
    open = conn->feedForTesting(frame.data(), frame.size(), fds);
    FUZZ_CHECK(open, "a valid cuda_ipc block setup was refused");
    blocks.push_back(std::move(block));
  }
  // The peer's cuda_ring (the sender's side) stays ours too.
  std::shared_ptr<channel::cuda::RingMemory> cudaRing;
  if (open && h.cuda && (setup & 16)) {
    cudaRing = channel::cuda::RingMemory::create(1, 2, 64 << 10);
    channel::cuda::RingSetup ringSetup{1, 2, 0, 64 << 10};
    std::string frame = frameHeader(
        h.channel("cuda_ring").wireIds().kind(channel::cuda::kRingSetup),
        sizeof(ringSetup));
    frame.append(reinterpret_cast<const char*>(&ringSetup), sizeof(ringSetup));
    open = conn->feedForTesting(
        frame.data(),
        frame.size(),
        {::dup(cudaRing->memFd()), ::dup(cudaRing->peerWakeFd())});
    FUZZ_CHECK(open, "a valid cuda_ring setup was refused");
  }
  if (open && h.cuda && (setup & 32)) {
    // A setup whose wake-up is an eventfd, not a socket: its flags and its
    // count are the peer's too, which could make the receiver's staging
    // thread block on a release. Refused.
    auto ring = channel::cuda::RingMemory::create(2, 2, 64 << 10);
    channel::cuda::RingSetup ringSetup{2, 2, 0, 64 << 10};
    std::string frame = frameHeader(
        h.channel("cuda_ring").wireIds().kind(channel::cuda::kRingSetup),
        sizeof(ringSetup));
    frame.append(reinterpret_cast<const char*>(&ringSetup), sizeof(ringSetup));
    const int event = ::eventfd(0, EFD_CLOEXEC);
    FUZZ_CHECK(event >= 0, "eventfd");
    const bool accepted = conn->feedForTesting(
        frame.data(), frame.size(), {::dup(ring->memFd()), event});
    FUZZ_CHECK(!accepted, "a cuda_ring setup with an eventfd for its wake-up");
    open = false;
  }
  std::string rest = in.takeRest();
  size_t at = 0;
  size_t piece = 1 + (setup >> 2) % 257;
  while (open && at < rest.size()) {
    size_t n = std::min(piece, rest.size() - at);
    open = conn->feedForTesting(rest.data() + at, n);
    at += n;
  }
  conn->close("");
  // Torn down within this input (its loop thread drops the last reference),
  // so that the input's allocations balance here: libFuzzer's leak check
  // reruns an input that ends with more mallocs than frees and scans the
  // heap. A connection held 10 s after its close is a finding.
  std::weak_ptr<transport::shm::ShmConnection> closed = conn;
  conn.reset();
  awaitTeardown(
      [&closed] { return closed.expired(); },
      "the connection still held 10 s after its close");
  if (blocks.empty()) {
    return 0;
  }
  // The peer's blocks go only once the closed connection has let go of its
  // imports of them (its staging thread does that), as a peer process
  // that outlives the connection frees them, and within this input, as
  // the connection. Before: destroyed at once, the fake warned of every
  // imported event its exporter destroyed.
  awaitTeardown(
      [] { return liveImports() <= 0; },
      "the connection still imports the peer's blocks 10 s after its close");
  auto live = std::make_shared<std::atomic<size_t>>(blocks.size());
  for (auto& b : blocks) {
    b->whenFreed([live] { live->fetch_sub(1); });
    b->orphan(std::chrono::steady_clock::now()); // nobody records on them
  }
  blocks.clear();
  awaitTeardown(
      [&live] { return live->load() == 0; },
      "the peer's blocks not freed 10 s after the connection let them go");
  return 0;
}
