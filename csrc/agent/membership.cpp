// SPDX-License-Identifier: BSD-3-Clause
// A dynamic group's records and the roster they build (membership.h): the
// records' text, applied in order, and snapshots of the roster; the log in
// the store that holds them is membership_log.cpp.
#include "csrc/agent/membership.h"
#include "csrc/agent/membership_text.h"

#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/store_bytes.h"

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <vector>

namespace torch_rpc_ext {

namespace membership_text {

// No iostream: its number parsing goes through the locale's num_get facet,
// which crashed a build whose toolchain linked part of libstdc++ into the
// extension (a second copy of the facet ids; H200 run of 2026-11-26).
std::vector<std::string> headFields(const std::string& line, size_t most) {
  std::vector<std::string> out;
  size_t at = 0;
  while (out.size() < most) {
    at = line.find_first_not_of(' ', at);
    if (at == std::string::npos) {
      break;
    }
    if (out.size() + 1 == most) {
      out.push_back(line.substr(at));
      break;
    }
    size_t end = std::min(line.find(' ', at), line.size());
    out.push_back(line.substr(at, end - at));
    at = end;
  }
  return out;
}

std::string printable(const std::string& text, size_t n) {
  std::string out = text.substr(0, n);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) {
      c = '?';
    }
  }
  return out;
}

} // namespace membership_text

using membership_text::headFields;
using membership_text::printable;

namespace {

// Ranks fit dist autograd's 16-bit worker ids, as in a static group.
constexpr int32_t kMaxRank = 32767;
// A day: longer is not a lease.
constexpr int64_t kMaxLeaseMs = 86400 * 1000;

std::optional<uint64_t> parseIncarnation(const std::string& text) {
  if (text.empty() || text.size() > 16) {
    return std::nullopt;
  }
  uint64_t v = 0;
  for (char c : text) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v == 0 ? std::nullopt : std::optional<uint64_t>(v);
}

bool validName(const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return false;
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ||
          c == ':')) {
      return false;
    }
  }
  return true;
}

} // namespace

std::vector<rpc::WorkerInfo> View::infos() const {
  std::vector<rpc::WorkerInfo> out;
  for (const auto& p : byId) {
    if (p) {
      out.push_back(p->info);
    }
  }
  return out;
}

const char* eventKindName(MembershipEvent::Kind kind) {
  switch (kind) {
    case MembershipEvent::Kind::kJoin:
      return "join";
    case MembershipEvent::Kind::kLeave:
      return "leave";
    case MembershipEvent::Kind::kDead:
      return "dead";
    case MembershipEvent::Kind::kIgnored:
      return "ignored";
  }
  return "?";
}

std::string incarnationText(uint64_t incarnation) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, incarnation);
  return buf;
}

std::string secondsText(std::chrono::milliseconds ms) {
  auto tenths = ms.count() / 100;
  return std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + " s";
}

std::string joinRecord(const Member& m) {
  return "join " + incarnationText(m.incarnation) + " " +
      std::to_string(m.rank) + " " + m.name + " " + std::to_string(m.leaseMs) +
      "\n" + m.offers;
}

std::string leaveRecord(uint64_t incarnation) {
  return "leave " + incarnationText(incarnation);
}

std::string deadRecord(
    uint64_t incarnation,
    uint64_t reporter,
    const std::string& reason) {
  return "dead " + incarnationText(incarnation) + " " +
      incarnationText(reporter) + " " + reason;
}

const Member* Roster::byRank(int32_t rank) const {
  auto it = members_.find(rank);
  return it == members_.end() ? nullptr : &it->second;
}

const Member* Roster::byName(const std::string& name) const {
  auto it = rankByName_.find(name);
  return it == rankByName_.end() ? nullptr : byRank(it->second);
}

const Member* Roster::byIncarnation(uint64_t incarnation) const {
  auto it = rankByIncarnation_.find(incarnation);
  return it == rankByIncarnation_.end() ? nullptr : byRank(it->second);
}

void Roster::add(const Member& m, DeviceOffer offer) {
  members_[m.rank] = m;
  rankByName_[m.name] = m.rank;
  rankByIncarnation_[m.incarnation] = m.rank;
  if (offer.devices.empty() && offer.maps.empty()) {
    return;
  }
  for (const auto& [peer, map] : offer.maps) {
    mappedBy_[peer].insert(m.rank);
  }
  offers_[m.rank] = std::move(offer);
}

void Roster::remove(int32_t rank) {
  auto it = members_.find(rank);
  if (it == members_.end()) {
    return;
  }
  rankByName_.erase(it->second.name);
  rankByIncarnation_.erase(it->second.incarnation);
  if (auto o = offers_.find(rank); o != offers_.end()) {
    for (const auto& [peer, map] : o->second.maps) {
      auto by = mappedBy_.find(peer);
      by->second.erase(rank);
      if (by->second.empty()) {
        mappedBy_.erase(by);
      }
    }
    offers_.erase(o);
  }
  members_.erase(it);
}

std::string Roster::mapConflict(
    const std::string& name,
    const DeviceOffer& offer) const {
  // Only a map between the two can conflict: the members the joiner's
  // maps name, and those whose maps name it, in rank order.
  std::set<int32_t> ranks;
  for (const auto& [peer, map] : offer.maps) {
    if (const Member* m = byName(peer)) {
      ranks.insert(m->rank);
    }
  }
  if (auto it = mappedBy_.find(name); it != mappedBy_.end()) {
    ranks.insert(it->second.begin(), it->second.end());
  }
  static const DeviceOffer kNone;
  for (const int32_t rank : ranks) {
    auto o = offers_.find(rank);
    std::string conflict = deviceMapConflict(
        name,
        offer,
        members_.at(rank).name,
        o == offers_.end() ? kNone : o->second);
    if (!conflict.empty()) {
      return conflict;
    }
  }
  return "";
}

MembershipEvent Roster::apply(const std::string& record) {
  MembershipEvent ev;
  ev.epoch = ++epoch_;
  auto ignore = [&](std::string why) {
    ev.kind = MembershipEvent::Kind::kIgnored;
    ev.reason = std::move(why);
    return ev;
  };
  if (record.size() > kMaxRecordBytes) {
    return ignore("record of " + std::to_string(record.size()) + " bytes");
  }
  auto nl = record.find('\n');
  // "join <inc> <rank> <name> <lease ms>", "leave <inc>",
  // "dead <inc> <reporter> <reason...>".
  const auto head = headFields(record.substr(0, nl), 5);
  const std::string kind = head.empty() ? "" : head[0];
  const std::string incText = head.size() > 1 ? head[1] : "";
  auto inc = parseIncarnation(incText);
  if (!inc) {
    return ignore("malformed record '" + printable(record, 64) + "'");
  }
  if (kind == "join") {
    const std::string name = head.size() > 3 ? head[3] : "";
    const auto rankOr = head.size() > 2 ? decimal(head[2]) : std::nullopt;
    // The last field holds the rest of the line: one number, nothing more.
    const auto leaseOr = head.size() > 4 ? decimal(head[4]) : std::nullopt;
    const int64_t rank = rankOr.value_or(-1);
    const int64_t leaseMs = leaseOr.value_or(0);
    if (!rankOr || !leaseOr || rank < 0 || rank > kMaxRank ||
        !validName(name) || leaseMs <= 0 || leaseMs > kMaxLeaseMs) {
      return ignore("malformed join record '" + printable(record, 64) + "'");
    }
    ev.member.rank = static_cast<int32_t>(rank);
    ev.member.name = name;
    ev.member.incarnation = *inc;
    ev.member.leaseMs = leaseMs;
    ev.member.offers = nl == std::string::npos ? "" : record.substr(nl + 1);
    if (const Member* held = byRank(ev.member.rank)) {
      return ignore(
          "rank " + std::to_string(rank) + " is held by " + held->name);
    }
    if (const Member* held = byName(name)) {
      return ignore(
          "name " + name + " is held by rank " + std::to_string(held->rank));
    }
    if (byIncarnation(*inc)) {
      return ignore("incarnation " + incText + " joined twice");
    }
    // Every member judges device maps alike (a joiner checks them before
    // it appends, but two joining at once do not see each other).
    DeviceOffer offer = parseDeviceOffer(ev.member.offers);
    if (std::string conflict = mapConflict(name, offer); !conflict.empty()) {
      return ignore(conflict);
    }
    ev.kind = MembershipEvent::Kind::kJoin;
    add(ev.member, std::move(offer));
    return ev;
  }
  if (kind != "leave" && kind != "dead") {
    return ignore("unknown record kind '" + printable(kind, 16) + "'");
  }
  const Member* m = byIncarnation(*inc);
  if (!m) {
    // Someone else recorded it first (several survivors may declare the
    // same member dead), or it is not ours.
    return ignore(kind + " of a non-member (" + incText + ")");
  }
  ev.member = *m;
  if (kind == "dead") {
    // The reason: what follows the reporter, after one space.
    const auto dead = headFields(record.substr(0, nl), 4);
    std::string rest = dead.size() > 3 ? dead[3] : "";
    ev.kind = MembershipEvent::Kind::kDead;
    ev.reason = printable(rest, 512);
  } else {
    ev.kind = MembershipEvent::Kind::kLeave;
  }
  remove(m->rank);
  return ev;
}

MembershipEvent Roster::skip(std::string why) {
  MembershipEvent ev;
  ev.epoch = ++epoch_;
  ev.kind = MembershipEvent::Kind::kIgnored;
  ev.reason = std::move(why);
  return ev;
}

std::string Roster::snapshot() const {
  // Each member's join record, after its length: "<bytes>\n<record>".
  std::string out;
  for (const auto& [rank, m] : members_) {
    std::string record = joinRecord(m);
    out += std::to_string(record.size()) + "\n" + record;
  }
  return out;
}

bool Roster::restore(int64_t epoch, const std::string& text) {
  Roster r;
  size_t at = 0;
  while (at < text.size()) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos || nl - at > 8) {
      return false;
    }
    size_t n = 0;
    try {
      n = std::stoul(text.substr(at, nl - at));
    } catch (const std::exception&) {
      return false;
    }
    if (n > kMaxRecordBytes || n > text.size() - nl - 1) {
      return false;
    }
    if (r.apply(text.substr(nl + 1, n)).kind != MembershipEvent::Kind::kJoin) {
      return false;
    }
    at = nl + 1 + n;
  }
  r.epoch_ = epoch;
  *this = std::move(r);
  return true;
}

} // namespace torch_rpc_ext
