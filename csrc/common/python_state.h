// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <Python.h>

namespace torch_rpc_ext {

// Whether a thread may take the GIL: not before Python starts, and not
// once it finalises (a thread that takes the GIL then is ended by CPython).
inline bool pythonUsable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

} // namespace torch_rpc_ext
