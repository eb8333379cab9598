// SPDX-License-Identifier: BSD-3-Clause
// The remote-function registry: what this worker serves by name
// (torch_rpc_ext.scripting.register), for callers in eager Python,
// TorchScript and torch.compile (scripting/ops.cpp).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include <torch/csrc/jit/api/compilation_unit.h>

#include "csrc/agent/named_functions.h"

namespace torch_rpc_ext::scripting {

// A registered function as the registry runs it: the call's arguments in,
// its value out; throws with the text the caller should see. A Python
// function arrives as a Body from the bindings, which own the GIL policy.
using Body = std::function<c10::IValue(std::vector<c10::IValue>& args)>;

// This worker's name in errors ("this process" before init_rpc).
std::string currentWorker();

// Names are dotted identifiers ("ps.get_weights"); throws ValueError text
// otherwise.
void checkName(const std::string& name);

// The positional arguments of a torch.compile call (ops.cpp): its tensors,
// with its compile-time constants put back at their positions. `constants`
// is torch_rpc_ext.scripting's encoding: "<position>=<tag><value>" entries
// joined by \x1f; tags n (None), b (bool, 0/1), i (int), f (float, repr), s
// (str). Throws ValueError text on a malformed encoding.
std::vector<c10::IValue> compiledArguments(
    at::TensorList tensors,
    const std::string& constants);

class RemoteFunctions final : public NamedFunctions {
 public:
  // The process's registry, installed as the agent's NamedFunctions table.
  static RemoteFunctions& instance();

  // Register (or replace) `name`. `kind` says what it is, for listings.
  void add(const std::string& name, Body body, std::string kind);
  // A TorchScript function runs without the GIL; its arguments are checked
  // against its schema first (a wrong type is a TypeError for the caller,
  // never an interpreter fault).
  void addScript(const std::string& name, torch::jit::StrongFunctionPtr fn);
  // Whether `name` was registered.
  bool remove(const std::string& name);
  // name -> kind, sorted by name.
  std::map<std::string, std::string> list() const;

  c10::IValue call(const std::string& name, std::vector<c10::IValue>& args)
      const override;

 private:
  struct Entry {
    Body body;
    std::string kind;
  };
  // Entries are shared so a call runs without the lock, and a replaced or
  // removed one (which may hold a Python object) is destroyed outside it.
  mutable std::shared_mutex mutex_;
  std::map<std::string, std::shared_ptr<const Entry>> entries_;
};

} // namespace torch_rpc_ext::scripting
