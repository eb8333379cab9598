// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/aes_gcm_vaes.h"

#include <cstring>
#include <stdexcept>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace torch_rpc_ext::aes_gcm_vaes {

#if defined(__x86_64__)

// GCC 12's AVX-512 intrinsics start from deliberately undefined registers
// (_mm512_undefined_epi32) and warn of them wherever they are inlined (GCC
// bug 105593, fixed in GCC 13); nothing here reads an undefined value.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Every function that uses the instructions is compiled for them (and only
// they: the rest of the extension stays generic x86-64); supported() guards
// the calls. The fixed loops are unrolled on purpose: at -O2 (setup.py) the
// compiler keeps their arrays of registers in memory otherwise, at half the
// speed.
#define TRE_VAES         \
  __attribute__((target( \
      "avx512f,avx512bw,avx512vl,vaes,vpclmulqdq,aes,pclmul,avx2,sse4.1")))

namespace {

// The hash in GCM multiplies in GF(2^128) modulo g = x^128 + x^7 + x^2 + x
// + 1, the first bit of a block being the coefficient of x^0. A block here
// is byte-reversed when loaded, so that as a 128-bit integer its bit 127 is
// x^0's coefficient (bit-reflected: bit i holds x^(127-i)). The carry-less
// product of two such integers, 256 bits, then holds the product
// polynomial times x reflected over 256 bits; keeping the hash key's
// powers times x^-1 cancels that x, so the product needs no shift before
// it is reduced. The reduction folds the low 64 bits (degrees 192-255),
// then the next 64 (128-191), each by a carry-less multiplication with
// x^128 mod g reflected (0xC2 << 56, with the x^0 term of the fold done by
// swapping the halves): the usual two-multiplication fold for this form.
TRE_VAES inline __m128i byteReverseMask() {
  return _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

TRE_VAES inline __m128i byteReverse(__m128i x) {
  return _mm_shuffle_epi8(x, byteReverseMask());
}

TRE_VAES inline __m128i polynomial() {
  return _mm_set_epi64x(static_cast<long long>(0xC200000000000000ull), 1);
}

// (lo, mi, hi): the 256-bit product lo ^ mi << 64 ^ hi << 128.
TRE_VAES inline __m128i reduce(__m128i lo, __m128i mi, __m128i hi) {
  const __m128i g = polynomial();
  __m128i t = _mm_clmulepi64_si128(lo, g, 0x10);
  mi = _mm_ternarylogic_epi64(mi, _mm_shuffle_epi32(lo, 0x4e), t, 0x96);
  t = _mm_clmulepi64_si128(mi, g, 0x10);
  return _mm_ternarylogic_epi64(hi, _mm_shuffle_epi32(mi, 0x4e), t, 0x96);
}

// a * b, for a reflected and b a power of the hash key as Schedule keeps it.
TRE_VAES inline __m128i multiply(__m128i a, __m128i b) {
  __m128i lo = _mm_clmulepi64_si128(a, b, 0x00);
  __m128i hi = _mm_clmulepi64_si128(a, b, 0x11);
  __m128i mi = _mm_xor_si128(
      _mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10));
  return reduce(lo, mi, hi);
}

TRE_VAES inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

TRE_VAES inline __m128i encryptBlock(const Schedule& s, __m128i b) {
  b = _mm_xor_si128(b, load16(s.roundKeys[0]));
#pragma GCC unroll 16
  for (int r = 1; r < 10; ++r) {
    b = _mm_aesenc_si128(b, load16(s.roundKeys[r]));
  }
  return _mm_aesenclast_si128(b, load16(s.roundKeys[10]));
}

TRE_VAES inline __m128i keyStep(__m128i key, __m128i assist) {
  assist = _mm_shuffle_epi32(assist, 0xff);
  key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
  key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
  key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
  return _mm_xor_si128(key, assist);
}

// Zeroes `n` bytes at `p` with stores the compiler may not drop (a memset
// of a buffer about to go out of scope is a dead store to it).
inline void wipe(void* p, size_t n) {
  volatile uint8_t* v = static_cast<volatile uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    v[i] = 0;
  }
}

// Run right after crypt() returns, over the stack it used: its frame may
// hold spilled round keys, powers of the hash key and products with them
// (the key's secrets outlive a record otherwise). crypt's frame is about
// 1.5 KiB at -O2; 512 word stores, ~0.2 us against a 256 KiB record's ~20.
__attribute__((noinline)) void scrubStack() {
  volatile uint64_t scratch[512]; // 4 KiB, in word stores
  for (size_t i = 0; i < 512; ++i) {
    scratch[i] = 0;
  }
}

// The four 128-bit lanes of `z` XORed together.
TRE_VAES inline __m128i foldLanes(__m512i z) {
  __m256i a = _mm256_xor_si256(
      _mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
  return _mm_xor_si128(
      _mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}

// The schedule broadcast into registers for a step of sixteen blocks.
struct Wide {
  __m512i roundKeys[11];
  __m512i powers[4]; // H^16..H^13, H^12..H^9, H^8..H^5, H^4..H^1
  __m512i reverse;
};

TRE_VAES inline void widen(const Schedule& s, Wide* w) {
#pragma GCC unroll 16
  for (int r = 0; r < 11; ++r) {
    w->roundKeys[r] = _mm512_broadcast_i32x4(load16(s.roundKeys[r]));
  }
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    w->powers[i] = _mm512_loadu_si512(s.powers[4 * i]);
  }
  w->reverse = _mm512_broadcast_i32x4(byteReverseMask());
}

// The hash `y` after sixteen more blocks of ciphertext (c0 .. c3, four
// each, in memory order): y' = (y ^ C1) H^16 ^ C2 H^15 ^ ... ^ C16 H, the
// products summed unreduced and reduced once.
TRE_VAES inline __m128i hash16(
    const Wide& w,
    __m128i y,
    __m512i c0,
    __m512i c1,
    __m512i c2,
    __m512i c3) {
  __m512i x[4] = {
      _mm512_xor_si512(
          _mm512_shuffle_epi8(c0, w.reverse), _mm512_zextsi128_si512(y)),
      _mm512_shuffle_epi8(c1, w.reverse),
      _mm512_shuffle_epi8(c2, w.reverse),
      _mm512_shuffle_epi8(c3, w.reverse)};
  __m512i lo = _mm512_setzero_si512();
  __m512i mi = _mm512_setzero_si512();
  __m512i hi = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    const __m512i& h = w.powers[i];
    lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(x[i], h, 0x00));
    hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(x[i], h, 0x11));
    mi = _mm512_ternarylogic_epi64(
        mi,
        _mm512_clmulepi64_epi128(x[i], h, 0x01),
        _mm512_clmulepi64_epi128(x[i], h, 0x10),
        0x96);
  }
  return reduce(foldLanes(lo), foldLanes(mi), foldLanes(hi));
}

// The hash `y` after `n` bytes at `p`, one block at a time, the last one
// zero-padded.
TRE_VAES inline __m128i hashBytes(
    __m128i y,
    __m128i h,
    const uint8_t* p,
    size_t n) {
  for (; n >= 16; n -= 16, p += 16) {
    y = multiply(_mm_xor_si128(y, byteReverse(load16(p))), h);
  }
  if (n > 0) {
    uint8_t block[16] = {};
    std::memcpy(block, p, n);
    y = multiply(_mm_xor_si128(y, byteReverse(load16(block))), h);
  }
  return y;
}

TRE_VAES void crypt(
    const Schedule& s,
    const uint8_t nonce[12],
    const uint8_t* aad,
    size_t aadSize,
    const uint8_t* in,
    uint8_t* out,
    size_t size,
    uint8_t tag[16],
    bool encrypt) {
  Wide w;
  widen(s, &w);
  const __m128i h = load16(s.powers[15]);
  uint8_t j0Bytes[16];
  std::memcpy(j0Bytes, nonce, 12);
  j0Bytes[12] = 0;
  j0Bytes[13] = 0;
  j0Bytes[14] = 0;
  j0Bytes[15] = 1;
  const __m128i j0 = load16(j0Bytes);
  __m128i y = hashBytes(_mm_setzero_si128(), h, aad, aadSize);
  // Counter blocks byte-reversed, so the big-endian 32-bit counter is
  // dword 0, where a 32-bit add wraps it as GCM's inc32 does. The first
  // block's counter is 2 (1 is the tag's).
  __m512i counters = _mm512_add_epi32(
      _mm512_broadcast_i32x4(byteReverse(j0)),
      _mm512_set_epi32(0, 0, 0, 4, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1));
  const __m512i four =
      _mm512_set_epi32(0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4);
  size_t i = 0;
  for (; size - i >= 256; i += 256) {
    __m512i k[4];
#pragma GCC unroll 16
    for (int q = 0; q < 4; ++q) {
      k[q] = _mm512_xor_si512(
          _mm512_shuffle_epi8(counters, w.reverse), w.roundKeys[0]);
      counters = _mm512_add_epi32(counters, four);
    }
#pragma GCC unroll 16
    for (int r = 1; r < 10; ++r) {
#pragma GCC unroll 16
      for (int q = 0; q < 4; ++q) {
        k[q] = _mm512_aesenc_epi128(k[q], w.roundKeys[r]);
      }
    }
    __m512i v[4];
#pragma GCC unroll 16
    for (int q = 0; q < 4; ++q) {
      k[q] = _mm512_aesenclast_epi128(k[q], w.roundKeys[10]);
      v[q] = _mm512_loadu_si512(in + i + 64 * q);
    }
    if (!encrypt) { // all loaded before any store: `out` may be `in`
      y = hash16(w, y, v[0], v[1], v[2], v[3]);
    }
#pragma GCC unroll 16
    for (int q = 0; q < 4; ++q) {
      v[q] = _mm512_xor_si512(v[q], k[q]);
      _mm512_storeu_si512(out + i + 64 * q, v[q]);
    }
    if (encrypt) {
      y = hash16(w, y, v[0], v[1], v[2], v[3]);
    }
  }
  // Under sixteen blocks left: one at a time, the last one partial.
  __m128i counter = _mm512_castsi512_si128(counters);
  const __m128i one = _mm_set_epi32(0, 0, 0, 1);
  uint8_t block[16];
  for (; i < size; i += 16) {
    size_t n = size - i < 16 ? size - i : 16;
    std::memset(block, 0, sizeof(block));
    std::memcpy(block, in + i, n);
    __m128i v = load16(block);
    __m128i key = encryptBlock(s, byteReverse(counter));
    counter = _mm_add_epi32(counter, one);
    if (!encrypt) {
      y = multiply(_mm_xor_si128(y, byteReverse(v)), h);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(block), _mm_xor_si128(v, key));
    std::memcpy(out + i, block, n);
    if (encrypt) { // the ciphertext, zero-padded
      std::memset(block + n, 0, sizeof(block) - n);
      y = multiply(_mm_xor_si128(y, byteReverse(load16(block))), h);
    }
  }
  wipe(block, sizeof(block)); // no keystream left behind
  uint8_t lengths[16];
  const uint64_t aadBits = static_cast<uint64_t>(aadSize) * 8;
  const uint64_t bits = static_cast<uint64_t>(size) * 8;
  for (int b = 0; b < 8; ++b) {
    lengths[b] = static_cast<uint8_t>(aadBits >> (56 - 8 * b));
    lengths[8 + b] = static_cast<uint8_t>(bits >> (56 - 8 * b));
  }
  y = multiply(_mm_xor_si128(y, byteReverse(load16(lengths))), h);
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(tag),
      _mm_xor_si128(byteReverse(y), encryptBlock(s, j0)));
}

} // namespace

namespace {

// CPUID and XGETBV directly: GCC's and Clang's __builtin_cpu_supports do not
// all know "vaes" (Clang 14 does not).
bool detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) {
    return false;
  }
  const bool pclmul = c & (1u << 1), ssse3 = c & (1u << 9);
  const bool sse41 = c & (1u << 19), aesni = c & (1u << 25);
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  if (!pclmul || !ssse3 || !sse41 || !aesni || !osxsave || !avx) {
    return false;
  }
  // The OS saves SSE, AVX and the AVX-512 state (opmask, ZMM0-15's upper
  // halves, ZMM16-31): XCR0 bits 1, 2, 5, 6, 7.
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0xe6u) != 0xe6u) {
    return false;
  }
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    return false;
  }
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16);
  const bool avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
  const bool vaes = c & (1u << 9), vpclmulqdq = c & (1u << 10);
  return avx2 && avx512f && avx512bw && avx512vl && vaes && vpclmulqdq;
}

} // namespace

bool supported() {
  static const bool yes = detect();
  return yes;
}

TRE_VAES void expand(const uint8_t key[16], Schedule* s) {
  __m128i rk[11];
  rk[0] = load16(key);
  // _mm_aeskeygenassist_si128 takes its round constant as an immediate.
  rk[1] = keyStep(rk[0], _mm_aeskeygenassist_si128(rk[0], 0x01));
  rk[2] = keyStep(rk[1], _mm_aeskeygenassist_si128(rk[1], 0x02));
  rk[3] = keyStep(rk[2], _mm_aeskeygenassist_si128(rk[2], 0x04));
  rk[4] = keyStep(rk[3], _mm_aeskeygenassist_si128(rk[3], 0x08));
  rk[5] = keyStep(rk[4], _mm_aeskeygenassist_si128(rk[4], 0x10));
  rk[6] = keyStep(rk[5], _mm_aeskeygenassist_si128(rk[5], 0x20));
  rk[7] = keyStep(rk[6], _mm_aeskeygenassist_si128(rk[6], 0x40));
  rk[8] = keyStep(rk[7], _mm_aeskeygenassist_si128(rk[7], 0x80));
  rk[9] = keyStep(rk[8], _mm_aeskeygenassist_si128(rk[8], 0x1b));
  rk[10] = keyStep(rk[9], _mm_aeskeygenassist_si128(rk[9], 0x36));
  for (int r = 0; r < 11; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s->roundKeys[r]), rk[r]);
  }
  wipe(rk, sizeof(rk));
  // H = E(0), reflected, times x^-1: shifted left one bit as an integer,
  // g folded back in when x^0's coefficient (bit 127) falls off.
  __m128i hash = byteReverse(encryptBlock(*s, _mm_setzero_si128()));
  __m128i carries = _mm_srli_epi64(hash, 63);
  __m128i h = _mm_or_si128(_mm_slli_epi64(hash, 1), _mm_slli_si128(carries, 8));
  __m128i top = _mm_shuffle_epi32(_mm_srai_epi32(hash, 31), 0xff);
  h = _mm_xor_si128(h, _mm_and_si128(top, polynomial()));
  __m128i power = h; // H^1 x^-1; multiply(H^i x^-1, H x^-1) = H^(i+1) x^-1
  for (int i = 15; i >= 0; --i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s->powers[i]), power);
    power = multiply(power, h);
  }
  scrubStack();
}

void seal(
    const Schedule& schedule,
    const uint8_t nonce[12],
    const uint8_t* aad,
    size_t aadSize,
    const uint8_t* in,
    uint8_t* out,
    size_t size,
    uint8_t tag[16]) {
  crypt(schedule, nonce, aad, aadSize, in, out, size, tag, true);
  scrubStack();
}

void open(
    const Schedule& schedule,
    const uint8_t nonce[12],
    const uint8_t* aad,
    size_t aadSize,
    const uint8_t* in,
    uint8_t* out,
    size_t size,
    uint8_t expectedTag[16]) {
  crypt(schedule, nonce, aad, aadSize, in, out, size, expectedTag, false);
  scrubStack();
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#else // not x86-64: supported() is false, so Aead never calls the others

bool supported() {
  return false;
}

namespace {
[[noreturn]] void unsupported() {
  throw std::logic_error("aes_gcm_vaes used where supported() is false");
}
} // namespace

void expand(const uint8_t*, Schedule*) {
  unsupported();
}

void seal(
    const Schedule&,
    const uint8_t*,
    const uint8_t*,
    size_t,
    const uint8_t*,
    uint8_t*,
    size_t,
    uint8_t*) {
  unsupported();
}

void open(
    const Schedule&,
    const uint8_t*,
    const uint8_t*,
    size_t,
    const uint8_t*,
    uint8_t*,
    size_t,
    uint8_t*) {
  unsupported();
}

#endif

} // namespace torch_rpc_ext::aes_gcm_vaes
