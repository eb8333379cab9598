// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace torch_rpc_ext {

using Digest = std::array<uint8_t, 32>;

// HMAC-SHA256 (RFC 2104) of `message` under `key`, computed by OpenSSL's
// libcrypto (found at run time: csrc/common/libcrypto.h). Thread-safe.
// Throws std::runtime_error if libcrypto is unusable (see requireLibcrypto).
Digest hmacSha256(std::string_view key, std::string_view message);

// Throws std::runtime_error naming libcrypto, what was tried and how to fix
// it, unless hmacSha256 can work. Agent::create calls it first, so an absent
// libcrypto is an error at agent creation, never in a handshake.
void requireLibcrypto();

// Which libcrypto computes hmacSha256: "<OpenSSL version> (<file>)".
// Throws as requireLibcrypto does.
std::string libcryptoDescription();

// Compares two digests in time independent of where they differ.
bool constantTimeEqual(const Digest& a, const Digest& b);

// `n` bytes from the kernel CSPRNG (getrandom(2)); throws std::runtime_error
// if the kernel cannot provide them.
std::string randomBytes(size_t n);

} // namespace torch_rpc_ext
