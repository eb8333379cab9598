// SPDX-License-Identifier: BSD-3-Clause
// Functions served by name, outside TorchScript's compilation unit.
//
// Upstream serves a SCRIPT_CALL either as a builtin operator or as a
// TorchScript function looked up by its qualified name in the Python RPC
// handler's compilation unit. The scripting layer (scripting/,
// torch_rpc_ext.scripting.register) adds a third kind: a function a worker
// registered under a name of its choosing, Python or TorchScript. Callers
// send an ordinary SCRIPT_CALL whose qualified name is kNamedFunctionPrefix
// followed by that name; the agent's request callback hands such calls to the
// table installed here. The agent names no function and includes nothing of
// the scripting layer: the layer installs its table when it is loaded.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/ivalue.h>

namespace torch_rpc_ext {

// Not a valid TorchScript qualified name prefix ("__torch__." is), so no
// compiled function is ever shadowed.
inline constexpr std::string_view kNamedFunctionPrefix = "__torch_rpc_ext__.";

class NamedFunctions {
 public:
  virtual ~NamedFunctions() = default;
  // Serving thread: run the function registered as `name` on `args` and
  // return its value; throw (with the text the caller should see) when the
  // name is unknown, the arguments do not fit, or the function raises.
  virtual c10::IValue call(
      const std::string& name,
      std::vector<c10::IValue>& args) const = 0;
};

// The table requests are served from; nullptr until the scripting layer
// installs one (once, at load; the table must outlive every agent).
void installNamedFunctions(const NamedFunctions* table);
const NamedFunctions* namedFunctions();

} // namespace torch_rpc_ext
