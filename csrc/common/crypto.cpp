// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/crypto.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace torch_rpc_ext {

namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
    0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
    0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

// Incremental hasher: absorb() any number of times, then finish().
class Sha256 {
 public:
  void absorb(const uint8_t* data, size_t size) {
    total_ += size;
    while (size > 0) {
      size_t take = std::min(size, sizeof(block_) - used_);
      std::memcpy(block_ + used_, data, take);
      used_ += take;
      data += take;
      size -= take;
      if (used_ == sizeof(block_)) {
        compress();
        used_ = 0;
      }
    }
  }

  Digest finish() {
    uint64_t bits = total_ * 8;
    uint8_t pad = 0x80;
    absorb(&pad, 1);
    uint8_t zero = 0;
    while (used_ != 56) {
      absorb(&zero, 1);
    }
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) {
      length[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    }
    absorb(length, 8);
    Digest out;
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) {
        out[4 * i + j] = static_cast<uint8_t>(state_[i] >> (24 - 8 * j));
      }
    }
    return out;
  }

 private:
  void compress() {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (uint32_t(block_[4 * i]) << 24) |
          (uint32_t(block_[4 * i + 1]) << 16) |
          (uint32_t(block_[4 * i + 2]) << 8) | uint32_t(block_[4 * i + 3]);
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
      uint32_t ch = (e & f) ^ (~e & g);
      uint32_t t1 = h + s1 + ch + kRound[i] + w[i];
      uint32_t s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
      uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
      uint32_t t2 = s0 + maj;
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  uint32_t state_[8] = {
      0x6a09e667,
      0xbb67ae85,
      0x3c6ef372,
      0xa54ff53a,
      0x510e527f,
      0x9b05688c,
      0x1f83d9ab,
      0x5be0cd19};
  uint8_t block_[64] = {};
  size_t used_ = 0;
  uint64_t total_ = 0;
};

const uint8_t* bytes(std::string_view s) {
  return reinterpret_cast<const uint8_t*>(s.data());
}

} // namespace

Digest sha256(std::string_view data) {
  Sha256 h;
  h.absorb(bytes(data), data.size());
  return h.finish();
}

Digest hmacSha256(std::string_view key, std::string_view message) {
  uint8_t block[64] = {};
  if (key.size() > sizeof(block)) {
    Digest k = sha256(key);
    std::memcpy(block, k.data(), k.size());
  } else {
    std::memcpy(block, key.data(), key.size());
  }
  uint8_t ipad[64], opad[64];
  for (int i = 0; i < 64; ++i) {
    ipad[i] = block[i] ^ 0x36;
    opad[i] = block[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.absorb(ipad, sizeof(ipad));
  inner.absorb(bytes(message), message.size());
  Digest innerDigest = inner.finish();
  Sha256 outer;
  outer.absorb(opad, sizeof(opad));
  outer.absorb(innerDigest.data(), innerDigest.size());
  return outer.finish();
}

bool constantTimeEqual(const Digest& a, const Digest& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= a[i] ^ b[i];
  }
  return diff == 0;
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw std::runtime_error(
          std::string("getrandom failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(got);
  }
  return out;
}

} // namespace torch_rpc_ext
