// SPDX-License-Identifier: BSD-3-Clause
#include "scripting/registry.h"

#include <mutex>

#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/jit/api/function_impl.h>

namespace torch_rpc_ext::scripting {

namespace {

bool isIdentifier(std::string_view atom) {
  if (atom.empty() || std::isdigit(static_cast<unsigned char>(atom[0]))) {
    return false;
  }
  for (char c : atom) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') {
      return false;
    }
  }
  return true;
}

// Installs the registry as the agent's table when the extension loads.
const bool kInstalled = [] {
  installNamedFunctions(&RemoteFunctions::instance());
  return true;
}();

} // namespace

std::string currentWorker() {
  namespace rpc = torch::distributed::rpc;
  if (rpc::RpcAgent::isCurrentRpcAgentSet()) {
    return rpc::RpcAgent::getCurrentRpcAgent()->getWorkerInfo().name_;
  }
  return "this process";
}

void checkName(const std::string& name) {
  bool ok = name.size() <= 256 && !name.empty();
  for (size_t start = 0; ok;) {
    size_t dot = name.find('.', start);
    ok = isIdentifier(
        std::string_view(name).substr(
            start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) {
      break;
    }
    start = dot + 1;
  }
  TORCH_CHECK_VALUE(
      ok,
      "invalid remote function name '",
      name,
      "': use dotted identifiers such as 'ps.get_weights' (at most 256 "
      "characters)");
}

RemoteFunctions& RemoteFunctions::instance() {
  static auto* registry = new RemoteFunctions(); // outlives every agent
  return *registry;
}

void RemoteFunctions::add(
    const std::string& name,
    Body body,
    std::string kind) {
  checkName(name);
  auto entry =
      std::make_shared<const Entry>(Entry{std::move(body), std::move(kind)});
  std::unique_lock<std::shared_mutex> lock(mutex_);
  entries_[name].swap(entry);
  lock.unlock(); // the replaced entry, if any, dies here, unlocked
}

void RemoteFunctions::addScript(
    const std::string& name,
    torch::jit::StrongFunctionPtr fn) {
  TORCH_CHECK_VALUE(fn.function_ != nullptr, "no TorchScript function given");
  std::string qualified = fn.function_->qualname().qualifiedName();
  add(
      name,
      [fn = std::move(fn), name](std::vector<c10::IValue>& args) {
        torch::jit::Function& f = *fn.function_;
        try {
          f.getSchema().checkAndNormalizeInputs(args);
        } catch (const c10::Error& e) {
          // Plain exceptions: the error response carries what() as it is,
          // and a c10::Error's would carry a C++ backtrace.
          throw std::runtime_error(
              c10::str(
                  "TypeError: ",
                  e.what_without_backtrace(),
                  " (remote function '",
                  name,
                  "' on ",
                  currentWorker(),
                  ")"));
        }
        std::string failure;
        try {
          f.run(args);
        } catch (const c10::Error& e) {
          failure = e.what_without_backtrace();
        } catch (const std::exception& e) { // the interpreter's own errors
          failure = e.what();
        }
        if (!failure.empty()) {
          throw std::runtime_error(
              c10::str(
                  "RuntimeError: ",
                  failure,
                  " (remote function '",
                  name,
                  "' on ",
                  currentWorker(),
                  ")"));
        }
        TORCH_INTERNAL_ASSERT(
            args.size() == 1, "a TorchScript function returns one value");
        return std::move(args.front());
      },
      "torchscript " + qualified);
}

bool RemoteFunctions::remove(const std::string& name) {
  std::shared_ptr<const Entry> gone;
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return false;
  }
  gone = std::move(it->second);
  entries_.erase(it);
  lock.unlock();
  return true;
}

std::map<std::string, std::string> RemoteFunctions::list() const {
  std::map<std::string, std::string> out;
  std::shared_lock<std::shared_mutex> lock(mutex_);
  for (const auto& [name, entry] : entries_) {
    out.emplace(name, entry->kind);
  }
  return out;
}

c10::IValue RemoteFunctions::call(
    const std::string& name,
    std::vector<c10::IValue>& args) const {
  std::shared_ptr<const Entry> entry;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    auto it = entries_.find(name);
    if (it != entries_.end()) {
      entry = it->second;
    }
  }
  if (!entry) {
    std::vector<std::string> names;
    for (const auto& [known, kind] : list()) {
      names.push_back(known);
    }
    throw std::runtime_error(
        c10::str(
            "LookupError: no remote function '",
            name,
            "' is registered on ",
            currentWorker(),
            names.empty() ? std::string(" (none is)")
                          : " (registered: " + c10::Join(", ", names) + ")"));
  }
  return entry->body(args);
}

} // namespace torch_rpc_ext::scripting
