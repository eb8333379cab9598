// SPDX-License-Identifier: BSD-3-Clause
// AES-128-GCM (NIST SP 800-38D: 96-bit nonces, 128-bit tags) on the
// AVX-512 VAES and VPCLMULQDQ instructions: sixteen blocks a step, four in
// each 512-bit register, for both the counter mode and the hash. The lanes'
// records (channel/lanes) go through it where the CPU has them (crypto.h,
// Aead): on the x86 servers this project runs on, libcrypto 3.0's
// AES-GCM uses 128-bit registers and runs at about half this speed
// (docs/performance.md, "AES-GCM of our own").
//
// Constant time: no table lookups and no branch on a key, nonce or byte.
// Checked against libcrypto's EVP on every length from 0 to 600 bytes and
// on random ones, in place and not (tests/unit/test_crypto_and_frames.py),
// and against the GCM specification's test vectors.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torch_rpc_ext::aes_gcm_vaes {

// The largest message one record may hold: GCM's 32-bit block counter
// starts at 2 for the first block (SP 800-38D, 5.2.1.1).
inline constexpr uint64_t kMaxBytes = (uint64_t(1) << 36) - 32;

// Whether this CPU runs the code below, and the OS saves its registers:
// AVX-512 F, BW and VL, VAES, VPCLMULQDQ, AES-NI and PCLMULQDQ. False on
// other architectures.
bool supported();

// A key, expanded once: the AES round keys and the first sixteen powers of
// the hash key. Wiped by its owner (Aead) when done with.
struct alignas(64) Schedule {
  uint8_t roundKeys[11][16];
  // H^16 .. H^1, each times x^-1 and bit-reflected (the form the
  // multiplication in aes_gcm_vaes.cpp takes), in the order a step's
  // blocks meet them: powers[0] for its first block, powers[15] for its
  // last (and for single blocks).
  uint8_t powers[16][16];
};

// Requires supported(), as do the two below.
void expand(const uint8_t key[16], Schedule* schedule);

// Encrypts `size` bytes (at most kMaxBytes) of `in` into `out` (which may
// be `in`, not otherwise overlapping) and writes the tag over `aad` and
// the ciphertext.
void seal(
    const Schedule& schedule,
    const uint8_t nonce[12],
    const uint8_t* aad,
    size_t aadSize,
    const uint8_t* in,
    uint8_t* out,
    size_t size,
    uint8_t tag[16]);

// Decrypts `in` into `out` (the same rules) and writes the tag the
// ciphertext should have come with; the caller compares it, in constant
// time, with the one that came.
void open(
    const Schedule& schedule,
    const uint8_t nonce[12],
    const uint8_t* aad,
    size_t aadSize,
    const uint8_t* in,
    uint8_t* out,
    size_t size,
    uint8_t expectedTag[16]);

} // namespace torch_rpc_ext::aes_gcm_vaes
