// SPDX-License-Identifier: BSD-3-Clause
#pragma once
// Who else can reach the bytes of a tensor the encoder is about to send
// (codec.cpp): the transport region behind its storage, and whether the
// message is the tensor's only holder (then a storage the transport
// provided can be handed back rather than copied). Internal to wire/.

#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include "csrc/frame/frame.h"

namespace torch_rpc_ext::wire::detail {

// The region behind `storage`, if a transport provided its memory.
std::shared_ptr<frame::SharedRegion> regionOf(const c10::Storage& storage);

// Nothing but the message being encoded can reach the bytes of `t`: it
// holds the only reference to the tensor, the tensor the only one to its
// storage, and no weak reference could revive either.
bool reachableOnlyThrough(const at::Tensor& t);

} // namespace torch_rpc_ext::wire::detail
