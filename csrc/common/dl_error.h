// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <dlfcn.h>

#include <functional>
#include <string>

namespace torch_rpc_ext {

// dlerror()'s text for the failure just seen, for a loader's message.
inline std::string dlerrorText() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown dlopen error";
}

// Loads the first library that `bind` accepts (it returns "" for a usable
// handle, else why not): `override` alone if it is set (a test's choice),
// else each of `names` already loaded in this process (RTLD_NOLOAD: the
// one Python's own modules use), then each by dlopen. A usable handle stays
// open for the life of the process; what each failure was is appended to
// `tried`. False if none was usable.
template <size_t N>
bool loadFirstUsable(
    const char* override,
    const char* overrideEnv,
    const char* const (&names)[N],
    const std::function<std::string(void*)>& bind,
    std::string& tried) {
  auto attempt = [&](const char* name, int flags) {
    dlerror();
    void* handle = dlopen(name, flags);
    if (handle == nullptr) {
      if ((flags & RTLD_NOLOAD) == 0) {
        tried += std::string("\n  dlopen(\"") + name + "\"): " + dlerrorText();
      }
      return false;
    }
    std::string why = bind(handle);
    if (why.empty()) {
      return true;
    }
    tried += std::string("\n  ") + name + ": " + why;
    dlclose(handle);
    return false;
  };
  if (override != nullptr && *override != '\0') {
    if (attempt(override, RTLD_NOW | RTLD_LOCAL)) {
      return true;
    }
    tried += std::string("\n  (only this: ") + overrideEnv + " is set)";
    return false;
  }
  for (const char* name : names) {
    if (attempt(name, RTLD_NOW | RTLD_NOLOAD)) {
      return true;
    }
  }
  tried += "\n  none of these was loaded in this process already";
  for (const char* name : names) {
    if (attempt(name, RTLD_NOW | RTLD_LOCAL)) {
      return true;
    }
  }
  return false;
}

} // namespace torch_rpc_ext
