// SPDX-License-Identifier: BSD-3-Clause
#pragma once
// What a CUDA build of torch generates here and a CPU build does not ship:
// enough for c10/cuda's headers to parse (csrc/torch_cuda/, declarations
// only; nothing of libc10_cuda is linked). On the include path after torch's
// own, so a CUDA torch's file wins.
#define C10_CUDA_BUILD_SHARED_LIBS
