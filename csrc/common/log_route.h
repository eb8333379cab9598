// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// What logging.h's lines carry and where they go (docs/observability.md,
// "Logs"). Each line says its level, its time (UTC), the worker this
// process runs and its pid; TORCH_RPC_EXT_LOG_FORMAT=json writes it as one
// JSON object instead, and torch_rpc_ext.logs hands it to Python's logging.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace torch_rpc_ext {

// The worker this process runs, named in every line from now on ("" before
// its first init_rpc; an agent's name stays after its shutdown, until the
// next agent's).
void setLogWorker(const std::string& name);

// A line of the Python package (a launcher's note, a module's record with
// no handler to take it) as the core writes one, at `level` (kLogWarning
// or kLogError), naming `worker` ("" for the process's own).
void logLineOf(int level, const std::string& worker, const std::string& line);

// What TORCH_RPC_EXT_LOG and TORCH_RPC_EXT_LOG_FORMAT say wrong, or "" when
// both are unset or valid (the agent refuses to start on a wrong one).
std::string logSettingsError();

// Python levels: 10 debug, 30 warning, 40 error (the core writes no error
// lines; the Python package's modules may).
constexpr int kLogDebug = 10;
constexpr int kLogWarning = 30;
constexpr int kLogError = 40;

// Lines handed to a consumer (torch_rpc_ext.logs: Python's logging) rather
// than written to stderr. While routed, lines wait in a queue of at most
// kLogQueueLines (more are counted as dropped) for takeLogs(). `debug` also
// turns debug lines on. Unrouted, they go to stderr again, and a forked
// child starts unrouted (it has no consumer).
constexpr size_t kLogQueueLines = 10000;
void routeLogs(bool on, bool debug);

struct LogLine {
  int level = kLogWarning;
  int64_t unixNs = 0;
  std::string worker;
  std::string message;
};

// Waits up to `timeoutMs` for a line while routed, then returns the lines
// queued (at most `max`) and, through `dropped`, how many were dropped since
// the last take.
std::vector<LogLine> takeLogs(size_t max, int timeoutMs, uint64_t* dropped);

// The line as this process writes it on stderr (TORCH_RPC_EXT_LOG_FORMAT:
// text, or json), no newline: for a line routed to a logger with no handler
// (torch_rpc_ext.logs writes it so rather than as Python's bare message).
std::string formatLogLine(const LogLine& line);

// `text` as a JSON string (quotes included): control characters and bytes
// that are not UTF-8 escaped.
std::string jsonString(const std::string& text);

} // namespace torch_rpc_ext
