// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// What the roster (membership.cpp) and the log (membership_log.cpp) both
// read of a record's text. Threads: any (functions of their arguments).

#include <cstddef>
#include <string>
#include <vector>

namespace torch_rpc_ext::membership_text {

// The record's head line, split at spaces: at most `most` fields, the last
// one taking the rest of the line (a dead record's reason has spaces).
std::vector<std::string> headFields(const std::string& line, size_t most);

// What a record says, fit for a log line and a Python str: printable ASCII,
// at most `n` characters.
std::string printable(const std::string& text, size_t n);

} // namespace torch_rpc_ext::membership_text
