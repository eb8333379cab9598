// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's context (ipc_channel.h): viability, the descriptor a process
// publishes (IpcDomain), reach, counters.
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/common/host.h"

namespace torch_rpc_ext::channel::cuda {

IpcDomain IpcDomain::parse(const std::string& descriptor) {
  IpcDomain out;
  std::vector<std::string> parts;
  std::stringstream in(descriptor);
  std::string part;
  while (std::getline(in, part, ';')) {
    parts.push_back(part);
  }
  if (parts.empty()) {
    return out;
  }
  out.host = parts[0];
  if (parts.size() > 1) {
    std::stringstream list(parts[1]);
    std::string entry;
    while (std::getline(list, entry, ',')) {
      Device d;
      if (entry == "-") {
        // shares no memory
      } else if (!entry.empty() && entry[0] == '~') {
        // (A legacy block is copied out, never read peer to peer.)
        d.uuid = entry.substr(1, entry.find('+') - 1);
      } else {
        std::stringstream fields(entry);
        std::string field;
        std::getline(fields, d.uuid, '+');
        d.fd = true;
        while (std::getline(fields, field, '+')) {
          char* end = nullptr;
          errno = 0;
          const long index = std::strtol(field.c_str(), &end, 10);
          if (errno == 0 && !field.empty() && *end == '\0' && index >= 0 &&
              index < 1024) {
            d.peers.push_back(static_cast<int>(index));
          }
        }
      }
      out.devices.push_back(std::move(d));
    }
  }
  if (parts.size() > 2) {
    out.pidNamespace = parts[2];
  }
  if (parts.size() > 3) {
    out.pid = parts[3];
  }
  return out;
}

std::string IpcDomain::format() const {
  std::string out = host + ";";
  for (size_t i = 0; i < devices.size(); ++i) {
    const Device& d = devices[i];
    out += (i == 0 ? "" : ",") +
        (d.uuid.empty() ? std::string("-") : (d.fd ? "" : "~") + d.uuid);
    if (d.fd && !d.uuid.empty()) {
      for (int peer : d.peers) {
        out += "+" + std::to_string(peer);
      }
    }
  }
  return out + ";" + pidNamespace + ";" + pid;
}

std::optional<Sharing> IpcDomain::sharingWith(
    const IpcDomain& peer,
    const std::string& uuid) const {
  if (host.empty() || host != peer.host || uuid.empty()) {
    return std::nullopt;
  }
  auto find = [&](const std::vector<Device>& list) -> const Device* {
    for (const Device& d : list) {
      if (d.uuid == uuid) {
        return &d;
      }
    }
    return nullptr;
  };
  const Device* mine = find(devices);
  const Device* theirs = find(peer.devices);
  if (mine == nullptr || theirs == nullptr) {
    return std::nullopt;
  }
  if (!pid.empty() && pid == peer.pid && pidNamespace == peer.pidNamespace) {
    return std::nullopt; // this process: its own handles do not open here
  }
  if (mine->fd && theirs->fd) {
    return Sharing::kFd;
  }
  if (!pidNamespace.empty() && pidNamespace == peer.pidNamespace) {
    return Sharing::kLegacy;
  }
  return std::nullopt;
}

namespace {

class IpcContext final : public Context {
 public:
  explicit IpcContext(WireIds ids) : Context(ids) {}

  std::string name() const override {
    return "cuda_ipc";
  }
  DeviceKind device() const override {
    return DeviceKind::kCuda;
  }
  Channel::Mode mode() const override {
    return Channel::Mode::kRegion;
  }
  std::string unviableReason() const override {
    probe();
    return unviable_;
  }
  std::string domainDescriptor() const override {
    probe();
    return descriptor_;
  }
  bool reaches(const std::string& peerDescriptor) const override {
    probe();
    const IpcDomain peer = IpcDomain::parse(peerDescriptor);
    for (const auto& d : domain_.devices) {
      if (domain_.sharingWith(peer, d.uuid)) {
        return true;
      }
    }
    return false;
  }
  bool needsDescriptorPassing() const override {
    return true;
  }
  std::shared_ptr<Channel> open(
      std::weak_ptr<Host> host,
      const std::string& peerDescriptor) override {
    probe();
    return std::make_shared<IpcChannel>(
        shared_from_this(),
        std::move(host),
        counters_,
        domain_,
        IpcDomain::parse(peerDescriptor));
  }
  std::map<std::string, uint64_t> counters() const override {
    return {
        {"segments", counters_.segments.load()},
        {"copied_bytes", counters_.copiedBytes.load()},
        {"handbacks", counters_.handedBack.load()},
        {"blocks_created", counters_.created.load()},
        {"blocks_imported", counters_.imported.load()},
        {"blocks_unmapped", counters_.unmapped.load()},
        {"declined", counters_.declined.load()},
        {"launches", counters_.launches.load()},
        {"packed", counters_.packed.load()},
        {"blocks_legacy", counters_.legacyBlocks.load()},
        {"copied_out", counters_.copiedOut.load()},
        {"copy_outs_failed", counters_.copyOutsFailed.load()},
        {"blocks_refused", counters_.blocksRefused.load()},
        {"lending_refused", counters_.lendingRefused.load()},
        {"releases", counters_.releases.load()},
        {"release_frames", counters_.releaseFrames.load()},
        {"grants_made", counters_.grantsMade.load()},
        {"grants_used", counters_.grantsUsed.load()},
        {"grants_revoked", counters_.grantsRevoked.load()},
        {"grants_returned", counters_.grantsReturned.load()},
        {"grants_capped", counters_.grantsCapped.load()},
        {"grants_idle", counters_.grantsIdle.load()},
        {"grants_over_limit", counters_.grantsOverLimit.load()},
    };
  }

 private:
  // The driver is loaded here, on the first question that needs it, never
  // when the context is made.
  void probe() const {
    std::call_once(probed_, [this] {
      const std::string& boot = bootId();
      if (boot.empty()) {
        unviable_ = "cannot identify this host's kernel (no boot id)";
        return;
      }
      if (const char* ride = std::getenv("TORCH_RPC_EXT_CUDA_RELEASE_RIDE_MS");
          ride != nullptr && *ride != '\0') {
        char* end = nullptr;
        errno = 0;
        const long ms = std::strtol(ride, &end, 10);
        if (errno != 0 || end == ride || *end != '\0' || ms < 0 || ms > 10000) {
          unviable_ = std::string("TORCH_RPC_EXT_CUDA_RELEASE_RIDE_MS=") +
              ride + " is not a whole number of milliseconds from 0 to 10000";
          return;
        }
        setReleaseRideMs(ms);
      }
      if (const char* idle = std::getenv("TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS");
          idle != nullptr && *idle != '\0') {
        char* end = nullptr;
        errno = 0;
        const long long ms = std::strtoll(idle, &end, 10);
        if (errno != 0 || end == idle || *end != '\0' || ms < 0 ||
            ms > 3600000) {
          unviable_ = std::string("TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS=") + idle +
              " is not a whole number of milliseconds from 0 to 3600000";
          return;
        }
        setGrantIdleMs(ms);
      }
      IpcDomain domain;
      domain.host = boot;
      domain.pidNamespace = pidNamespace();
      domain.pid = std::to_string(::getpid());
      // Legacy handles only, even where descriptors work (to check that
      // path on a GPU that has both).
      const char* legacyOnly = std::getenv("TORCH_RPC_EXT_CUDA_IPC_LEGACY");
      const bool fdAllowed =
          legacyOnly == nullptr || std::string(legacyOnly) != "1";
      bool any = false;
      bool noEvents = false;
      try {
        const int devices = deviceCount();
        for (int d = 0; d < devices; ++d) {
          IpcDomain::Device device;
          // A block's memory is of no use without its events.
          const bool events = supportsIpcEvents(d);
          device.fd = events && fdAllowed && supportsFdExport(d);
          if (device.fd || (events && supportsLegacyIpc(d))) {
            device.uuid = deviceUuid(d);
            any = true;
          }
          // (No context needed: device attributes only.)
          for (int other = 0; device.fd && other < devices; ++other) {
            if (canAccessPeer(other, d)) {
              device.peers.push_back(other);
            }
          }
          noEvents = noEvents || !events;
          domain.devices.push_back(std::move(device));
        }
      } catch (const std::exception& e) {
        unviable_ = e.what();
        return;
      }
      if (!any) {
        unviable_ = noEvents
            ? "no CUDA device here has interprocess events "
              "(CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED is 0: vGPU, WSL, "
              "confidential computing), which cuda_ipc's blocks need"
            : "no CUDA device here can share memory with another process "
              "(neither as a file descriptor nor by a legacy IPC handle)";
        return;
      }
      descriptor_ = domain.format();
      domain_ = std::move(domain);
    });
  }

  mutable std::once_flag probed_;
  mutable std::string unviable_;
  mutable std::string descriptor_;
  mutable IpcDomain domain_; // what descriptor_ publishes
  mutable IpcCounters counters_;
};

} // namespace

std::shared_ptr<Context> createIpcChannel(WireIds ids) {
  return std::make_shared<IpcContext>(ids);
}

} // namespace torch_rpc_ext::channel::cuda
