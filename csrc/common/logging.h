// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <string>

namespace torch_rpc_ext {

// Warnings go to stderr unless TORCH_RPC_EXT_LOG=error or =off; debug lines
// only with TORCH_RPC_EXT_LOG=debug. Thread-safe; never takes the GIL. Each
// line says its time, its worker and its pid, as text or JSON, or goes to
// Python's logging (log_route.h).
void logWarning(const std::string& line);
void logDebug(const std::string& line);

// A warning that may repeat without bound (a peer's doing: refused
// connections, descriptor exhaustion): at most one line per `key` every 10
// s, the next one saying how many were left out meanwhile.
void logWarningLimited(const char* key, const std::string& line);

// "<what>: <strerror(errno)>", for errors from system calls.
std::string errnoText(const char* what);

} // namespace torch_rpc_ext
