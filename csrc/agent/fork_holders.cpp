// SPDX-License-Identifier: BSD-3-Clause
// Who holds which fork of the RRefs we own, in a dynamic group, so that a
// departed holder's forks can be dropped (Agent::releaseForksOf;
// docs/elastic.md, "Incarnations").
//
// A fork id names the worker that forked the RRef, not the one holding it.
// A user forking our RRef on asks us to register the fork (a fork request):
// its sender holds it. When we fork an RRef of ours ourselves, pickling it
// into a message to a peer, torch registers the fork here with no message
// of its own: the message that carries it says who holds it. Its pickled
// fork data (owner, RRef id, fork id, parent) is found in the message's
// payload as torch's two picklers write it.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>

#include <torch/csrc/distributed/rpc/rref_proto.h>

#include "csrc/agent/agent.h"
#include "csrc/agent/torch_private.h"

namespace torch_rpc_ext {

namespace {

// The globals each pickler writes before an RRef's fork data: Python's
// (_InternalRPCPickler) and TorchScript's (jit::Pickler::pushRRef).
constexpr std::string_view kPythonRRef = "_py_rref_receiver";
constexpr std::string_view kScriptRRef = "torch.distributed.rpc\nrref\n";

// Pickle opcodes for ints.
constexpr char kBinInt1 = 'K';
constexpr char kBinInt2 = 'M';
constexpr char kBinInt = 'J';
constexpr char kLong1 = '\x8a';

bool contains(std::string_view haystack, std::string_view needle) {
  return std::search(
             haystack.begin(), haystack.end(), needle.begin(), needle.end()) !=
      haystack.end();
}

void putLittleEndian(std::string& out, uint64_t v, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}

// A non-negative int as both picklers write it: the same up to 32 bits;
// past that a LONG1 of the fewest bytes that keep the sign (Python) or of
// eight (TorchScript).
void putInt(std::string& out, int64_t v, bool script) {
  const auto u = static_cast<uint64_t>(v);
  if (v >= 0 && v <= 0xff) {
    out.push_back(kBinInt1);
    putLittleEndian(out, u, 1);
  } else if (v >= 0 && v <= 0xffff) {
    out.push_back(kBinInt2);
    putLittleEndian(out, u, 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out.push_back(kBinInt);
    putLittleEndian(out, u, 4);
  } else {
    size_t bytes = 8;
    if (!script) {
      const int bits = 64 - __builtin_clzll(u); // v > INT32_MAX here
      bytes = static_cast<size_t>(bits / 8 + 1);
    }
    out.push_back(kLong1);
    out.push_back(static_cast<char>(bytes));
    putLittleEndian(out, u, std::min<size_t>(bytes, 8));
    for (size_t i = 8; i < bytes; ++i) {
      out.push_back('\0');
    }
  }
}

// The ints of the fork data of `forkId` of our RRef `rrefId`, forked by us,
// as one pickler writes them in a row.
std::string pickledFork(
    rpc::worker_id_t me,
    const rpc::RRefId& rrefId,
    const rpc::ForkId& forkId,
    bool script) {
  std::string out;
  for (int64_t v :
       {int64_t(me),
        int64_t(rrefId.createdOn_),
        rrefId.localId_,
        int64_t(forkId.createdOn_),
        forkId.localId_,
        int64_t(me)}) {
    putInt(out, v, script);
  }
  return out;
}

} // namespace

void Agent::trackForks(const rpc::Message& request, int32_t from) {
  try {
    if (request.type() == rpc::MessageType::RREF_FORK_REQUEST) {
      auto req = rpc::RRefForkRequest::fromMessage(request);
      std::lock_guard<std::mutex> lock(forkHoldersMutex_);
      forkHolders_[req->forkId()] = from;
    } else if (request.type() == rpc::MessageType::RREF_USER_DELETE) {
      auto req = rpc::RRefUserDelete::fromMessage(request);
      std::lock_guard<std::mutex> lock(forkHoldersMutex_);
      forkHolders_.erase(req->forkId());
    }
  } catch (const std::exception&) {
    // Malformed: the callback refuses it with its own error.
  }
}

void Agent::trackOwnForks(const rpc::Message& message, int32_t to) {
  const auto& payload = message.payload();
  const std::string_view bytes(payload.data(), payload.size());
  const bool python = contains(bytes, kPythonRRef);
  if (!python && !contains(bytes, kScriptRRef)) {
    return; // no RRef in it (the common case: one scan of a short payload)
  }
  if (!rrefsLive_.load()) {
    return;
  }
  const auto me = static_cast<rpc::worker_id_t>(workerInfo_.id_);
  // Ours, forked by us, held by nobody we know of yet: a fork this message
  // carries, or one of a message still being sent by another thread.
  auto forks = torch_private::forksOf(me);
  std::lock_guard<std::mutex> lock(forkHoldersMutex_);
  for (const auto& [rrefId, forkId] : forks) {
    if (forkHolders_.count(forkId) != 0) {
      continue;
    }
    if ((python && contains(bytes, pickledFork(me, rrefId, forkId, false))) ||
        contains(bytes, pickledFork(me, rrefId, forkId, true))) {
      forkHolders_[forkId] = static_cast<rpc::worker_id_t>(to);
    }
  }
}

} // namespace torch_rpc_ext
