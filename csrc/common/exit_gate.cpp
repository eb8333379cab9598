// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/exit_gate.h"

#include <unistd.h>

#include <thread>

namespace torch_rpc_ext {

void ExitGate::parkIfClosed() {
  if (!closed()) {
    return;
  }
  // Never returns: the process is exiting and will take the thread with it.
  while (true) {
    ::pause();
  }
}

void ExitGate::close(std::chrono::milliseconds grace) {
  closed_.store(true, std::memory_order_seq_cst);
  auto until = std::chrono::steady_clock::now() + grace;
  while (busy_.load(std::memory_order_seq_cst) > 0 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

} // namespace torch_rpc_ext
