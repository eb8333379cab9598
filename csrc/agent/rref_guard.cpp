// SPDX-License-Identifier: BSD-3-Clause
// The RRef guard (rref_guard.h): who holds which fork of the RRefs we own,
// what a departed member leaves behind, and the requests refused for it.
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
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>

#include <sstream>

#include <torch/csrc/distributed/autograd/rpc_messages/rpc_with_autograd.h>
#include <torch/csrc/distributed/autograd/rpc_messages/rpc_with_profiling_req.h>
#include <torch/csrc/distributed/rpc/python_remote_call.h>
#include <torch/csrc/distributed/rpc/rref_context.h>
#include <torch/csrc/distributed/rpc/rref_proto.h>
#include <torch/csrc/distributed/rpc/script_remote_call.h>
#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/utils/pybind.h>

#include "csrc/agent/rref_guard.h"
#include "csrc/agent/thread_state.h"
#include "csrc/agent/torch_private.h"
#include "csrc/common/logging.h"

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

// Whether `payload` may carry pickled fork data: the global either pickler
// writes before it (the common case, no RRef: one scan of a short payload).
bool mentionsRRef(std::string_view payload, bool* python) {
  *python = contains(payload, kPythonRRef);
  return *python || contains(payload, kScriptRRef);
}

} // namespace

std::vector<rpc::ForkId> forksCarried(
    std::string_view payload,
    rpc::worker_id_t self,
    const std::vector<std::pair<rpc::RRefId, rpc::ForkId>>& forks) {
  std::vector<rpc::ForkId> out;
  bool python = false;
  if (!mentionsRRef(payload, &python)) {
    return out;
  }
  for (const auto& [rrefId, forkId] : forks) {
    if ((python &&
         contains(payload, pickledFork(self, rrefId, forkId, false))) ||
        contains(payload, pickledFork(self, rrefId, forkId, true))) {
      out.push_back(forkId);
    }
  }
  return out;
}

void RRefGuard::trackForks(const rpc::Message& request, rpc::worker_id_t from) {
  if (!enabled_) {
    return;
  }
  try {
    if (request.type() == rpc::MessageType::RREF_FORK_REQUEST) {
      forkRegistered(
          rpc::RRefForkRequest::fromMessage(request)->forkId(), from);
    } else if (request.type() == rpc::MessageType::RREF_USER_DELETE) {
      forkDeleted(rpc::RRefUserDelete::fromMessage(request)->forkId());
    }
  } catch (const std::exception&) {
    // Malformed: the callback refuses it with its own error.
  }
}

c10::intrusive_ptr<rpc::Message> RRefGuard::failRemote(
    const rpc::Message& request,
    const std::string& error) {
  std::optional<rpc::RRefId> rrefId; // (ids cannot be assigned)
  std::optional<rpc::ForkId> forkId;
  c10::TypePtr type;
  auto kind = request.type();
  auto wraps = [](rpc::MessageType t) {
    return t == rpc::MessageType::FORWARD_AUTOGRAD_REQ ||
        t == rpc::MessageType::RUN_WITH_PROFILING_REQ;
  };
  if (kind != rpc::MessageType::PYTHON_REMOTE_CALL &&
      kind != rpc::MessageType::SCRIPT_REMOTE_CALL && !wraps(kind)) {
    return {};
  }
  try {
    // As torch's request callback reads them (the tensors are placeholders:
    // nothing runs). A remote() in a dist autograd context (any, since
    // torch records its result's gradients: forceGradRecording), or under
    // the legacy profiler, comes wrapped; the answer is the RemoteRet
    // itself, as torch's is when no tensor in it requires grad. Before
    // session 97 such a call got a plain error: its caller's fork stayed
    // pending, and to_here() waited out its timeout.
    auto decoded = rpc::deserializeRequest(request);
    rpc::RpcCommandBase* command = decoded.get();
    for (int depth = 0; depth < 2 && wraps(kind); ++depth) {
      if (kind == rpc::MessageType::FORWARD_AUTOGRAD_REQ) {
        auto& wrapped =
            static_cast<torch::distributed::autograd::RpcWithAutograd&>(
                *command);
        kind = wrapped.wrappedMessageType();
        command = &wrapped.wrappedRpc();
      } else {
        auto& wrapped =
            static_cast<torch::distributed::autograd::RpcWithProfilingReq&>(
                *command);
        kind = wrapped.wrappedMessageType();
        command = &wrapped.wrappedRpc();
      }
    }
    if (kind == rpc::MessageType::PYTHON_REMOTE_CALL) {
      const auto& call = static_cast<const rpc::PythonRemoteCall&>(*command);
      rrefId.emplace(rpc::RRefId::fromIValue(call.retRRefId()));
      forkId.emplace(rpc::ForkId::fromIValue(call.retForkId()));
      type = c10::PyObjectType::get();
    } else if (kind == rpc::MessageType::SCRIPT_REMOTE_CALL) {
      const auto& call = static_cast<const rpc::ScriptRemoteCall&>(*command);
      rrefId.emplace(call.retRRefId());
      forkId.emplace(call.retForkId());
      // (A TorchScript function's return type needs its compilation unit;
      // an OwnerRRef holding an error never hands a value out.)
      type = c10::AnyType::get();
      if (call.hasOp() && call.op()->schema().returns().size() == 1) {
        type = call.op()->schema().returns()[0].type();
      }
    } else {
      return {};
    }
  } catch (const std::exception&) {
    return {};
  }
  auto& ctx = rpc::RRefContext::getInstance();
  c10::intrusive_ptr<rpc::OwnerRRef> owner;
  if (*rrefId == *forkId) {
    // remote() to ourselves: the caller made the OwnerRRef (torch's
    // assignOwnerRRef does the same).
    owner = c10::static_intrusive_pointer_cast<rpc::OwnerRRef>(
        ctx.getOwnerRRef(*rrefId, /*forceCreated=*/true)
            ->constValue()
            .toRRef());
  } else {
    owner = ctx.getOrCreateOwnerRRef(*rrefId, type);
    ctx.addForkOfOwner(*rrefId, *forkId);
  }
  owner->setError(std::make_exception_ptr(std::runtime_error(error)));
  return rpc::RemoteRet(*rrefId, *forkId).toMessage();
}

void RRefGuard::forkRegistered(
    const rpc::ForkId& forkId,
    rpc::worker_id_t holder) {
  std::lock_guard<std::mutex> lock(holdersMutex_);
  holders_[forkId] = holder;
}

void RRefGuard::forkDeleted(const rpc::ForkId& forkId) {
  std::lock_guard<std::mutex> lock(holdersMutex_);
  holders_.erase(forkId);
}

std::vector<rpc::ForkId> RRefGuard::claimCarried(
    const rpc::Message& message,
    std::optional<rpc::worker_id_t> to) {
  const auto& payload = message.payload();
  const std::string_view bytes(payload.data(), payload.size());
  bool python = false;
  if (!mentionsRRef(bytes, &python)) {
    return {};
  }
  // Ours, forked by us, held by nobody we know of yet: a fork this message
  // carries, or one of a message still being sent by another thread.
  auto forks = torch_private::forksOf(self_);
  std::lock_guard<std::mutex> lock(holdersMutex_);
  std::vector<std::pair<rpc::RRefId, rpc::ForkId>> unheld;
  for (const auto& f : forks) {
    if (holders_.count(f.second) == 0) {
      unheld.push_back(f);
    }
  }
  auto carried = forksCarried(bytes, self_, unheld);
  if (to) {
    for (const auto& forkId : carried) {
      holders_[forkId] = *to;
    }
  }
  return carried;
}

std::vector<rpc::ForkId> RRefGuard::trackOwnForks(
    const rpc::Message& message,
    rpc::worker_id_t to) {
  if (!enabled_ || !live_.load()) {
    return {};
  }
  return claimCarried(message, to);
}

void RRefGuard::dropForks(const std::vector<rpc::ForkId>& forks) {
  if (forks.empty() || !live_.load()) {
    return;
  }
  dropNow(forks);
}

void RRefGuard::dropNow(const std::vector<rpc::ForkId>& forks) {
  std::unordered_set<rpc::ForkId, rpc::ForkId::Hash> dropping(
      forks.begin(), forks.end());
  {
    std::lock_guard<std::mutex> lock(holdersMutex_);
    for (const auto& forkId : forks) {
      holders_.erase(forkId);
    }
  }
  try {
    droppedForks_.fetch_add(
        dropOwnerForks(
            [&](const rpc::ForkId& forkId) { return dropping.count(forkId); }),
        std::memory_order_relaxed);
  } catch (const std::exception& e) {
    logWarning(
        "torch_rpc_ext: " + selfName_ +
        " could not drop RRef forks nobody holds (a departed holder's, or a message's never delivered): " +
        e.what());
  }
}

void RRefGuard::dropCarried(const rpc::Message& message) {
  if (!running_.load()) {
    return;
  }
  std::vector<rpc::ForkId> forks;
  try {
    forks = claimCarried(message, std::nullopt);
  } catch (const std::exception&) {
    return; // not ours to read: nothing of ours carried
  }
  if (!forks.empty()) {
    dropNow(forks);
  }
}

std::function<void()> RRefGuard::ifUnsent(
    std::weak_ptr<void> owner,
    std::vector<rpc::ForkId> attributed,
    c10::intrusive_ptr<rpc::Message> message) {
  return [this,
          owner = std::move(owner),
          attributed = std::move(attributed),
          message = std::move(message)] {
    auto alive = owner.lock();
    if (!alive) {
      return;
    }
    // (Run as a holder is let go: nothing may escape.)
    try {
      dropUndelivered(attributed, *message);
    } catch (const std::exception& e) {
      try {
        logWarning(
            "torch_rpc_ext: " + selfName_ +
            " could not drop the RRef forks of a message never written: " +
            e.what());
      } catch (...) {
      }
    } catch (...) {
    }
  };
}

size_t RRefGuard::dropOwnerForks(
    const std::function<bool(const rpc::ForkId&)>& drop) {
  return torch_private::dropForks(
      [&](const rpc::RRefId& /*rrefId*/, const rpc::ForkId& forkId) {
        return drop(forkId);
      },
      [this](c10::intrusive_ptr<rpc::RRef> owner) {
        // A Python value is dropped with the GIL, off this thread.
        offThread_([owner = std::move(owner)]() mutable {
          thread_state::CheckedScope checked; // (a __del__ may run)
          pybind11::gil_scoped_acquire gil;
          owner.reset();
        });
      });
}

rpc::worker_id_t RRefGuard::holderOf(const rpc::ForkId& forkId) const {
  std::lock_guard<std::mutex> lock(holdersMutex_);
  auto it = holders_.find(forkId);
  return it != holders_.end() ? it->second : forkId.createdOn_;
}

void RRefGuard::release(
    rpc::worker_id_t departed,
    const std::string& name,
    const std::string& why) {
  // Only while we are torch's running agent (a departure applied while we
  // join concerns nothing of ours; RRefContext is torn down before our
  // shutdown), and before we acknowledge the departure, so no later holder
  // of its id can have created anything here yet.
  if (!live_.load()) {
    return;
  }
  try {
    size_t n = dropOwnerForks([&](const rpc::ForkId& forkId) {
      // Who holds a fork: the worker that asked us to register it (a fork
      // request), else the one that minted it (its own remote()).
      std::lock_guard<std::mutex> lock(holdersMutex_);
      auto it = holders_.find(forkId);
      if (it != holders_.end()) {
        if (it->second != departed) {
          return false;
        }
        holders_.erase(it);
        return true;
      }
      return forkId.createdOn_ == departed;
    });
    droppedForks_.fetch_add(n, std::memory_order_relaxed);
    // The distributed autograd contexts it created here (its forward
    // passes' RPCs to us): it will never release them. Autograd context ids
    // carry their creator's worker id in the top 16 bits.
    size_t contexts = torch_private::dropAutogradContexts([&](int64_t id) {
      return (id >> 48) == static_cast<int64_t>(departed);
    });
    droppedAutogradContexts_.fetch_add(contexts, std::memory_order_relaxed);
    // The RRefs we use that it owned: their values are gone with it. A
    // later holder of its id must never be asked for them (it would wait
    // for a value that cannot come); refuse() answers such requests.
    std::vector<c10::intrusive_ptr<rpc::RRef>> held;
    auto owned = torch_private::userRRefsOwnedBy(departed, held);
    if (!owned.empty()) {
      std::lock_guard<std::mutex> lock(staleMutex_);
      for (const auto& id : owned) {
        stale_[id] = why;
      }
      hasStale_.store(true, std::memory_order_release);
    }
    // Dropped only now, outside torch's RRef lock (userRRefsOwnedBy): a
    // last reference among them deletes its RRef and tells its owner (the
    // departed one's message fails, logged by torch).
    held.clear();
  } catch (const std::exception& e) {
    logWarning(
        "torch_rpc_ext: " + selfName_ +
        " could not release the RRef forks and autograd contexts of " + name +
        ": " + e.what());
  }
}

c10::intrusive_ptr<c10::ivalue::Future> RRefGuard::refuse(
    const std::string& to,
    const rpc::Message& message,
    const std::vector<c10::Device>& devices) {
  if (!hasStale_.load(std::memory_order_acquire)) {
    return nullptr;
  }
  std::optional<rpc::RRefId> id;
  bool deletion = false;
  try {
    switch (message.type()) {
      case rpc::MessageType::SCRIPT_RREF_FETCH_CALL:
        id.emplace(rpc::ScriptRRefFetchCall::fromMessage(message)->rrefId());
        break;
      case rpc::MessageType::PYTHON_RREF_FETCH_CALL:
        id.emplace(rpc::PythonRRefFetchCall::fromMessage(message)->rrefId());
        break;
      case rpc::MessageType::RREF_FORK_REQUEST:
        id.emplace(rpc::RRefForkRequest::fromMessage(message)->rrefId());
        break;
      case rpc::MessageType::RREF_USER_DELETE:
        id.emplace(rpc::RRefUserDelete::fromMessage(message)->rrefId());
        deletion = true;
        break;
      default:
        return nullptr;
    }
  } catch (const std::exception&) {
    return nullptr; // not ours to judge: the callee refuses it
  }
  std::string why;
  {
    std::lock_guard<std::mutex> lock(staleMutex_);
    auto it = stale_.find(*id);
    if (it == stale_.end()) {
      return nullptr;
    }
    why = it->second;
    if (deletion) {
      stale_.erase(it); // its last use
    }
  }
  auto done = c10::make_intrusive<c10::ivalue::Future>(
      at::AnyClassType::get(), devices);
  if (deletion) {
    // Nothing to delete: the owner and its value are gone.
    done->markCompleted(c10::IValue(rpc::RRefAck().toMessage()));
    return done;
  }
  std::ostringstream text;
  text << "RRef " << *id << " was owned by a previous holder of " << to
       << ", and its value is gone with it (" << why << "); the current " << to
       << " does not have it";
  done->setError(std::make_exception_ptr(std::runtime_error(text.str())));
  return done;
}

void RRefGuard::addMetrics(
    std::unordered_map<std::string, std::string>& m) const {
  if (!enabled_) {
    return;
  }
  m["rpc_ext.membership.dropped_forks"] = std::to_string(droppedForks_.load());
  m["rpc_ext.membership.dropped_autograd_contexts"] =
      std::to_string(droppedAutogradContexts_.load());
}

} // namespace torch_rpc_ext
