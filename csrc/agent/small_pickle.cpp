// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/small_pickle.h"

#include <c10/util/SmallVector.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace torch_rpc_ext::small_pickle {

namespace {

// Pickle protocol 2 opcodes torch's Pickler writes for these kinds.
enum Op : char {
  kProto = '\x80',
  kMark = '(',
  kStop = '.',
  kGlobal = 'c',
  kReduce = 'R',
  kTuple = 't',
  kTuple1 = '\x85',
  kTuple2 = '\x86',
  kTuple3 = '\x87',
  kEmptyTuple = ')',
  kBinInt1 = 'K',
  kBinInt2 = 'M',
  kBinInt = 'J',
  kLong1 = '\x8a',
  kBinFloat = 'G',
  kNewTrue = '\x88',
  kNewFalse = '\x89',
  kNone = 'N',
  kBinUnicode = 'X',
  kBinPut = 'q',
  kBinGet = 'h',
};

// At most one memo entry per value and one for the tensor global: ids fit
// in a byte. (An operator's schema has a few dozen arguments at most.)
constexpr size_t kMaxValues = 128;

constexpr char kTensorGlobal[] = "torch.jit._pickle\nbuild_tensor_from_id\n";

bool writable(const c10::IValue& v) {
  if (v.isString()) {
    return v.toStringRef().size() <= std::numeric_limits<uint32_t>::max();
  }
  return v.isTensor() || v.isInt() || v.isDouble() || v.isBool() || v.isNone();
}

class Writer {
 public:
  Writer(std::vector<char>& out, std::vector<at::Tensor>& tensors)
      : out_(out), tensors_(tensors) {}

  void op(Op o) {
    out_.push_back(static_cast<char>(o));
  }

  // Pickle's integers are little-endian: written as they lie in memory.
  static_assert(
      __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
      "small_pickle writes integers as they lie in memory");
  template <typename T>
  void raw(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    out_.insert(out_.end(), bytes, bytes + sizeof(T));
  }

  void value(const c10::IValue& v) {
    // Pointer memo: torch's Pickler memoizes a pointer value whose use count
    // is over one; a call's values always are (see the header). Strings
    // are memoized by value instead.
    if (v.isPtrType() && !v.isString()) {
      const void* ptr = v.internalToPointer();
      for (const auto& [seen, id] : pointers_) {
        if (seen == ptr) {
          get(id);
          return;
        }
      }
      unmemoized(v);
      pointers_.emplace_back(ptr, put());
    } else {
      unmemoized(v);
    }
  }

  void integer(int64_t n) {
    if (n >= 0 && n <= std::numeric_limits<uint8_t>::max()) {
      op(kBinInt1);
      raw<uint8_t>(static_cast<uint8_t>(n));
    } else if (n >= 0 && n <= std::numeric_limits<uint16_t>::max()) {
      op(kBinInt2);
      raw<uint16_t>(static_cast<uint16_t>(n));
    } else if (
        n >= std::numeric_limits<int32_t>::min() &&
        n <= std::numeric_limits<int32_t>::max()) {
      op(kBinInt);
      raw<int32_t>(static_cast<int32_t>(n));
    } else {
      op(kLong1);
      raw<uint8_t>(8);
      raw<int64_t>(n);
    }
  }

 private:
  void unmemoized(const c10::IValue& v) {
    if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isDouble()) {
      // Big-endian, as pickle's BINFLOAT is.
      double d = v.toDouble();
      uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      op(kBinFloat);
      raw<uint64_t>(__builtin_bswap64(bits));
    } else if (v.isInt()) {
      integer(v.toInt());
    } else if (v.isBool()) {
      op(v.toBool() ? kNewTrue : kNewFalse);
    } else if (v.isNone()) {
      op(kNone);
    } else {
      string(v.toStringRef());
    }
  }

  // torch.jit._pickle.build_tensor_from_id(index into the table).
  void tensor(const at::Tensor& t) {
    if (tensorGlobal_) {
      get(*tensorGlobal_);
    } else {
      op(kGlobal);
      out_.insert(
          out_.end(), kTensorGlobal, kTensorGlobal + sizeof(kTensorGlobal) - 1);
      tensorGlobal_ = put();
    }
    tensors_.push_back(t);
    op(kMark);
    integer(static_cast<int64_t>(tensors_.size() - 1));
    op(kTuple);
    op(kReduce);
  }

  void string(const std::string& s) {
    for (const auto& [seen, id] : strings_) {
      if (*seen == s) {
        get(id);
        return;
      }
    }
    op(kBinUnicode);
    raw<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
    strings_.emplace_back(&s, put());
  }

  // Memo ids stay under 256 (kMaxValues): the one-byte forms only.
  uint8_t put() {
    op(kBinPut);
    raw<uint8_t>(memo_);
    return memo_++;
  }

  void get(uint8_t id) {
    op(kBinGet);
    raw<uint8_t>(id);
  }

  std::vector<char>& out_;
  std::vector<at::Tensor>& tensors_;
  uint8_t memo_ = 0;
  std::optional<uint8_t> tensorGlobal_;
  // A call has a few values: a linear look beats a map's allocations.
  c10::SmallVector<std::pair<const void*, uint8_t>, 8> pointers_;
  c10::SmallVector<std::pair<const std::string*, uint8_t>, 4> strings_;
};

} // namespace

std::optional<std::vector<char>> pickleTuple(
    c10::ArrayRef<c10::IValue> values,
    c10::ArrayRef<c10::IValue> tail,
    std::vector<at::Tensor>& tensors) {
  const size_t n = values.size() + tail.size();
  if (n > kMaxValues) {
    return std::nullopt;
  }
  size_t reserve = 8;
  for (const auto* part : {&values, &tail}) {
    for (const auto& v : *part) {
      if (!writable(v)) {
        return std::nullopt;
      }
      reserve += v.isString() ? v.toStringRef().size() + 8 : 16;
    }
  }
  reserve += sizeof(kTensorGlobal);
  std::vector<char> out;
  out.reserve(reserve);
  Writer w(out, tensors);
  w.op(kProto);
  out.push_back(2);
  if (n > 3) {
    w.op(kMark);
  }
  for (const auto* part : {&values, &tail}) {
    for (const auto& v : *part) {
      w.value(v);
    }
  }
  // Up to three elements torch's Pickler closes with TUPLE1..3, else a MARK's.
  constexpr Op kSmallTuple[] = {kEmptyTuple, kTuple1, kTuple2, kTuple3};
  w.op(n < 4 ? kSmallTuple[n] : kTuple);
  w.op(kStop);
  return out;
}

} // namespace torch_rpc_ext::small_pickle
