// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/device_memory.h"

#include <atomic>
#include <map>
#include <mutex>

#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

struct Accounts {
  std::mutex mu;
  std::function<void(int)> release;
  std::map<int, uint64_t> ipcByDevice; // blocks and grants
  std::map<int, uint64_t> grantsByDevice;
  std::atomic<uint64_t> limit{0};
  std::atomic<uint64_t> ipcBytes{0};
  std::atomic<int64_t> stagingBytes{0};
  std::atomic<uint64_t> oomRetries{0};
  std::atomic<uint64_t> ipcDeclined{0};
  std::atomic<uint64_t> grantBytes{0};
};

Accounts& accounts() {
  static auto* a = new Accounts(); // used by blocks freed at exit
  return *a;
}

} // namespace

DeviceMemoryStats deviceMemoryStats() {
  Accounts& a = accounts();
  DeviceMemoryStats s;
  s.ipcBytes = a.ipcBytes.load();
  s.stagingBytes = static_cast<uint64_t>(std::max<int64_t>(0, a.stagingBytes));
  s.oomRetries = a.oomRetries.load();
  s.ipcDeclined = a.ipcDeclined.load();
  s.grantBytes = a.grantBytes.load();
  return s;
}

void setCacheRelease(std::function<void(int device)> release) {
  std::lock_guard<std::mutex> lock(accounts().mu);
  accounts().release = std::move(release);
}

void setIpcMemoryLimit(uint64_t bytes) {
  accounts().limit.store(bytes);
}

uint64_t ipcMemoryLimit() {
  return accounts().limit.load();
}

void allocateWithRetry(int device, const std::function<void()>& allocate) {
  try {
    allocate();
    return;
  } catch (const CudaError& e) {
    if (e.code() != CUDA_ERROR_OUT_OF_MEMORY) {
      throw;
    }
  }
  std::function<void(int)> release;
  {
    std::lock_guard<std::mutex> lock(accounts().mu);
    release = accounts().release;
  }
  if (release) {
    release(device);
  }
  accounts().oomRetries.fetch_add(1, std::memory_order_relaxed);
  allocate();
}

namespace {

// Whether `bytes` more of cuda_ipc's on `device`, `freed` of its grants'
// given back first, stay within the bound (blocks and grants share it;
// grants take at most half).
bool roomLocked(
    Accounts& a,
    int device,
    uint64_t bytes,
    uint64_t freed,
    bool grant) {
  const uint64_t limit = a.limit.load();
  if (limit == 0) {
    return true;
  }
  const uint64_t held = a.ipcByDevice[device] - freed;
  const uint64_t granted = a.grantsByDevice[device] - freed;
  return held + bytes <= limit && (!grant || granted + bytes <= limit / 2);
}

} // namespace

bool reserveIpc(int device, uint64_t bytes) {
  Accounts& a = accounts();
  std::lock_guard<std::mutex> lock(a.mu);
  if (!roomLocked(a, device, bytes, 0, false)) {
    a.ipcDeclined.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  a.ipcByDevice[device] += bytes;
  a.ipcBytes.fetch_add(bytes, std::memory_order_relaxed);
  return true;
}

void releaseIpc(int device, uint64_t bytes) {
  Accounts& a = accounts();
  std::lock_guard<std::mutex> lock(a.mu);
  a.ipcByDevice[device] -= bytes;
  a.ipcBytes.fetch_sub(bytes, std::memory_order_relaxed);
}

bool reserveGrant(int device, uint64_t bytes) {
  Accounts& a = accounts();
  std::lock_guard<std::mutex> lock(a.mu);
  if (!roomLocked(a, device, bytes, 0, true)) {
    return false;
  }
  a.ipcByDevice[device] += bytes;
  a.grantsByDevice[device] += bytes;
  a.grantBytes.fetch_add(bytes, std::memory_order_relaxed);
  return true;
}

void releaseGrant(int device, uint64_t bytes) {
  Accounts& a = accounts();
  std::lock_guard<std::mutex> lock(a.mu);
  a.ipcByDevice[device] -= bytes;
  a.grantsByDevice[device] -= bytes;
  a.grantBytes.fetch_sub(bytes, std::memory_order_relaxed);
}

bool grantRoom(int device, uint64_t bytes, uint64_t freed) {
  Accounts& a = accounts();
  std::lock_guard<std::mutex> lock(a.mu);
  return roomLocked(a, device, bytes, freed, true);
}

void countIpcDeclined() {
  accounts().ipcDeclined.fetch_add(1, std::memory_order_relaxed);
}

void addStagingBytes(int64_t delta) {
  accounts().stagingBytes.fetch_add(delta, std::memory_order_relaxed);
}

} // namespace torch_rpc_ext::channel::cuda
