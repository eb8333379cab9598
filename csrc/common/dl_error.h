// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <dlfcn.h>

#include <string>

namespace torch_rpc_ext {

// dlerror()'s text for the failure just seen, for a loader's message.
inline std::string dlerrorText() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown dlopen error";
}

} // namespace torch_rpc_ext
