// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/logging.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace torch_rpc_ext {

namespace {

enum class Level { kDebug, kWarning, kError };

Level level() {
  static const Level lv = [] {
    const char* v = std::getenv("TORCH_RPC_EXT_LOG");
    if (v == nullptr) {
      return Level::kWarning;
    }
    if (std::strcmp(v, "debug") == 0) {
      return Level::kDebug;
    }
    if (std::strcmp(v, "error") == 0 || std::strcmp(v, "off") == 0) {
      return Level::kError;
    }
    return Level::kWarning;
  }();
  return lv;
}

void emit(const char* tag, const std::string& line) {
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[%s] %s\n", tag, line.c_str());
}

} // namespace

void logWarning(const std::string& line) {
  if (level() <= Level::kWarning) {
    emit("W", line);
  }
}

void logDebug(const std::string& line) {
  if (level() <= Level::kDebug) {
    emit("D", line);
  }
}

void logWarningLimited(const char* key, const std::string& line) {
  if (level() > Level::kWarning) {
    return;
  }
  struct Seen {
    std::chrono::steady_clock::time_point last;
    uint64_t left = 0;
  };
  struct State {
    std::mutex mutex;
    std::map<std::string, Seen> seen;
  };
  // Never destroyed: loop threads log while a process exits without
  // rpc.shutdown(), after static destructors have run.
  static State* const state = new State;
  const auto now = std::chrono::steady_clock::now();
  uint64_t left = 0;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    auto [it, fresh] = state->seen.try_emplace(key);
    if (!fresh && now - it->second.last < std::chrono::seconds(10)) {
      ++it->second.left;
      return;
    }
    left = it->second.left;
    it->second = Seen{now, 0};
  }
  emit(
      "W",
      left == 0 ? line
                : line + " (and " + std::to_string(left) +
              " more like it in the last 10 s)");
}

std::string errnoText(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

} // namespace torch_rpc_ext
