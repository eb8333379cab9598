// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/logging.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

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

std::string errnoText(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

} // namespace torch_rpc_ext
