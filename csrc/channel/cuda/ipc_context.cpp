// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's context (ipc_channel.h): viability, the descriptor a process
// publishes, reach, counters.
#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/ipc_channel.h"
#include "csrc/common/host.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// "<boot id>;<uuid of device 0>,<uuid of device 1>,..." <-> its parts: the
// UUID of every device of the process in index order, "-" for one that
// cannot export memory.
std::pair<std::string, std::vector<std::string>> parseDescriptor(
    const std::string& d) {
  auto semi = d.find(';');
  if (semi == std::string::npos) {
    return {d, {}};
  }
  std::vector<std::string> uuids;
  std::stringstream rest(d.substr(semi + 1));
  std::string uuid;
  while (std::getline(rest, uuid, ',')) {
    uuids.push_back(uuid == "-" ? std::string() : uuid);
  }
  return {d.substr(0, semi), std::move(uuids)};
}

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
    auto [peerHost, peerDevices] = parseDescriptor(peerDescriptor);
    auto [host, devices] = parseDescriptor(descriptor_);
    if (host.empty() || host != peerHost) {
      return false;
    }
    for (const auto& uuid : devices) {
      if (!uuid.empty() &&
          std::find(peerDevices.begin(), peerDevices.end(), uuid) !=
              peerDevices.end()) {
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
    return std::make_shared<IpcChannel>(
        shared_from_this(),
        std::move(host),
        counters_,
        parseDescriptor(peerDescriptor).second);
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
      std::string uuids;
      bool any = false;
      try {
        for (int d = 0; d < deviceCount(); ++d) {
          bool exports = supportsFdExport(d);
          any = any || exports;
          uuids += (d == 0 ? "" : ",") + (exports ? deviceUuid(d) : "-");
        }
      } catch (const std::exception& e) {
        unviable_ = e.what();
        return;
      }
      if (!any) {
        unviable_ =
            "no CUDA device here can export memory as a file descriptor";
        return;
      }
      descriptor_ = boot + ";" + uuids;
    });
  }

  mutable std::once_flag probed_;
  mutable std::string unviable_;
  mutable std::string descriptor_;
  mutable IpcCounters counters_;
};

} // namespace

std::shared_ptr<Context> createIpcChannel(WireIds ids) {
  return std::make_shared<IpcContext>(ids);
}

} // namespace torch_rpc_ext::channel::cuda
