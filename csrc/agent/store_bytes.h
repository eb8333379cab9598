// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch_rpc_ext {

// A c10d Store keeps values as bytes; the agent's keys hold text.
inline std::string fromBytes(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

inline std::vector<uint8_t> toBytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

} // namespace torch_rpc_ext
