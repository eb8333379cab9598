// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The pickle torch's `jit::pickle(tuple, &tensorTable)` writes for a call's
// arguments (ScriptCall::toMessageImpl), for the common arguments only:
// tensors, ints, floats, bools, None and strings. torch's Pickler is
// general (memo maps of strings, globals and pointers, a std::function
// writer, a stringstream per global); a small call's pickling was ~3 us of
// its frontend, this one a fraction of that. The bytes are torch's, opcode
// for opcode (tests/rpc/test_builtin_call.py compares them on the torch in
// use), so what reads them is torch's unpickler as before.
//
// The tuple's elements are taken as torch's ScriptCall holds them: each
// held twice (the call's stack and the tuple's copy), so that every tensor
// is memoized by pointer (a second mention of the same tensor is a BINGET),
// as torch's Pickler does for a value whose use count is over one.

#include <ATen/core/ivalue.h>

#include <optional>
#include <vector>

namespace torch_rpc_ext::small_pickle {

// The pickle of the tuple (`values`..., `tail`...) with tensors by
// reference into `tensors`; nullopt (and `tensors` untouched) where a value
// is of a kind this does not write, for torch's Pickler to write instead.
std::optional<std::vector<char>> pickleTuple(
    c10::ArrayRef<c10::IValue> values,
    c10::ArrayRef<c10::IValue> tail,
    std::vector<at::Tensor>& tensors);

} // namespace torch_rpc_ext::small_pickle
