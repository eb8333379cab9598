// SPDX-License-Identifier: BSD-3-Clause
// The membership log in the store (membership.h): records proven under a key
// drawn from the group's secret, appended at the next free epoch, read
// back, and folded into snapshots joiners start from.
#include "csrc/agent/membership.h"
#include "csrc/agent/membership_text.h"

#include "csrc/agent/store_bytes.h"
#include "csrc/common/crypto.h"

#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

namespace torch_rpc_ext {

namespace {

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

std::string logName(int64_t epoch) {
  return "log/" + std::to_string(epoch);
}

} // namespace

using membership_text::headFields;
using membership_text::printable;

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
