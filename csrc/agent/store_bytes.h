// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

// A c10d Store keeps values as bytes; the agent's keys hold text.
inline std::string fromBytes(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

inline std::vector<uint8_t> toBytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// A decimal integer filling `text` whole, or nothing.
inline std::optional<int64_t> decimal(const std::string& text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end || text.empty()) {
    return std::nullopt;
  }
  return v;
}

// A key's value, or nothing if it has none, at once. check() then get() is
// a race: a key deleted in between (a member that leaves deletes its keys,
// a joiner its request for the secret) leaves get() blocked for the store's
// whole timeout (60 s by default). A compareSet whose expected value is a
// text no key holds writes nothing and answers at once, on every c10d
// store: the key's value, or our expected value back when there is no key.
// That text is drawn at random once per process: a fixed one (it was
// "\0absent" until session 93) written into a key by anyone who can write
// the store made the key read as empty, for good (a slot of the membership
// log then stopped every member there, and a joiner's init_rpc spun).
inline std::optional<std::string> peekKey(
    ::c10d::Store& store,
    const std::string& key) {
  static const std::vector<uint8_t> kAbsent = [] {
    std::string text("\0absent/", 8);
    for (const unsigned char c : randomBytes(16)) {
      text += "0123456789abcdef"[c >> 4];
      text += "0123456789abcdef"[c & 15];
    }
    return toBytes(text);
  }();
  auto got = store.compareSet(key, kAbsent, kAbsent);
  if (got == kAbsent) {
    return std::nullopt;
  }
  return fromBytes(got);
}

// A counter's value (0 if it has none), read without writing: add(key, 0)
// reads it too, but a FileStore appends every add to its file, which never
// shrinks (a watcher that read two counters that way every turn grew a
// group's file by about 500 bytes a second per member). Every c10d store
// keeps a counter as its decimal text.
inline int64_t readCounter(::c10d::Store& store, const std::string& key) {
  const std::optional<std::string> text = peekKey(store, key);
  if (!text) {
    return 0;
  }
  const std::optional<int64_t> v = decimal(*text);
  if (!v) {
    throw std::runtime_error(
        "the rendezvous store's counter " + key +
        " holds something other than a number");
  }
  return *v;
}

// Deletes a key we no longer need (a store that cannot delete keeps it, as
// it would have before we cleaned up: said once, never an error).
inline void deleteUnneeded(::c10d::Store& store, const std::string& key) {
  try {
    store.deleteKey(key);
  } catch (const std::exception& e) {
    logWarningLimited(
        "store_delete",
        "torch_rpc_ext: the rendezvous store could not delete " + key + " (" +
            e.what() + "); keys the group no longer needs stay there");
  }
}

} // namespace torch_rpc_ext
