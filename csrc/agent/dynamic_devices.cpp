// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/dynamic_devices.h"

#include <algorithm>
#include <sstream>

namespace torch_rpc_ext {

namespace {

constexpr const char* kDevicesLine = "devices";
constexpr const char* kDeviceMapLine = "devicemap";

std::string cudaName(int index) {
  return "cuda:" + std::to_string(index);
}

std::string listText(const std::vector<int>& devices) {
  std::string out = "[";
  for (size_t i = 0; i < devices.size(); ++i) {
    out += (i ? ", " : "") + cudaName(devices[i]);
  }
  return out + "]";
}

// "<l>:<r>,..." -> pairs; false if malformed.
bool parsePairs(const std::string& text, std::map<int, int>* out) {
  std::istringstream in(text);
  std::string pair;
  while (std::getline(in, pair, ',')) {
    auto colon = pair.find(':');
    if (colon == std::string::npos) {
      return false;
    }
    try {
      int l = std::stoi(pair.substr(0, colon));
      int r = std::stoi(pair.substr(colon + 1));
      if (l < 0 || r < 0) {
        return false;
      }
      (*out)[l] = r;
    } catch (const std::exception&) {
      return false;
    }
  }
  return true;
}

// Where `from`'s map to `to` lands on a device `to` does not publish.
std::string offTarget(
    const std::string& from,
    const DeviceOffer& fromOffer,
    const std::string& to,
    const DeviceOffer& toOffer) {
  auto it = fromOffer.maps.find(to);
  if (it == fromOffer.maps.end()) {
    return "";
  }
  for (const auto& [l, r] : it->second) {
    if (std::find(toOffer.devices.begin(), toOffer.devices.end(), r) ==
        toOffer.devices.end()) {
      return from + " maps its " + cudaName(l) + " to " + cudaName(r) + " of " +
          to + ", which receives CUDA tensors on " + listText(toOffer.devices) +
          " only (in a dynamic group a member receives them on the devices "
          "it names in `devices` or in its own device maps)";
    }
  }
  return "";
}

} // namespace

std::string deviceOfferLines(
    const std::vector<c10::Device>& devices,
    const std::unordered_map<std::string, rpc::DeviceMap>& maps) {
  std::vector<int> cuda;
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      cuda.push_back(d.index());
    }
  }
  if (cuda.empty()) {
    return "";
  }
  std::string out = std::string("\n") + kDevicesLine + " ";
  for (size_t i = 0; i < cuda.size(); ++i) {
    out += (i ? "," : "") + std::to_string(cuda[i]);
  }
  // In name order: every member writes the same record for the same maps.
  std::map<std::string, const rpc::DeviceMap*> sorted;
  for (const auto& [peer, map] : maps) {
    sorted.emplace(peer, &map);
  }
  for (const auto& [peer, map] : sorted) {
    std::map<int, int> pairs;
    for (const auto& [from, to] : *map) {
      if (from.is_cuda() && to.is_cuda()) {
        pairs[from.index()] = to.index();
      }
    }
    if (pairs.empty()) {
      continue;
    }
    out += std::string("\n") + kDeviceMapLine + " " + peer + " ";
    bool first = true;
    for (const auto& [l, r] : pairs) {
      out += (first ? "" : ",") + std::to_string(l) + ":" + std::to_string(r);
      first = false;
    }
  }
  return out;
}

DeviceOffer parseDeviceOffer(const std::string& offers) {
  DeviceOffer out;
  std::istringstream lines(offers);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string kind;
    fields >> kind;
    if (kind == kDevicesLine) {
      std::string list;
      fields >> list;
      std::istringstream in(list);
      std::string item;
      while (std::getline(in, item, ',')) {
        try {
          int d = std::stoi(item);
          if (d >= 0) {
            out.devices.push_back(d);
          }
        } catch (const std::exception&) {
        }
      }
    } else if (kind == kDeviceMapLine) {
      std::string peer, pairs;
      fields >> peer >> pairs;
      std::map<int, int> map;
      if (!peer.empty() && parsePairs(pairs, &map)) {
        out.maps[peer] = std::move(map);
      }
    }
  }
  return out;
}

std::string deviceMapConflict(
    const std::string& me,
    const DeviceOffer& mine,
    const std::string& peer,
    const DeviceOffer& theirs) {
  std::string why = offTarget(me, mine, peer, theirs);
  return why.empty() ? offTarget(peer, theirs, me, mine) : why;
}

rpc::DeviceMap reverseMapOf(
    const DeviceOffer& peerOffer,
    const std::string& me) {
  rpc::DeviceMap out;
  auto it = peerOffer.maps.find(me);
  if (it == peerOffer.maps.end()) {
    return out;
  }
  for (const auto& [l, r] : it->second) {
    out.emplace(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(r)),
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(l)));
  }
  return out;
}

} // namespace torch_rpc_ext
