// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/engines.h"

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace torch_rpc_ext::channel::cuda {

namespace {

struct Engines {
  std::mutex mu;
  KernelImages images;
  // Leaked with the process, as the primary contexts they live in
  // (device.h): a static destructor must not unload modules at exit.
  std::map<int, CopyEngine*> byDevice;
};

Engines& engines() {
  static Engines* e = new Engines();
  return *e;
}

} // namespace

void setKernelImages(KernelImages images) {
  auto& e = engines();
  std::lock_guard<std::mutex> lock(e.mu);
  e.images = std::move(images);
}

bool haveKernelImages() {
  auto& e = engines();
  std::lock_guard<std::mutex> lock(e.mu);
  return !e.images.empty();
}

CopyEngine& copyEngine(int device) {
  auto& e = engines();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.byDevice.find(device);
  if (it != e.byDevice.end()) {
    return *it->second;
  }
  if (e.images.empty()) {
    throw std::runtime_error(
        "torch_rpc_ext: the CUDA copy kernels were not loaded in this process "
        "(torch_rpc_ext._cuda.load_kernels() compiles and hands them over "
        "before the first CUDA tensor moves)");
  }
  auto* engine = new CopyEngine(device, e.images);
  e.byDevice.emplace(device, engine);
  return *engine;
}

} // namespace torch_rpc_ext::channel::cuda
