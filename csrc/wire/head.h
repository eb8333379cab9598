// SPDX-License-Identifier: BSD-3-Clause
#pragma once
// What the encoding (codec.cpp) and decoding (inbound.cpp) halves of the
// message codec share: the head's layout constants and readers, and the
// storages that view memory a transport provided. Internal to wire/.

#include <c10/core/Storage.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "csrc/frame/frame.h"

namespace torch_rpc_ext::wire::detail {

constexpr uint8_t kLayoutStrided = 0;
// Set in a head's message type word when the caller's trace context follows
// the tensors (a u8 length, then its bytes).
constexpr uint32_t kTraceFlag = 0x80000000u;
constexpr uint8_t kLayoutSparseCoo = 1;
constexpr uint8_t kLayoutQuantized = 2;
constexpr size_t kMaxDims = 64;

// A tensor's device byte in the head: -1 the CPU, d >= 0 CUDA device d
// with the bytes in device memory (a device channel), hostToDevice(d) <= -2
// CUDA device d with the bytes carried as host bytes (a CPU tensor under a
// {"cpu": d} map), which the receiver copies onto the device.
constexpr int8_t kMaxHostToDevice = 126; // -2-126 is -128
constexpr int8_t hostToDevice(int8_t device) {
  return static_cast<int8_t>(-2 - device);
}

class HeadWriter {
 public:
  template <typename T>
  void put(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  std::string out;
};

class HeadReader {
 public:
  explicit HeadReader(const std::string& in) : in_(in) {}
  template <typename T>
  T get(const char* what) {
    if (in_.size() - pos_ < sizeof(T)) {
      throw std::invalid_argument(
          std::string("message head truncated while reading ") + what);
    }
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  bool done() const {
    return pos_ == in_.size();
  }
  // `n` raw bytes.
  std::string bytes(size_t n, const char* what) {
    if (in_.size() - pos_ < n) {
      throw std::invalid_argument(
          std::string("message head truncated while reading ") + what);
    }
    std::string v = in_.substr(pos_, n);
    pos_ += n;
    return v;
  }

 private:
  const std::string& in_;
  size_t pos_ = 0;
};

// A storage viewing memory a transport provided (a shared slab): the region
// is released when the last tensor viewing it dies, on whatever thread.
struct ProvidedRegion {
  std::shared_ptr<frame::SharedRegion> region;
};

// A ProvidedRegion's deleter (inbound.cpp).
void releaseProvided(void* ctx);

inline bool viewsProvidedMemory(const c10::Storage& storage) {
  return storage.data_ptr().get_deleter() == &releaseProvided;
}

} // namespace torch_rpc_ext::wire::detail
