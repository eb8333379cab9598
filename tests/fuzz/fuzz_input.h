// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Shared by the libFuzzer targets of tests/fuzz: a front-to-back reader of
// the fuzz input and the check that turns a broken invariant into a finding.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

namespace torch_rpc_ext::fuzz {

// Reads the input in order. Past its end every read yields zeros (or fewer
// bytes), so a target never checks lengths itself and a short input is just
// an input whose tail is zero. The layout of each target's input is written
// at the top of its file (and produced by make_seeds.py).
class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  template <typename T>
  T take() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v{};
    size_t n = std::min(sizeof(T), remaining());
    if (n > 0) {
      std::memcpy(&v, data_ + pos_, n);
    }
    pos_ += n;
    return v;
  }

  // Up to `n` bytes (fewer at the end of the input).
  std::string takeBytes(size_t n) {
    n = std::min(n, remaining());
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

  std::string takeRest() {
    return takeBytes(remaining());
  }

  size_t remaining() const {
    return size_ - pos_;
  }
  bool empty() const {
    return pos_ == size_;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Writes `n` bytes of `pattern` repeated, starting at its byte `at` (mod
// its size), and advances `at`; zeros for an empty pattern. Fast for large
// `n`: the part already written doubles.
inline void fillRepeating(
    char* dst,
    size_t n,
    const std::string& pattern,
    size_t& at) {
  size_t p = pattern.size();
  if (p == 0) {
    std::memset(dst, 0, n);
    return;
  }
  // One period, rotated to start at `at`; the filled part then stays a
  // whole number of periods, so copying it keeps the phase.
  size_t from = at % p;
  size_t done = std::min(n, p - from);
  std::memcpy(dst, pattern.data() + from, done);
  if (done < n) {
    size_t k = std::min(n - done, from);
    std::memcpy(dst + done, pattern.data(), k);
    done += k;
  }
  while (done < n) {
    size_t k = std::min(n - done, done);
    std::memcpy(dst + done, dst, k);
    done += k;
  }
  at += n;
}

// A broken invariant: print it and abort, which libFuzzer records as a
// crash (with the input saved as an artifact).
[[noreturn]] inline void finding(
    const char* file,
    int line,
    const std::string& what) {
  std::fprintf(stderr, "FUZZ FINDING at %s:%d: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}

} // namespace torch_rpc_ext::fuzz

#define FUZZ_CHECK(cond, what)                                \
  do {                                                        \
    if (!(cond)) {                                            \
      ::torch_rpc_ext::fuzz::finding(                         \
          __FILE__,                                           \
          __LINE__,                                           \
          std::string("check failed: " #cond ": ") + (what)); \
    }                                                         \
  } while (0)
