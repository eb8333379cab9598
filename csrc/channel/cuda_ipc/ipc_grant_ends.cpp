// SPDX-License-Identifier: BSD-3-Clause
// How cuda_ipc's grants end (ipc_channel.h; docs/cuda.md, "Grants"), other
// than in the record of their use (ipc_grants.cpp): taken back by the
// receiver when the peer's segments outgrew them or left them unused for
// grantIdleMs(), given back by the sender
// when the frame it wrote one for was not sent, and held at the close until
// no copy of the peer's into them can still run.
#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <string>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/device_memory.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda/staging_thread.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/lending.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {
// A grant a sender ended is remembered this long (in grants ended since):
// a revoke of it arrives within a round trip, and a peer has at most
// kGrantSlots out per device then. Revokes of grants not yet here, these
// many at most.
constexpr size_t kEndedGrantsKept = 256;
constexpr size_t kEarlyRevokesKept = 64;
// How long past a close's deadline a receiver asks a live peer's events
// whether its writes into our grants are done (the memory stays out of the
// pool until they are, or the peer exits), and how long past its own a
// writer keeps the events it recorded them on (longer: the receiver may
// have seen the close later).
constexpr std::chrono::milliseconds kGrantAskFor{30000};
constexpr std::chrono::milliseconds kGrantEventsKept{60000};
} // namespace

void GrantClaim::reset() {
  if (bytes_ != 0) {
    releaseGrant(device_, bytes_);
    bytes_ = 0;
  }
}

void IpcChannel::revokeIdleGrantsFromLoop() {
  const int64_t idleMs = grantIdleMs();
  if (idleMs == 0) {
    return;
  }
  // (Called on the tick before its flush: the revokes go with it.)
  const auto before =
      std::chrono::steady_clock::now() - std::chrono::milliseconds(idleMs);
  std::lock_guard<std::mutex> lock(grantMu_);
  for (auto& [id, g] : outGrants_) {
    // (Not yet sent: it goes with our next frame, and its wait starts
    // then.)
    if (g.sent && !g.revoking && g.sentAt <= before) {
      g.revoking = true;
      g.wanted = 0; // none follows, unless a segment of its size comes
      pendingRevokes_ += idHead(id);
      counters_.grantsRevoked.fetch_add(1, std::memory_order_relaxed);
      counters_.grantsIdle.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

bool IpcChannel::onGrantReturnedFromLoop(Host& host, const std::string& head) {
  for (uint32_t id : idsOf(head)) {
    OutGrant g;
    {
      std::lock_guard<std::mutex> lock(grantMu_);
      auto it = outGrants_.find(id);
      if (it == outGrants_.end() || !it->second.sent) {
        host.rejectFromLoop(
            "rejected frame: CUDA grant " + std::to_string(id) +
            " given back, which is not out");
        return false;
      }
      g = std::move(it->second);
      outGrants_.erase(it);
    }
    // The peer never wrote it, or its write is done (abandonGrant): the
    // memory is the pool's again at once, on the stream it was made for.
    g.memory.memory.reset();
    // Its slot's next: the size a revoke asked for, or as large again.
    noteLargeFromLoop(g.device, g.revoking ? g.wanted : g.bytes);
  }
  postGrantsFromLoop();
  flushReleases(); // the larger grant now: its sender may be waiting
  return true;
}

void IpcChannel::endedGrantLocked(uint32_t id) {
  endedGrants_.push_back(id);
  if (endedGrants_.size() > kEndedGrantsKept) {
    endedGrants_.pop_front();
  }
}

void IpcChannel::onGrantRevokeFromLoop(const std::string& head) {
  std::string back;
  {
    std::lock_guard<std::mutex> lock(grantMu_);
    for (uint32_t id : idsOf(head)) {
      if (inGrants_.erase(id) != 0) {
        endedGrantLocked(id);
        back += idHead(id);
      } else if (
          std::find(endedGrants_.begin(), endedGrants_.end(), id) ==
          endedGrants_.end()) {
        // Not here yet (ahead of it on the wire): back as it comes.
        earlyRevokes_.push_back(id);
        if (earlyRevokes_.size() > kEarlyRevokesKept) {
          earlyRevokes_.pop_front(); // (a peer's nonsense, not a grant)
        }
      }
      // Else ended here: used (its record is on its way, and ends it) or
      // given back already: the peer hears of it once either way.
    }
  }
  if (!back.empty()) {
    returnGrants(back);
  }
}

void IpcChannel::abandonGrant(int device, uintptr_t stream, uint32_t id) {
  // The copy into it was queued on `stream`: the receiver may hand its
  // memory out again only once that copy is over.
  std::weak_ptr<IpcChannel> weak = shared_from_this();
  releaseAfter(device, reinterpret_cast<CUstream>(stream), [weak, id] {
    if (auto self = weak.lock()) {
      self->returnGrants(idHead(id));
    }
  });
}

void IpcChannel::returnGrants(const std::string& ids) {
  {
    std::lock_guard<std::mutex> lock(grantMu_);
    pendingReturns_ += ids;
  }
  flushReleases(); // rare: not held for a ride
  // (Counted once queued: a frame sent after the count goes after them.)
  counters_.grantsReturned.fetch_add(
      ids.size() / sizeof(uint32_t), std::memory_order_relaxed);
}

void IpcChannel::closeGrantsFromLoop() {
  auto held = std::make_shared<std::map<uint32_t, OutGrant>>();
  auto shared = std::make_shared<std::set<uint64_t>>();
  auto opened = std::make_shared<decltype(peerSegments_)>();
  // Ours, interprocess, by device: destroyed once the peer closed them.
  auto events = std::make_shared<std::vector<std::pair<int, CUevent>>>();
  auto copies = std::make_shared<std::vector<PooledEvent>>();
  std::map<SlotKey, CUevent> peerFree;
  std::shared_ptr<GrantSource> source;
  {
    std::lock_guard<std::mutex> lock(grantMu_);
    held->swap(outGrants_);
    shared->swap(sharedSegments_);
    opened->swap(peerSegments_);
    // Ours the peer opened: the writes' and the frees' (the same wait).
    for (const auto& [key, e] : grantEvents_) {
      events->emplace_back(key.first, e);
    }
    for (const auto& [key, free] : freeEvents_) {
      events->emplace_back(key.first, free.first);
    }
    grantEvents_.clear();
    freeEvents_.clear();
    peerFree.swap(peerFreeEvents_);
    copies->swap(grantCopies_);
    inGrants_.clear();
    endedGrants_.clear();
    earlyRevokes_.clear();
    pendingRevokes_.clear();
    pendingReturns_.clear();
    source = grantSource_;
  }
  for (const auto& [key, e] : peerFree) {
    try {
      CurrentDevice current(key.first);
      libcuda().cuEventDestroy(e);
    } catch (...) {
    }
  }
  // The peer's events of the slots our grants out are in: its record of
  // its last write into each (regions already built keep their own).
  auto written = std::make_shared<std::vector<std::shared_ptr<CUevent_st>>>();
  for (const auto& [id, g] : *held) {
    auto it = peerGrantEvents_.find({g.device, g.slot});
    if (it != peerGrantEvents_.end() &&
        std::find(written->begin(), written->end(), it->second) ==
            written->end()) {
      written->push_back(it->second);
    }
  }
  peerGrantEvents_.clear();
  noted_.clear();
  if (held->empty() && shared->empty() && opened->empty() && events->empty()) {
    return;
  }
  // A copy the peer queued into a grant before the connection went (its
  // frame unread, or refused at its send and the grant's return not sent)
  // may still run. The grants' memory goes back to the pool, and the
  // peer's mappings are counted closed, at the legacy teardown's deadline
  // if the peer is gone (its copies died with it) or we cannot tell;
  // while it lives, once its last record of each slot reads done, and has
  // for 2 s (its staging thread closes its mapping once its copy ended),
  // however long after the deadline that is: handed out again under the
  // peer's late write, the memory would take it into another message's
  // landing. The events are asked on every poll until then (a peer that
  // had not seen our close yet may record again; one that has not seen it
  // by the time they go back is not covered: docs/reliability.md), for
  // kGrantAskFor past the deadline at most: the peer keeps them that long
  // and more (below: its own close's); after that the memory stays out of
  // the pool until the peer exits. Ours of the peer's segments close once our
  // last writes into them completed, however long that takes: a mapping closed
  // under a copy still queued (behind a long stream, or a wait on a peer
  // that died) would make the copy fault in our own context. Such a
  // mapping is kept, said once, until the copy ends or the process does.
  const auto deadline = std::chrono::steady_clock::now() +
      std::chrono::milliseconds(kLegacyTeardownWaitMs);
  auto peer = peerProcess_;
  if (peer == nullptr) {
    written->clear(); // (not asked: closed now)
  }
  struct LateWrites {
    std::chrono::steady_clock::time_point doneAt{};
    bool stopped = false; // asked for kGrantAskFor: until the peer exits
  };
  auto late = std::make_shared<LateWrites>();
  runOnStagingThreadWhen(
      [deadline, peer, written, late] {
        using Clock = std::chrono::steady_clock;
        const auto now = Clock::now();
        if (late->stopped) {
          return peer->gone();
        }
        if (written->empty()) {
          return now >= deadline;
        }
        if (peer->gone()) {
          written->clear(); // (its records died with it)
          return now >= deadline;
        }
        if (now >= deadline + kGrantAskFor) {
          late->stopped = true;
          written->clear();
          logWarningLimited(
              "cuda_ipc_grant_late_write",
              "torch_rpc_ext: a closed peer's write into our CUDA grant "
              "memory had not completed " +
                  std::to_string(
                      (kLegacyTeardownWaitMs + kGrantAskFor.count()) / 1000) +
                  " s after the close, and the peer lives; the memory "
                  "stays out of the pool until the peer exits");
          return false;
        }
        bool done = true;
        for (const auto& e : *written) {
          done =
              done && libcuda().cuEventQuery(e.get()) != CUDA_ERROR_NOT_READY;
        }
        if (!done) {
          late->doneAt = Clock::time_point{};
          return false;
        }
        if (late->doneAt == Clock::time_point{}) {
          late->doneAt = now;
        }
        return now >= deadline &&
            now - late->doneAt >=
            std::chrono::milliseconds(kLegacyTeardownWaitMs);
      },
      [held, shared, source, written] {
        held->clear();
        for (uint64_t key : *shared) {
          source->segmentUnshared(key);
        }
        written->clear(); // (ours of the peer's events, closed)
      });
  auto said = std::make_shared<bool>(false);
  // When our last copy into the peer's grants was seen done (the staging
  // thread's only).
  auto copiesDone = std::make_shared<std::chrono::steady_clock::time_point>();
  runOnStagingThreadWhen(
      [copies, deadline, said] {
        // Every copy of ours into the peer's segments (each its own
        // event; pooled events need no current context to be queried).
        for (const auto& e : *copies) {
          if (libcuda().cuEventQuery(e.get()) == CUDA_ERROR_NOT_READY) {
            if (!*said && std::chrono::steady_clock::now() >= deadline) {
              *said = true;
              logWarningLimited(
                  "cuda_ipc_grant_late_copy",
                  "torch_rpc_ext: a copy into a closed peer's grant has not "
                  "completed " +
                      std::to_string(kLegacyTeardownWaitMs) +
                      " ms after the close; the peer's memory stays mapped "
                      "until it does");
            }
            return false;
          }
        }
        return true;
      },
      [opened, copies, copiesDone] {
        *copiesDone = std::chrono::steady_clock::now();
        copies->clear();
        for (const auto& [key, mapped] : *opened) {
          try {
            CurrentDevice current(mapped.second.second);
            libcuda().cuIpcCloseMemHandle(mapped.first);
          } catch (...) {
          }
        }
      });
  // Our events: destroyed once the peer had its time to close them (one
  // with a record still pending is released when that completes): at the
  // deadline if the peer is gone or we cannot tell; while it lives,
  // kGrantEventsKept after the later of the deadline and our last copy
  // into its grants seen done, for the peer asks them that long (above,
  // its close) before it gives its grants' memory back.
  runOnStagingThreadWhen(
      [deadline, copiesDone, peer] {
        const auto now = std::chrono::steady_clock::now();
        if (now < deadline) {
          return false;
        }
        if (peer == nullptr || peer->gone()) {
          return true;
        }
        return *copiesDone != std::chrono::steady_clock::time_point{} &&
            now >= std::max(deadline, *copiesDone) + kGrantEventsKept;
      },
      [events] {
        for (const auto& [device, e] : *events) {
          try {
            CurrentDevice current(device);
            libcuda().cuEventDestroy(e);
          } catch (...) {
          }
        }
      });
}

} // namespace torch_rpc_ext::channel::cuda
