// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace torch_rpc_ext {

using Digest = std::array<uint8_t, 32>;

// SHA-256 (FIPS 180-4) of `data`. Self-contained so the extension does not
// depend on a system crypto library.
Digest sha256(std::string_view data);

// HMAC-SHA256 (RFC 2104) of `message` under `key`.
Digest hmacSha256(std::string_view key, std::string_view message);

// Compares two digests in time independent of where they differ.
bool constantTimeEqual(const Digest& a, const Digest& b);

// `n` bytes from the kernel CSPRNG (getrandom(2)); throws std::runtime_error
// if the kernel cannot provide them.
std::string randomBytes(size_t n);

} // namespace torch_rpc_ext
