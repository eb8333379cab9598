// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include "csrc/channel/cuda/copy_engine.h"

namespace torch_rpc_ext::channel::cuda {

// The process's copy engines, one per device, made on first use from the
// kernels' PTX that Python compiles (torch_rpc_ext._cuda.ptx) and hands over
// once with setKernelImages() before any CUDA tensor moves. Thread-safe.

// Replaces the images engines not yet made will load.
void setKernelImages(KernelImages images);
bool haveKernelImages();

// The engine of `device`, kept for the life of the process. Throws
// std::runtime_error naming the missing step if no images were set, and
// what CopyEngine's constructor throws.
CopyEngine& copyEngine(int device);

} // namespace torch_rpc_ext::channel::cuda
