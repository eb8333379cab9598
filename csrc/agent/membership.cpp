// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/membership.h"

#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/store_bytes.h"
#include "csrc/common/crypto.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <vector>

namespace torch_rpc_ext {

namespace {

// Ranks fit dist autograd's 16-bit worker ids, as in a static group.
constexpr int32_t kMaxRank = 32767;
// A day: longer is not a lease.
constexpr int64_t kMaxLeaseMs = 86400 * 1000;
// A snapshot: every member's join record.
constexpr size_t kMaxSnapshotBytes = 256 * 1024 * 1024;
// A proven record's or snapshot's first line: "proof " and 64 hex digits.
constexpr size_t kProofLineBytes = 6 + 64 + 1;
// What the proof key is drawn for from the group's secret (HMAC-SHA256 of
// this under the secret): no other use of the secret shares it.
constexpr const char* kProofPurpose = "torch_rpc_ext membership log v1";

std::string hexText(const Digest& d) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out(2 * d.size(), '0');
  for (size_t i = 0; i < d.size(); ++i) {
    out[2 * i] = kDigits[d[i] >> 4];
    out[2 * i + 1] = kDigits[d[i] & 0xf];
  }
  return out;
}

// The record's head line, split at spaces: at most `most` fields, the last
// one taking the rest of the line (a dead record's reason has spaces).
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

std::string logName(int64_t epoch) {
  return "log/" + std::to_string(epoch);
}

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

// What a record says, fit for a log line and a Python str: printable ASCII,
// at most `n` characters.
std::string printable(const std::string& text, size_t n) {
  std::string out = text.substr(0, n);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) {
      c = '?';
    }
  }
  return out;
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

MembershipLog::MembershipLog(
    c10::intrusive_ptr<::c10d::Store> store,
    const std::string& secret,
    std::string prefix)
    : store_(std::move(store)), prefix_(std::move(prefix)) {
  if (!secret.empty()) {
    const Digest key = hmacSha256(secret, kProofPurpose);
    proofKey_.assign(reinterpret_cast<const char*>(key.data()), key.size());
  }
}

std::string MembershipLog::seal(const std::string& key, const std::string& body)
    const {
  if (proofKey_.empty()) {
    return body;
  }
  // Bound to the key: the same record proves nothing at another epoch.
  return "proof " + hexText(hmacSha256(proofKey_, key + "\n" + body)) + "\n" +
      body;
}

LogRecord MembershipLog::open(
    const std::string& key,
    const std::string& stored,
    size_t maxBody) const {
  LogRecord r;
  if (stored.size() > maxBody + kProofLineBytes) {
    r.oversized = stored.size(); // not ours: an empty body, unproven
    return r;
  }
  if (stored.size() < kProofLineBytes || stored.compare(0, 6, "proof ") != 0 ||
      stored[kProofLineBytes - 1] != '\n') {
    r.body = stored; // bare: a forgery, or a test's record
    return r;
  }
  r.body = stored.substr(kProofLineBytes);
  if (!proofKey_.empty()) {
    const std::string want =
        hexText(hmacSha256(proofKey_, key + "\n" + r.body));
    r.proven = constantTimeEqual(want.data(), stored.data() + 6, want.size());
  }
  return r;
}

std::optional<LogRecord> MembershipLog::read(int64_t epoch) const {
  const std::string key = prefix_ + logName(epoch);
  auto stored = peek(key);
  if (!stored) {
    return std::nullopt;
  }
  return open(key, *stored, kMaxRecordBytes);
}

std::string MembershipLog::claimFormat() const {
  const std::string key = prefix_ + "format";
  if (auto found = peek(key)) {
    return printable(*found, 64);
  }
  if (peek(prefix_ + logName(1))) {
    // Records. A joiner of ours claims the format before its record, so
    // a format there now is one that came while we looked; none at all
    // is an earlier version's log.
    auto found = peek(key);
    return found ? printable(*found, 64) : std::string();
  }
  return printable(
      fromBytes(store_->compareSet(key, {}, toBytes(std::string(kLogFormat)))),
      64);
}

int64_t MembershipLog::append(const std::string& record, int64_t after) const {
  for (int64_t e = after + 1;; ++e) {
    // Claiming the key and writing the record are one step: no holes, no
    // lock to leave behind.
    const std::string key = prefix_ + logName(e);
    const auto bytes = toBytes(seal(key, record));
    auto got = store_->compareSet(key, {}, bytes);
    if (got == bytes) {
      return e;
    }
  }
}

int64_t MembershipLog::nextGeneration(int32_t rank) const {
  return store_->add("gen/" + std::to_string(rank), 1);
}

void MembershipLog::beat(uint64_t incarnation) const {
  // Our counter, with its proof: only we write our key (a store's add()
  // would let anyone renew our lease, or a dead member's).
  const std::string key = prefix_ + "beat/" + incarnationText(incarnation);
  const int64_t n = beatsSent_.fetch_add(1) + 1;
  store_->set(key, toBytes(seal(key, std::to_string(n))));
}

std::optional<std::string> MembershipLog::peek(const std::string& key) const {
  return peekKey(*store_, key);
}

int64_t MembershipLog::readNumber(const std::string& key) const {
  auto text = peek(key);
  if (!text) {
    return 0;
  }
  LogRecord r = open(key, *text, 64);
  if (!proofKey_.empty() && !r.proven) {
    return 0; // not the group's: as if absent
  }
  return decimal(r.body).value_or(0);
}

int64_t MembershipLog::beats(uint64_t incarnation) const {
  // Read, not add(0): that would create the key again after forget().
  return readNumber(prefix_ + "beat/" + incarnationText(incarnation));
}

void MembershipLog::ack(uint64_t incarnation, int64_t epoch) const {
  const std::string key = prefix_ + "ack/" + incarnationText(incarnation);
  store_->set(key, toBytes(seal(key, std::to_string(epoch))));
}

int64_t MembershipLog::acked(uint64_t incarnation) const {
  return readNumber(prefix_ + "ack/" + incarnationText(incarnation));
}

void MembershipLog::writeSnapshot(int64_t epoch, const std::string& text)
    const {
  const std::string key = prefix_ + "snap/" + std::to_string(epoch);
  const auto bytes = toBytes(seal(key, text));
  // (Ours, or the same text another member wrote at this epoch.)
  const bool stands = store_->compareSet(key, {}, bytes) == bytes;
  // Then the pointer, which only moves forward, except off a snapshot that
  // is not proven (a writer's pointer far ahead would otherwise send every
  // joiner to the log's first record for good). It holds the newest
  // snapshot's epoch, then the one it replaced ("130 64"): that one is
  // kept for a joiner that read the pointer just before it moved, and the
  // one before it deleted, so a long-lived group's store keeps two
  // snapshots, not one every snapshotEvery() epochs. A joiner whose
  // snapshot went meanwhile (it stalled across two moves) reads the
  // pointer again (latestSnapshot).
  const std::string pointer = prefix_ + "snap/latest";
  std::optional<std::string> current = peek(pointer);
  for (int round = 0; round < 8; ++round) { // (a writer may keep moving it)
    int64_t latest = 0;
    int64_t before = 0;
    if (current) {
      const auto fields = headFields(*current, 2);
      const auto first = fields.empty() ? std::nullopt : decimal(fields[0]);
      // Garbage: replaced.
      latest = first ? *first : std::numeric_limits<int64_t>::max();
      if (fields.size() == 2) {
        before = decimal(fields[1]).value_or(0);
      }
    }
    if (latest >= epoch &&
        (proofKey_.empty() || latestSnapshot().first == latest)) {
      if (latest > epoch && before != epoch && stands) {
        // Passed already: no pointer will name ours (a member that wrote
        // the same epoch earlier may have had it named, as the one kept).
        deleteUnneeded(*store_, key);
      }
      return;
    }
    auto expected = current ? toBytes(*current) : std::vector<uint8_t>{};
    const int64_t kept =
        latest < epoch && latest > 0 ? latest : 0; // (garbage names none)
    auto desired = toBytes(std::to_string(epoch) + " " + std::to_string(kept));
    auto got = store_->compareSet(pointer, expected, desired);
    if (got == desired) {
      if (kept > 0 && before > 0 && before < kept) {
        deleteUnneeded(*store_, prefix_ + "snap/" + std::to_string(before));
      }
      return;
    }
    current = fromBytes(got); // moved meanwhile: judge that
  }
}

std::pair<int64_t, std::string> MembershipLog::latestSnapshot() const {
  // A pointer among snapshots, each proven by itself: "<newest> <previous>".
  // The one it names can be gone by the time we read it: we stalled while
  // the pointer moved twice (the second move deletes it). Then the pointer
  // names a newer one: read it again, a few times at most (a writer may
  // keep moving it; past that, the log from its first record).
  const std::string pointerKey = prefix_ + "snap/latest";
  std::optional<std::string> pointer = peek(pointerKey);
  for (int round = 0; pointer && round < 4; ++round) {
    const auto fields = headFields(*pointer, 2);
    const int64_t epoch = fields.empty() ? 0 : decimal(fields[0]).value_or(0);
    if (epoch <= 0) {
      break;
    }
    const std::string key = prefix_ + "snap/" + std::to_string(epoch);
    if (std::optional<std::string> text = peek(key)) {
      LogRecord snapshot = open(key, *text, kMaxSnapshotBytes);
      if (!proofKey_.empty() && !snapshot.proven) {
        break;
      }
      return {epoch, std::move(snapshot.body)};
    }
    std::optional<std::string> now = peek(pointerKey);
    if (now == pointer) {
      break; // named and missing (not moved past): the log, then
    }
    pointer = std::move(now);
  }
  return {0, ""};
}

int64_t MembershipLog::snapshotEvery() {
  if (const char* env = std::getenv("TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY")) {
    try {
      const int64_t n = std::stoll(env);
      if (n > 0) {
        return n;
      }
    } catch (const std::logic_error&) {
    }
  }
  return kSnapshotEvery;
}

void MembershipLog::forget(uint64_t incarnation) const {
  store_->deleteKey(prefix_ + "beat/" + incarnationText(incarnation));
  store_->deleteKey(prefix_ + "ack/" + incarnationText(incarnation));
}

} // namespace torch_rpc_ext
