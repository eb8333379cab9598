// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/logging.h"
#include "csrc/common/log_route.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <string_view>

namespace torch_rpc_ext {

namespace {

enum class Level { kDebug, kWarning, kError, kOff };
enum class Format { kText, kJson };

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// TORCH_RPC_EXT_LOG: unset or anything but these is warnings (the agent
// refuses a value it does not know: logSettingsError).
Level envLevel() {
  static const Level lv = [] {
    const std::string v = env("TORCH_RPC_EXT_LOG");
    if (v == "debug") {
      return Level::kDebug;
    }
    if (v == "error") {
      return Level::kError;
    }
    if (v == "off") {
      return Level::kOff;
    }
    return Level::kWarning;
  }();
  return lv;
}

Format format() {
  static const Format f = std::string(env("TORCH_RPC_EXT_LOG_FORMAT")) == "json"
      ? Format::kJson
      : Format::kText;
  return f;
}

// Never destroyed: loop threads log while a process exits without
// rpc.shutdown(), after static destructors have run. A forked child gets a
// fresh one (beforeFork).
struct State {
  std::mutex mutex;
  std::condition_variable ready;
  std::string worker;
  bool routed = false;
  std::deque<LogLine> queue;
  uint64_t dropped = 0;
  struct Seen {
    std::chrono::steady_clock::time_point last;
    uint64_t left = 0;
  };
  std::map<std::string, Seen> seen;
};

std::atomic<State*> g_state{nullptr};
std::atomic<bool> g_routedDebug{false};

// The forking thread holds the mutex across fork(), so that the child
// copies a State no thread was changing; the parent lets it go, the child
// leaves it held and starts from a fresh State.
void beforeFork() {
  g_state.load()->mutex.lock();
}

void afterForkInParent() {
  g_state.load()->mutex.unlock();
}

void afterForkInChild() {
  State* old = g_state.load();
  auto* fresh = new State;
  fresh->worker = old->worker;
  g_state.store(fresh);
  g_routedDebug.store(false);
}

State& state() {
  static State* const first = [] {
    auto* s = new State;
    g_state.store(s);
    pthread_atfork(beforeFork, afterForkInParent, afterForkInChild);
    return s;
  }();
  (void)first;
  return *g_state.load();
}

// Debug lines: TORCH_RPC_EXT_LOG=debug, or a logger enabled for DEBUG that
// the lines are routed to, unless TORCH_RPC_EXT_LOG says error or off.
bool enabled(int level) {
  if (level >= kLogError) {
    return envLevel() <= Level::kError;
  }
  if (level >= kLogWarning) {
    return envLevel() <= Level::kWarning;
  }
  return envLevel() == Level::kDebug ||
      (envLevel() == Level::kWarning && g_routedDebug.load());
}

int64_t nowUnixNs() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// 2026-12-03T17:20:01.123Z (digits: 3 or 6 after the point).
std::string isoTime(int64_t unixNs, int digits) {
  const time_t secs = static_cast<time_t>(unixNs / 1000000000);
  const auto frac = static_cast<long>(unixNs % 1000000000);
  tm utc{};
  gmtime_r(&secs, &utc);
  char head[32];
  std::strftime(head, sizeof(head), "%Y-%m-%dT%H:%M:%S", &utc);
  char out[48];
  if (digits == 3) {
    std::snprintf(out, sizeof(out), "%s.%03ldZ", head, frac / 1000000);
  } else {
    std::snprintf(out, sizeof(out), "%s.%06ldZ", head, frac / 1000);
  }
  return out;
}

const char* levelName(int level) {
  return level >= kLogError  ? "error"
      : level >= kLogWarning ? "warning"
                             : "debug";
}

const char* levelLetter(int level) {
  return level >= kLogError ? "E" : level >= kLogWarning ? "W" : "D";
}

// Structured outputs name the logger; the message need not.
std::string withoutPrefix(const std::string& line) {
  constexpr std::string_view kPrefix = "torch_rpc_ext: ";
  return std::string_view(line).substr(0, kPrefix.size()) == kPrefix
      ? line.substr(kPrefix.size())
      : line;
}

void emit(int level, const std::string& line, const std::string* worker) {
  LogLine r{level, nowUnixNs(), {}, line};
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    r.worker = worker != nullptr ? *worker : s.worker;
    if (s.routed) {
      if (s.queue.size() >= kLogQueueLines) {
        ++s.dropped;
      } else {
        s.queue.push_back(std::move(r));
      }
      s.ready.notify_one();
      return;
    }
  }
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "%s\n", formatLogLine(r).c_str());
}

// The length of the UTF-8 sequence at p (1-4), or 0 if it is not one.
size_t utf8Length(const unsigned char* p, size_t left) {
  const unsigned char c = p[0];
  size_t n = 0;
  uint32_t min = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    min = 0x80;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    min = 0x800;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    min = 0x10000;
  } else {
    return 0;
  }
  if (left < n) {
    return 0;
  }
  uint32_t cp = c & (0x7F >> n);
  for (size_t i = 1; i < n; ++i) {
    if ((p[i] & 0xC0) != 0x80) {
      return 0;
    }
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    return 0;
  }
  return n;
}

} // namespace

std::string jsonString(const std::string& text) {
  std::string out = "\"";
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t size = text.size();
  for (size_t i = 0; i < size;) {
    const unsigned char c = p[i];
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
      ++i;
    } else if (c == '\n') {
      out += "\\n";
      ++i;
    } else if (c < 0x20 || c == 0x7F) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\u%04x", c);
      out += esc;
      ++i;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
    } else if (size_t n = utf8Length(p + i, size - i)) {
      out.append(text, i, n);
      i += n;
    } else {
      out += "\\ufffd"; // a byte that is not UTF-8
      ++i;
    }
  }
  out += '"';
  return out;
}

std::string formatLogLine(const LogLine& r) {
  if (format() == Format::kJson) {
    return std::string("{\"time\":\"") + isoTime(r.unixNs, 6) +
        "\",\"level\":\"" + levelName(r.level) +
        "\",\"logger\":\"torch_rpc_ext\",\"worker\":" +
        (r.worker.empty() ? std::string("null") : jsonString(r.worker)) +
        ",\"pid\":" + std::to_string(getpid()) +
        ",\"message\":" + jsonString(withoutPrefix(r.message)) + "}";
  }
  return std::string("[") + levelLetter(r.level) + " " + isoTime(r.unixNs, 3) +
      " " + (r.worker.empty() ? "-" : r.worker) +
      " pid=" + std::to_string(getpid()) + "] " + r.message;
}

void logWarning(const std::string& line) {
  if (enabled(kLogWarning)) {
    emit(kLogWarning, line, nullptr);
  }
}

void logDebug(const std::string& line) {
  if (enabled(kLogDebug)) {
    emit(kLogDebug, line, nullptr);
  }
}

void logWarningLimited(const char* key, const std::string& line) {
  if (!enabled(kLogWarning)) {
    return;
  }
  State& s = state();
  const auto now = std::chrono::steady_clock::now();
  uint64_t left = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto [it, fresh] = s.seen.try_emplace(key);
    if (!fresh && now - it->second.last < std::chrono::seconds(10)) {
      ++it->second.left;
      return;
    }
    left = it->second.left;
    it->second = State::Seen{now, 0};
  }
  emit(
      kLogWarning,
      left == 0 ? line
                : line + " (and " + std::to_string(left) +
              " more like it in the last 10 s)",
      nullptr);
}

void logLineOf(int level, const std::string& worker, const std::string& line) {
  level = level >= kLogError ? kLogError : kLogWarning;
  if (enabled(level)) {
    emit(level, line, worker.empty() ? nullptr : &worker);
  }
}

std::string errnoText(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

void setLogWorker(const std::string& name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.worker = name;
}

std::string logSettingsError() {
  const std::string level = env("TORCH_RPC_EXT_LOG");
  if (!level.empty() && level != "debug" && level != "warning" &&
      level != "error" && level != "off") {
    return "TORCH_RPC_EXT_LOG='" + level +
        "' is not a log level: use debug, warning (the default), error or off";
  }
  const std::string fmt = env("TORCH_RPC_EXT_LOG_FORMAT");
  if (!fmt.empty() && fmt != "text" && fmt != "json" && fmt != "python") {
    return "TORCH_RPC_EXT_LOG_FORMAT='" + fmt +
        "' is not a log format: use text (the default), json or python";
  }
  return "";
}

void routeLogs(bool on, bool debug) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.routed = on;
  g_routedDebug.store(on && debug);
  s.ready.notify_all();
}

std::vector<LogLine> takeLogs(size_t max, int timeoutMs, uint64_t* dropped) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  if (timeoutMs > 0) {
    s.ready.wait_for(lock, std::chrono::milliseconds(timeoutMs), [&] {
      return !s.queue.empty() || s.dropped > 0 || !s.routed;
    });
  }
  std::vector<LogLine> out;
  while (!s.queue.empty() && out.size() < max) {
    out.push_back(std::move(s.queue.front()));
    s.queue.pop_front();
  }
  *dropped = s.dropped;
  s.dropped = 0;
  return out;
}

} // namespace torch_rpc_ext
