// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/cpace.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace torch_rpc_ext::cpace {

namespace {

// GF(2^255 - 19) on five 51-bit limbs (value = sum v[i] * 2^(51 i)), as in
// the "donna" X25519 code. Limbs stay below 2^52 between operations (each
// result is carried), so products fit 128 bits with room for the * 19 fold.
struct Fe {
  uint64_t v[5];
};

constexpr uint64_t kMask51 = (uint64_t(1) << 51) - 1;
using u128 = unsigned __int128;

uint64_t load64(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, 8); // x86 and arm64 are little-endian
  return x;
}

Fe small(uint64_t x) {
  return Fe{{x, 0, 0, 0, 0}};
}

// Carries every limb into the next, the top one folded back times 19.
void carry(Fe& f) {
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < 4; ++i) {
      f.v[i + 1] += f.v[i] >> 51;
      f.v[i] &= kMask51;
    }
    f.v[0] += 19 * (f.v[4] >> 51);
    f.v[4] &= kMask51;
  }
}

Fe add(const Fe& a, const Fe& b) {
  Fe r;
  for (int i = 0; i < 5; ++i) {
    r.v[i] = a.v[i] + b.v[i];
  }
  carry(r);
  return r;
}

// a - b as a + 4p - b (4p's limbs exceed any carried limb of b).
Fe sub(const Fe& a, const Fe& b) {
  constexpr uint64_t kFourP0 = 4 * ((uint64_t(1) << 51) - 19);
  constexpr uint64_t kFourP = 4 * kMask51;
  Fe r;
  r.v[0] = a.v[0] + kFourP0 - b.v[0];
  for (int i = 1; i < 5; ++i) {
    r.v[i] = a.v[i] + kFourP - b.v[i];
  }
  carry(r);
  return r;
}

Fe mul(const Fe& a, const Fe& b) {
  const uint64_t* x = a.v;
  const uint64_t* y = b.v;
  const uint64_t y1 = 19 * y[1], y2 = 19 * y[2], y3 = 19 * y[3], y4 = 19 * y[4];
  u128 r0 = u128(x[0]) * y[0] + u128(x[1]) * y4 + u128(x[2]) * y3 +
      u128(x[3]) * y2 + u128(x[4]) * y1;
  u128 r1 = u128(x[0]) * y[1] + u128(x[1]) * y[0] + u128(x[2]) * y4 +
      u128(x[3]) * y3 + u128(x[4]) * y2;
  u128 r2 = u128(x[0]) * y[2] + u128(x[1]) * y[1] + u128(x[2]) * y[0] +
      u128(x[3]) * y4 + u128(x[4]) * y3;
  u128 r3 = u128(x[0]) * y[3] + u128(x[1]) * y[2] + u128(x[2]) * y[1] +
      u128(x[3]) * y[0] + u128(x[4]) * y4;
  u128 r4 = u128(x[0]) * y[4] + u128(x[1]) * y[3] + u128(x[2]) * y[2] +
      u128(x[3]) * y[1] + u128(x[4]) * y[0];
  r1 += uint64_t(r0 >> 51);
  r2 += uint64_t(r1 >> 51);
  r3 += uint64_t(r2 >> 51);
  r4 += uint64_t(r3 >> 51);
  Fe r{
      {uint64_t(r0) & kMask51,
       uint64_t(r1) & kMask51,
       uint64_t(r2) & kMask51,
       uint64_t(r3) & kMask51,
       uint64_t(r4) & kMask51}};
  r.v[0] += 19 * uint64_t(r4 >> 51);
  carry(r);
  return r;
}

// a^e for a public exponent `e` (32 bytes, little-endian): square and
// multiply, the branches on `e` only.
Fe power(const Fe& a, const uint8_t (&e)[32]) {
  Fe r = small(1);
  for (int bit = 255; bit >= 0; --bit) {
    r = mul(r, r);
    if ((e[bit / 8] >> (bit % 8)) & 1) {
      r = mul(r, a);
    }
  }
  return r;
}

// p - 2 (inversion, 0 -> 0) and (p - 1) / 2 (Euler's criterion).
constexpr uint8_t kPMinus2[32] = {
    0xeb, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
constexpr uint8_t kHalfPMinus1[32] = {
    0xf6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f};

Fe fromBytes(const uint8_t* s) {
  Fe f{
      {load64(s) & kMask51,
       (load64(s + 6) >> 3) & kMask51,
       (load64(s + 12) >> 6) & kMask51,
       (load64(s + 19) >> 1) & kMask51,
       (load64(s + 24) >> 12) & kMask51}};
  return f;
}

// The canonical little-endian encoding (the value reduced below p).
void toBytes(Fe f, uint8_t* out) {
  carry(f);
  // q = 1 exactly when f >= p: f + 19 then carries past 2^255.
  uint64_t q = (f.v[0] + 19) >> 51;
  for (int i = 1; i < 5; ++i) {
    q = (f.v[i] + q) >> 51;
  }
  f.v[0] += 19 * q;
  for (int i = 0; i < 4; ++i) {
    f.v[i + 1] += f.v[i] >> 51;
    f.v[i] &= kMask51;
  }
  f.v[4] &= kMask51; // drops the 2^255 that q's 19 carried up
  uint8_t bytes[40] = {};
  unsigned bit = 0;
  for (int i = 0; i < 5; ++i, bit += 51) {
    for (unsigned b = 0; b < 51; ++b) {
      unsigned at = bit + b;
      bytes[at / 8] |= uint8_t(((f.v[i] >> b) & 1) << (at % 8));
    }
  }
  std::memcpy(out, bytes, 32);
}

// All ones when the canonical forms of a and b are equal, else zero; in time
// independent of both.
uint64_t equalMask(const Fe& a, const Fe& b) {
  uint8_t x[32], y[32];
  toBytes(a, x);
  toBytes(b, y);
  uint8_t diff = 0;
  for (int i = 0; i < 32; ++i) {
    diff |= uint8_t(x[i] ^ y[i]);
  }
  // diff - 1 wraps to all ones only from 0.
  return 0 - ((uint64_t(diff) - 1) >> 63);
}

// a where mask is all ones, b where it is zero.
Fe select(uint64_t mask, const Fe& a, const Fe& b) {
  Fe r;
  for (int i = 0; i < 5; ++i) {
    r.v[i] = (a.v[i] & mask) | (b.v[i] & ~mask);
  }
  return r;
}

} // namespace

std::string mapToCurve25519(std::string_view r) {
  if (r.size() != 32) {
    throw std::invalid_argument(
        "Elligator 2 takes a 32-byte field element, not " +
        std::to_string(r.size()) + " bytes");
  }
  uint8_t in[32];
  std::memcpy(in, r.data(), 32);
  in[31] &= 0x7f;
  const Fe u = fromBytes(in);
  const Fe zero = small(0);
  const Fe one = small(1);
  const Fe a = small(486662);
  // x1 = -A / (1 + 2 u^2), or -A where the denominator is 0 (inv0(0) = 0).
  Fe u2 = mul(u, u);
  Fe denominator = add(one, add(u2, u2));
  Fe x1 = sub(zero, mul(a, power(denominator, kPMinus2)));
  x1 = select(equalMask(x1, zero), sub(zero, a), x1);
  // g(x) = x^3 + A x^2 + x = x (x (x + A) + 1); x2 = -x1 - A.
  Fe gx1 = mul(x1, add(mul(x1, add(x1, a)), one));
  Fe x2 = sub(sub(zero, x1), a);
  // gx1 is a square (or zero) when gx1^((p-1)/2) is 1 (or 0).
  Fe legendre = power(gx1, kHalfPMinus1);
  uint64_t square = equalMask(legendre, one) | equalMask(legendre, zero);
  std::string out(32, '\0');
  toBytes(select(square, x1, x2), reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

std::string generator(std::string_view key, std::string_view sessionId) {
  std::string message(kGeneratorLabel);
  message.append(sessionId);
  Digest d = hmacSha256(key, message);
  return mapToCurve25519(
      std::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

Exchange::Exchange(std::string_view key, std::string sessionId)
    : sessionId_(std::move(sessionId)) {
  share_ = scalar_.agree(generator(key, sessionId_));
}

std::string Exchange::finish(std::string_view peerShare, bool client) const {
  std::string k = scalar_.agree(std::string(peerShare));
  std::string transcript(kKeyLabel);
  transcript += sessionId_;
  transcript += client ? share_ : std::string(peerShare);
  transcript += client ? std::string(peerShare) : share_;
  Digest d = hmacSha256(k, transcript);
  // The Diffie-Hellman secret, wiped once used.
  std::memset(k.data(), 0, k.size());
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

} // namespace torch_rpc_ext::cpace
