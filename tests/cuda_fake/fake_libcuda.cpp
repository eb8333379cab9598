// SPDX-License-Identifier: BSD-3-Clause
// A fake CUDA driver for CI machines without a GPU: the entry points that
// csrc/common/libcuda.h loads, exported under the ABI names cuda.h gives them
// (cuMemAlloc_v2, cuStreamDestroy_v2, ...), implemented on the host so that
// the CUDA channel code runs, and its mistakes show, without a GPU. The
// extension loads it with TORCH_RPC_EXT_LIBCUDA=<this library>; build() in
// tests/cuda_fake/__init__.py compiles it. It proves logic, never hardware.
//
// Modelled, and enforced as a real driver enforces it:
// - cuInit(0) before anything else (CUDA_ERROR_NOT_INITIALIZED); in the child
//   of a fork() after cuInit, every call fails so, cuInit too. At exit the
//   driver shuts down before the handlers registered ahead of cuInit run:
//   calls after that fail with CUDA_ERROR_DEINITIALIZED
//   ($FAKE_CUDA_EXIT_DELAY_MS holds the exit there, to catch threads that
//   still call).
// - $FAKE_CUDA_DEVICES devices (default 1; 0 makes cuInit fail with
//   CUDA_ERROR_NO_DEVICE) of compute capability 9.0; UUIDs stable per index,
//   changed by $FAKE_CUDA_UUID_SALT (another machine); VMM with POSIX fd
//   handles unless $FAKE_CUDA_NO_VMM=1; interprocess events unless
//   $FAKE_CUDA_NO_IPC_EVENTS=1 (as vGPU, WSL and confidential-computing
//   devices: CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED is 0 and creating one
//   fails with CUDA_ERROR_NOT_SUPPORTED); $FAKE_CUDA_MEM_LIMIT bytes of
//   device memory per process (cuMemAlloc and cuMemCreate past it fail with
//   CUDA_ERROR_OUT_OF_MEMORY; stats `live.device_bytes`). Every two devices
//   can access each other's memory (cuDeviceCanAccessPeer, as on an NVLink
//   node) unless $FAKE_CUDA_NO_PEER_ACCESS=1.
// - IPC handles (events, legacy memory) open in another process only
//   (CUDA_ERROR_INVALID_CONTEXT in their own), unless $FAKE_CUDA_IPC_SELF=1:
//   for a one-process harness playing both ends (tests/fuzz/fuzz_stream.cpp).
//   Opening another process's memory fails with CUDA_ERROR_OUT_OF_MEMORY
//   under $FAKE_CUDA_IPC_MEM_OPEN_FAILS=1 (a legacy handle) and
//   $FAKE_CUDA_IPC_IMPORT_FAILS=1 (a VMM descriptor); a legacy handle is not
//   given under $FAKE_CUDA_IPC_MEM_HANDLE_FAILS=1.
// - Primary contexts, refcounted, current per thread: a new thread has none,
//   and calls that need one fail with CUDA_ERROR_INVALID_CONTEXT
//   (CUDA_ERROR_CONTEXT_IS_DESTROYED once its last retain was released).
// - Device memory is host memory of the process: a CUdeviceptr is an address,
//   and copies check that their device side is device memory. Each cuMemAlloc
//   is a memfd of its own (one fd each), so legacy IPC handles open in other
//   processes (through /proc/<pid>/fd, or pidfd_getfd); a process cannot
//   open its own handles. Frees and unmaps first wait for every stream, as
//   real ones synchronise with the device.
// - VMM: memfds in 2 MiB granules, exported as a new fd that the caller owns.
//   A mapping stays PROT_NONE until cuMemSetAccess, so touching it earlier
//   kills the process with SIGSEGV, as a kernel touching it would fault.
//   cuMemSetAccess grants access per device: two devices on one mapping
//   need peer access, and our copy kernels touch a mapping only from a
//   device it was granted to (else a kernel error, nothing copied).
// - Streams: a worker thread each, running work strictly in order after the
//   enqueuing call has returned ($FAKE_CUDA_KERNEL_DELAY_MS delays each
//   kernel and asynchronous copy there, so readers not ordered after it see
//   old bytes). Host
//   functions run there and may not call the driver
//   (CUDA_ERROR_NOT_PERMITTED). Events are two counters (see
//   cuEventRecord); an interprocess event keeps them in a shared memfd, so a
//   record in one process releases waits in another.
// - Graph capture, as far as other threads see it: fake_cuda_set_global_
//   capture(1) says a stream is capturing in global mode somewhere in the
//   process; until fake_cuda_set_global_capture(0), a potentially unsafe
//   call (allocating or freeing memory, synchronous copies, synchronising
//   with or querying an event or stream, loading a module) from a thread
//   not in CU_STREAM_CAPTURE_MODE_RELAXED (cuThreadExchangeStreamCaptureMode;
//   threads start in global mode) fails with
//   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and is counted
//   (`capture_violations`): on a GPU it would invalidate the capture.
// - IPC lifetimes (cuda.h calls both undefined): an interprocess event its
//   exporter destroyed is poisoned, and every later use of it in a process
//   that opened it (record, wait, query, synchronize, destroy) is counted
//   (`poisoned_uses`, with a line on stderr); so is a legacy mapping closed
//   (cuIpcCloseMemHandle) after its exporter, still alive, freed the memory.
// - Kernels: cuModuleLoadData reads the PTX's .version (newer than the
//   driver's CUDA version loads is CUDA_ERROR_UNSUPPORTED_PTX_VERSION: 9.0
//   for the default 13.0, $FAKE_CUDA_DRIVER_VERSION=12040 says 12.4), .target
//   and .visible .entry lines; a launch runs, on its stream, the semantics of
//   our four copy kernels (torch_rpc_ext/_cuda/kernels.py and abi.py), picked
//   by the kernel's name in the mangled entry. What a GPU would get silently
//   wrong (an inconsistent segment table, misaligned strided copies,
//   overlapping copies) is counted as a kernel error in fake_cuda_stats().
//
// - A copy that fails on the device: fake_cuda_fail_dtoh_after(n) makes the
//   (n+1)-th asynchronous device-to-host copy from then on write nothing,
//   and a query of the next event recorded on its stream after it return
//   CUDA_ERROR_LAUNCH_FAILED, once (not sticky, unlike a GPU's error: the
//   process goes on).
//
// Not modelled: timing; device faults (a bad address crashes the process);
// per-device access rights beyond the copy kernels' (READWRITE for any
// device opens a VMM mapping to the host, memcpys check no device); the
// legacy NULL stream's implicit synchronisation with
// other streams (every stream behaves as CU_STREAM_NON_BLOCKING, which is
// stricter); freeing a destroyed primary context's resources; more than one
// context per device; kernels other than the four; entry points that
// libcuda.h does not list. Where real drivers' error codes vary, the fake
// picks one and says so. $FAKE_CUDA_TRACE=1 prints every error;
// $FAKE_CUDA_BACKTRACE=cuEventCreate,... the stack of every call of the
// entry points named (whose code a count comes from).

#include <cuda.h>

#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_THREAD__)
// Built by tests/cuda_fake/__init__.py under tools/sanitize.sh thread.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

// cuda.h's opaque handle types. A stream is a queue and the worker thread
// that empties it; destroying a stream lets the worker finish and exit.
struct CUstream_st {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv; // work queued, work done, or stopping
  std::deque<std::function<void()>> work;
  uint64_t enqueued = 0;
  uint64_t done = 0;
  bool stopping = false;
  // A copy on it faulted (fake_cuda_fail_dtoh_after); the next event
  // recorded on it reports that. Its worker thread's alone.
  bool faultPending = false;
};

struct CUctx_st {
  int device = 0;
  std::atomic<int> retains{0};
  std::shared_ptr<CUstream_st> nullStream; // made on first use
};

// An event's counters: cuEventRecord makes a record the n-th at once and
// sets completed = max(completed, n) when its stream gets there; a query
// asks for the latest record. Records of an event complete out of order when
// they go to different streams; a wait is for the record it saw (a later one
// completing on a faster stream does not end it), so records are spread
// over kRecordWindow slots, each holding the highest record number done in
// it.
constexpr uint64_t kRecordWindow = 256;

struct FakeCounters {
  std::atomic<uint64_t> recorded{0};
  std::atomic<uint64_t> completed{0}; // the highest record done
  // An interprocess event's exporter destroyed it: the processes that
  // opened it may no longer use it.
  std::atomic<uint64_t> exporterDestroyed{0};
  // Work before it on its stream faulted: its next query says so, once.
  std::atomic<uint64_t> faulted{0};
  std::atomic<uint64_t> doneIn[kRecordWindow]{};
};
static_assert(sizeof(FakeCounters) <= 4096, "one page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared memory");

// Where they live: the heap, or for an interprocess event the first page of
// a memfd (fd), mapped by every process that opened the event.
struct FakeCounterBlock {
  FakeCounters* counters = nullptr;
  int fd = -1;
  ~FakeCounterBlock() {
    if (fd < 0) {
      delete counters;
    } else {
      munmap(counters, 4096);
      close(fd);
    }
  }
};

struct CUevent_st {
  unsigned flags = 0;
  int device = 0;
  bool opened = false; // by cuIpcOpenEventHandle (else made here)
  std::shared_ptr<FakeCounterBlock> block; // shared with queued work
};

enum FakeKernel {
  kCopyContiguous,
  kCopySegments,
  kPackStrided,
  kUnpackStrided,
  kUnknownKernel,
};

struct CUmod_st;
struct CUfunc_st {
  CUmod_st* module;
  std::string entry;
  FakeKernel kernel;
  int params; // .param count, and how many of them are .u64
  int u64Params;
};

struct CUmod_st {
  CUctx_st* context;
  std::vector<std::unique_ptr<CUfunc_st>> functions;
};

namespace {

constexpr size_t kGranularity = size_t(2) << 20;
constexpr size_t kPage = 4096;
// The driver's CUDA version ($FAKE_CUDA_DRIVER_VERSION, default 13000) and
// the newest PTX ISA it loads (major * 10 + minor).
constexpr int kDefaultDriverVersion = 13000;
int maxIsaOf(int driverVersion) {
  static constexpr int kTable[][2] = {
      {9000, 60},
      {10000, 63},
      {11000, 70},
      {11080, 78},
      {12000, 80},
      {12040, 84},
      {12080, 87},
      {12090, 88},
      {13000, 90}};
  int isa = 0;
  for (const auto& row : kTable) {
    if (driverVersion >= row[0]) {
      isa = row[1];
    }
  }
  return isa;
}
constexpr int kSm = 90;
constexpr uint32_t kIpcMagic = 0x4b414646; // "FFAK"
constexpr uint32_t kIpcMemory = 1;
constexpr uint32_t kIpcEvent = 2;
// VMM handles are numbered from here, so an fd passed as one is refused.
constexpr uint64_t kFirstVmmHandle = uint64_t(1) << 32;
constexpr const char* kKernelNames[] = {
    "copy_contiguous",
    "copy_segments",
    "pack_strided",
    "unpack_strided",
    "unknown"};

// Every code the fake returns, with the real driver's text (a test checks).
#define FAKE_CUDA_ERRORS(X)                                         \
  X(CUDA_SUCCESS, "no error")                                       \
  X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                   \
  X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                      \
  X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")             \
  X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")               \
  X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")     \
  X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")            \
  X(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid")     \
  X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")           \
  X(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed")       \
  X(CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed")         \
  X(CUDA_ERROR_UNSUPPORTED_PTX_VERSION,                             \
    "the provided PTX was compiled with an unsupported toolchain.") \
  X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")           \
  X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                 \
  X(CUDA_ERROR_NOT_READY, "device not ready")                       \
  X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")         \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,                      \
    "part or all of the requested memory range is already mapped")  \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,                          \
    "pointer does not correspond to a registered memory region")    \
  X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed")        \
  X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")            \
  X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")            \
  X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,                          \
    "operation not permitted when stream is capturing")

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};
#define FAKE_CUDA_ERROR_TEXT(code, text) {code, #code, text},
constexpr ErrorText kErrors[] = {FAKE_CUDA_ERRORS(FAKE_CUDA_ERROR_TEXT)};

struct Alloc { // cuMemAlloc: a memfd mapped MAP_SHARED
  size_t size;
  size_t length;
  int fd;
};
struct HostAlloc {
  size_t size;
  size_t length;
};
struct IpcMapping { // cuIpcOpenMemHandle: refcounted per exporter's memfd
  size_t size;
  std::pair<uint64_t, uint64_t> file; // st_dev, st_ino
  int refs;
  pid_t exporter;
  int exporterFd; // in the exporter
};
struct VmmHandle {
  int fd;
  size_t size;
  bool exportable; // made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  bool created = false; // by cuMemCreate here (else imported)
};
struct Reservation {
  size_t size;
};
struct Mapping {
  size_t size;
  int prot; // PROT_NONE until cuMemSetAccess
  std::set<int> devices; // granted access by cuMemSetAccess
};

// The first bytes of a CUipcMemHandle or CUipcEventHandle.
struct IpcHandle {
  uint32_t magic;
  uint32_t kind;
  int32_t pid;
  int32_t fd;
  uint64_t size;
  uint64_t dev; // the memfd's st_dev and st_ino tell the file the handle
  uint64_t ino; // names from another that reuses its fd number
};
static_assert(sizeof(IpcHandle) <= CU_IPC_HANDLE_SIZE, "fits a handle");

struct Stats {
  std::atomic<uint64_t> launches[kUnknownKernel + 1] = {};
  std::atomic<uint64_t> memcpys{0};
  std::atomic<uint64_t> memcpyBytes{0};
  std::atomic<uint64_t> kernelBytes{0};
  std::atomic<uint64_t> hostFuncs{0};
  std::atomic<uint64_t> ipcMemOpens{0};
  std::atomic<uint64_t> ipcEventOpens{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> kernelErrors{0};
  std::atomic<uint64_t> poisonedUses{0}; // see "IPC lifetimes" above
  std::atomic<uint64_t> captureViolations{0}; // see "Graph capture" above
  // Asynchronous copies whose host side is not pinned (neither
  // cuMemHostAlloc's nor registered): a GPU runs them synchronously,
  // through a bounce buffer, at a fraction of the bus's speed.
  std::atomic<uint64_t> pageableCopies{0};
  std::mutex mu; // the two strings, `calls` and `callsFrom`
  std::string lastError;
  std::string lastKernelError;
  // Calls by entry point (ABI name), for what a message costs in driver
  // calls (benchmarks/cuda_bench.py --fake). cuInit, cuDriverGetVersion and
  // cuGetError* are not counted.
  std::map<std::string, uint64_t> calls;
  // The same by the library holding the call site ("_C", "_testing", ...:
  // the file name up to its first dot), "library:entry point". "_C" is
  // torch_rpc_ext's code, and also the device guard (cuda::CurrentDevice)
  // that the fake's stand-in for torch's CUDA runtime (_testing) borrows
  // from it: its context and capture-mode calls count as "_C"; the
  // stand-in's event, stream and memory calls count as "_testing".
  std::map<std::string, uint64_t> callsFrom;
};

// Everything, on the heap and never freed: detached stream workers may run
// until the process ends, after static destructors.
struct State {
  std::mutex mu; // guards what follows; never held while waiting on work
  int devices = 0;
  bool noVmm = false;
  bool noIpcEvents = false; // $FAKE_CUDA_NO_IPC_EVENTS=1
  bool noPeerAccess = false; // $FAKE_CUDA_NO_PEER_ACCESS=1
  bool ipcSelf = false; // $FAKE_CUDA_IPC_SELF=1
  bool ipcMemOpenFails = false; // $FAKE_CUDA_IPC_MEM_OPEN_FAILS=1
  bool ipcMemHandleFails = false; // $FAKE_CUDA_IPC_MEM_HANDLE_FAILS=1
  bool ipcImportFails = false; // $FAKE_CUDA_IPC_IMPORT_FAILS=1
  // Each kernel runs this long after its stream reaches it: work that is not
  // ordered after a kernel sees its old bytes, as on a GPU under load.
  // ($FAKE_CUDA_KERNEL_DELAY_MS, or fake_cuda_set_kernel_delay_ms().)
  std::atomic<long> kernelDelayMs{0};
  // Each cuMemAlloc returns this long late (fake_cuda_set_alloc_delay_ms).
  std::atomic<long> allocDelayMs{0};
  // fake_cuda_fail_dtoh_after(): asynchronous device-to-host copies left
  // before one faults (-1: none will).
  std::atomic<long> dtohLeft{-1};
  // $FAKE_CUDA_MEM_LIMIT: the device memory this process may hold
  // (cuMemAlloc's and cuMemCreate's, page-rounded); 0: no limit.
  uint64_t memLimit = 0;
  int driverVersion = kDefaultDriverVersion; // $FAKE_CUDA_DRIVER_VERSION
  std::string salt;
  std::vector<std::unique_ptr<CUctx_st>> contexts; // the primary ones
  std::map<uintptr_t, Alloc> allocs;
  std::map<uintptr_t, HostAlloc> hostAllocs;
  // cuMemHostRegister's ranges: pinned as cuMemHostAlloc's are.
  std::map<uintptr_t, HostAlloc> hostRegistered;
  std::map<uintptr_t, IpcMapping> ipcMappings;
  std::map<std::pair<uint64_t, uint64_t>, uintptr_t> ipcByFile;
  std::map<uint64_t, VmmHandle> vmmHandles;
  uint64_t nextVmmHandle = kFirstVmmHandle;
  std::map<uintptr_t, Reservation> reservations;
  std::map<uintptr_t, Mapping> mappings;
  std::map<CUstream, std::shared_ptr<CUstream_st>> streams; // not destroyed
  std::vector<std::shared_ptr<CUstream_st>> workers; // every running worker
  std::map<CUevent, std::unique_ptr<CUevent_st>> events;
  std::map<CUmodule, std::unique_ptr<CUmod_st>> modules;
  std::set<CUfunction> functions;
  Stats stats;
};

State& state() {
  static State* s = new State();
  return *s;
}

std::atomic<pid_t> g_initPid{0}; // the process that called cuInit
// Set by the exit handler cuInit registers, as the real driver shuts down
// at exit: every call after it fails with CUDA_ERROR_DEINITIALIZED.
std::atomic<bool> g_deinitialized{false};
long g_exitDelayMs = 0; // $FAKE_CUDA_EXIT_DELAY_MS: the exit handler's wait

void shutDownAtExit() {
  g_deinitialized = true;
  // A thread of the program's still calling the driver meets the shut-down
  // driver in this window (longer than a real exit's, on purpose).
  if (g_exitDelayMs > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(g_exitDelayMs));
  }
}
// Per-thread state lives in pthread keys, not thread_local: this library is
// dlopen'ed, and LeakSanitizer's scan of a dlopen'ed module's dynamic TLS
// faults now and then in the fuzzers ("Tracer caught signal 11", clang 14).
// tests/cuda_fake/test_fake_driver.py checks the built library has no TLS
// segment at all.
pthread_key_t threadKey(int which) {
  static pthread_key_t keys[4] = {};
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_key_create(&keys[0], nullptr);
    pthread_key_create(&keys[1], nullptr);
    pthread_key_create(&keys[2], nullptr); // capture mode + 1 (0: global)
    pthread_key_create(&keys[3], nullptr); // kernel device + 1 (0: none)
  });
  return keys[which];
}
// The context current on this thread.
CUctx_st* currentContext() {
  return static_cast<CUctx_st*>(pthread_getspecific(threadKey(0)));
}
void setCurrentContext(CUctx_st* ctx) {
  pthread_setspecific(threadKey(0), ctx);
}
// Whether this thread is a stream's worker (host functions run there).
bool inWorker() {
  return pthread_getspecific(threadKey(1)) != nullptr;
}
void setInWorker() {
  static char yes;
  pthread_setspecific(threadKey(1), &yes);
}

using Lock = std::lock_guard<std::mutex>;
using u64 = unsigned long long; // printf's %llu

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

const ErrorText* errorText(CUresult code) {
  for (const ErrorText& e : kErrors) {
    if (e.code == code) {
      return &e;
    }
  }
  return nullptr;
}

// Counts an error, remembers it for fake_cuda_stats() and returns it. `why`
// says what the fake objected to (real drivers do not say).
CUresult fail(const char* fn, CUresult rc, const char* why) {
  Stats& stats = state().stats;
  stats.errors++;
  const ErrorText* e = errorText(rc);
  std::string text = std::string(fn) + ": " +
      (e ? e->name : std::to_string(int(rc)).c_str()) + " (" + why + ")";
  if (getenv("FAKE_CUDA_TRACE")) {
    fprintf(stderr, "fake_libcuda: %s\n", text.c_str());
  }
  Lock lock(stats.mu);
  stats.lastError = std::move(text);
  return rc;
}

// In an entry point: return the error unless cond holds.
#define REQUIRE(cond, rc, why)          \
  do {                                  \
    if (!(cond)) {                      \
      return fail(__func__, (rc), why); \
    }                                   \
  } while (0)

// Returns rc (from a helper) unless it is CUDA_SUCCESS.
#define CHECK(expr)              \
  do {                           \
    if (CUresult rc_ = (expr)) { \
      return rc_;                \
    }                            \
  } while (0)

// The library holding `address` (a return address), as "_C" for
// ".../_C.cpython-311-x86_64-linux-gnu.so"; cached by address. Its cache
// lives on the heap and is never freed, as the rest of the fake's state:
// threads still call the driver while the process exits.
std::string moduleOf(const void* address) {
  static auto* mu = new std::mutex();
  static auto* known = new std::map<const void*, std::string>();
  {
    std::lock_guard<std::mutex> lock(*mu);
    auto it = known->find(address);
    if (it != known->end()) {
      return it->second;
    }
  }
  Dl_info info{};
  std::string name = "?";
  if (dladdr(address, &info) != 0 && info.dli_fname != nullptr) {
    name = info.dli_fname;
    name = name.substr(name.rfind('/') + 1);
    name = name.substr(0, name.find('.'));
  }
  std::lock_guard<std::mutex> lock(*mu);
  return known->emplace(address, name).first->second;
}

// $FAKE_CUDA_BACKTRACE=cuEventCreate,cuEventRecord: a diagnostic, not a
// model: each call of a named entry point prints the stack that made it
// (symbols as the dynamic linker knows them; c++filt reads them), to find
// whose code a count in fake_cuda_stats() comes from.
void maybeBacktrace(const char* fn) {
  static const std::string* wanted = [] {
    const char* env = getenv("FAKE_CUDA_BACKTRACE");
    return new std::string(env ? "," + std::string(env) + "," : "");
  }();
  if (wanted->empty() ||
      wanted->find("," + std::string(fn) + ",") == std::string::npos) {
    return;
  }
  void* frames[24];
  int n = backtrace(frames, 24);
  static auto* mu = new std::mutex();
  std::lock_guard<std::mutex> lock(*mu);
  fprintf(stderr, "fake_libcuda: backtrace of %s (pid %d)\n", fn, getpid());
  backtrace_symbols_fd(frames, n, 2);
}

// The checks every entry point but cuInit, cuDriverGetVersion and
// cuGetError* starts with; `caller` is the entry point's return address.
CUresult enter(const char* fn, bool needContext, const void* caller) {
  maybeBacktrace(fn);
  {
    std::string from = moduleOf(caller) + ":" + fn;
    Stats& stats = state().stats;
    Lock lock(stats.mu);
    ++stats.calls[fn];
    ++stats.callsFrom[from];
  }
  pid_t pid = g_initPid.load();
  if (inWorker()) {
    return fail(fn, CUDA_ERROR_NOT_PERMITTED, "called from a stream's work");
  }
  if (pid == 0 || pid != getpid()) {
    const char* why = pid ? "used after fork()" : "cuInit(0) first";
    return fail(fn, CUDA_ERROR_NOT_INITIALIZED, why);
  }
  if (g_deinitialized.load()) {
    return fail(fn, CUDA_ERROR_DEINITIALIZED, "the driver shut down at exit");
  }
  if (needContext && currentContext() == nullptr) {
    return fail(fn, CUDA_ERROR_INVALID_CONTEXT, "no current context");
  }
  if (needContext && currentContext()->retains.load() == 0) {
    return fail(fn, CUDA_ERROR_CONTEXT_IS_DESTROYED, "released context");
  }
  return CUDA_SUCCESS;
}

#define ENTER(needContext) \
  CHECK(enter(__func__, needContext, __builtin_return_address(0)))

// The device memory this process holds: cuMemAlloc's allocations and the
// handles cuMemCreate made here (mu held).
uint64_t deviceBytesLocked() {
  uint64_t n = 0;
  for (const auto& [p, a] : state().allocs) {
    n += a.length;
  }
  for (const auto& [h, v] : state().vmmHandles) {
    n += v.created ? v.size : 0;
  }
  return n;
}

// CUDA_ERROR_OUT_OF_MEMORY if `bytes` more would pass $FAKE_CUDA_MEM_LIMIT.
CUresult fitsMemLimit(const char* fn, uint64_t bytes) {
  State& s = state();
  if (s.memLimit == 0) {
    return CUDA_SUCCESS;
  }
  Lock lock(s.mu);
  if (deviceBytesLocked() + bytes > s.memLimit) {
    return fail(fn, CUDA_ERROR_OUT_OF_MEMORY, "over $FAKE_CUDA_MEM_LIMIT");
  }
  return CUDA_SUCCESS;
}

// Graph capture (see the top).
std::atomic<bool> g_globalCapture{false};
// This thread's capture mode (a pthread key, as the state above).
CUstreamCaptureMode captureMode() {
  auto v = reinterpret_cast<uintptr_t>(pthread_getspecific(threadKey(2)));
  return v == 0 ? CU_STREAM_CAPTURE_MODE_GLOBAL
                : static_cast<CUstreamCaptureMode>(v - 1);
}
void setCaptureMode(CUstreamCaptureMode mode) {
  pthread_setspecific(
      threadKey(2), reinterpret_cast<void*>(static_cast<uintptr_t>(mode) + 1));
}

CUresult unsafeInCapture(const char* fn) {
  if (!g_globalCapture.load() ||
      captureMode() == CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_SUCCESS;
  }
  state().stats.captureViolations++;
  return fail(
      fn,
      CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
      "a global-mode capture is active and this thread is not relaxed");
}

// A potentially unsafe call during a global-mode capture.
#define UNSAFE_IN_CAPTURE() CHECK(unsafeInCapture(__func__))

bool validDevice(int device) {
  return device >= 0 && device < state().devices;
}

// ---------------------------------------------------------------- streams

void runWorker(std::shared_ptr<CUstream_st> s) {
  setInWorker();
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->cv.wait(lock, [&] { return !s->work.empty() || s->stopping; });
    if (s->work.empty()) {
      break; // destroyed, and everything queued before is done
    }
    std::function<void()> fn = std::move(s->work.front());
    s->work.pop_front();
    lock.unlock();
    fn();
    fn = nullptr; // drop what it holds before anyone sees it done
    lock.lock();
    ++s->done;
    s->cv.notify_all();
  }
  lock.unlock();
  Lock global(state().mu);
  auto& workers = state().workers;
  workers.erase(std::remove(workers.begin(), workers.end(), s), workers.end());
}

// A new stream with its worker; the caller holds state().mu.
std::shared_ptr<CUstream_st> startStream(int device) {
  auto s = std::make_shared<CUstream_st>();
  s->device = device;
  state().workers.push_back(s);
  std::thread(runWorker, s).detach();
  return s;
}

void enqueue(CUstream_st& s, std::function<void()> fn) {
  Lock lock(s.mu);
  s.work.push_back(std::move(fn));
  ++s.enqueued;
  s.cv.notify_all();
}

// Waits for the work queued so far.
void drain(CUstream_st& s) {
  std::unique_lock<std::mutex> lock(s.mu);
  uint64_t target = s.enqueued;
  s.cv.wait(lock, [&] { return s.done >= target; });
}

// Waits for every stream of the process: what a device synchronisation is.
void drainAll() {
  std::vector<std::shared_ptr<CUstream_st>> all;
  {
    Lock lock(state().mu);
    all = state().workers;
  }
  for (auto& s : all) {
    drain(*s);
  }
}

// The stream a handle names; 0, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD
// all name the current context's NULL stream.
CUresult getStream(
    const char* fn,
    CUstream h,
    std::shared_ptr<CUstream_st>* s) {
  Lock lock(state().mu);
  if (h == nullptr || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
    if (currentContext() == nullptr) {
      return fail(fn, CUDA_ERROR_INVALID_CONTEXT, "NULL stream, no context");
    }
    if (!currentContext()->nullStream) {
      currentContext()->nullStream = startStream(currentContext()->device);
    }
    *s = currentContext()->nullStream;
    return CUDA_SUCCESS;
  }
  auto it = state().streams.find(h);
  if (it == state().streams.end()) {
    return fail(fn, CUDA_ERROR_INVALID_HANDLE, "unknown stream");
  }
  *s = it->second;
  return CUDA_SUCCESS;
}

void poisonedUse(const char* fn, const char* what) {
  state().stats.poisonedUses++;
  fprintf(stderr, "fake_libcuda: %s: %s (pid %d)\n", fn, what, getpid());
  // Where from: module and offset a frame (addr2line -f -C -e <module>
  // <offset> names the function), since such a use is often at a close.
  void* frames[32];
  int n = backtrace(frames, 32);
  for (int i = 0; i < n; ++i) {
    Dl_info info{};
    if (dladdr(frames[i], &info) && info.dli_fname) {
      fprintf(
          stderr,
          "  #%d %s +0x%lx\n",
          i,
          info.dli_fname,
          (unsigned long)((char*)frames[i] - (char*)info.dli_fbase));
    }
  }
}

// The counters of the event a handle names (and its device).
CUresult getEvent(
    const char* fn,
    CUevent h,
    std::shared_ptr<FakeCounterBlock>* block,
    int* device = nullptr) {
  Lock lock(state().mu);
  auto it = state().events.find(h);
  if (it == state().events.end()) {
    return fail(fn, CUDA_ERROR_INVALID_HANDLE, "unknown event");
  }
  if (it->second->opened &&
      it->second->block->counters->exporterDestroyed.load() != 0) {
    poisonedUse(fn, "an IPC event its exporter destroyed");
  }
  *block = it->second->block;
  if (device != nullptr) {
    *device = it->second->device;
  }
  return CUDA_SUCCESS;
}

std::atomic<uint64_t>& doneSlot(FakeCounters* c, uint64_t n) {
  return c->doneIn[n % kRecordWindow];
}

// Record n was made: not done yet (its slot holds an older record's number
// or 0; nothing is cleared, so no order of recorders and completers can
// erase a record's completion).
uint64_t recordPending(FakeCounters* c) {
  return ++c->recorded;
}

void completeRecord(FakeCounters* c, uint64_t n) {
  for (auto* highest : {&doneSlot(c, n), &c->completed}) {
    uint64_t now = highest->load();
    while (now < n && !highest->compare_exchange_weak(now, n)) {
    }
  }
}

// Record n is done, or one kRecordWindow or more records after it on the
// same slot is (only a record that far behind can be taken for done early).
bool recordDone(FakeCounters* c, uint64_t n) {
  return n == 0 || doneSlot(c, n).load() >= n;
}

// TSan orders what one process does only; an interprocess event's record
// completed by the peer ends a wait here with nothing it can see. Ordering
// across processes is modelled coarsely under TSan: a wait (or query) that
// finds an interprocess event's record done comes after every interprocess
// record this process completed before. Our protocols do make that causal:
// a peer records (a block's release, a landing's readiness) after waiting
// on our records; a wait in-process stays as precise as TSan makes it.
#if defined(__SANITIZE_THREAD__)
char tsanInterprocessOrder;
void interprocessRecorded(const FakeCounterBlock& b) {
  if (b.fd >= 0) {
    __tsan_release(&tsanInterprocessOrder);
  }
}
void interprocessSeen(const FakeCounterBlock& b) {
  if (b.fd >= 0) {
    __tsan_acquire(&tsanInterprocessOrder);
  }
}
#else
void interprocessRecorded(const FakeCounterBlock&) {}
void interprocessSeen(const FakeCounterBlock&) {}
#endif

// Polls: the counters may be written by another process.
void waitCompleted(FakeCounters* c, uint64_t n) {
  for (int polls = 0; !recordDone(c, n); ++polls) {
    auto pause = std::chrono::microseconds(polls < 100 ? 20 : 500);
    std::this_thread::sleep_for(pause);
  }
}

// ----------------------------------------------------------------- memory

// The entry of a map keyed by base address whose [base, base + size) holds p.
template <class Map>
typename Map::iterator containing(Map& m, uintptr_t p) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) {
    return m.end();
  }
  --it;
  return p - it->first < it->second.size ? it : m.end();
}

// Whether [p, p + n) is device (or pinned) memory this process may touch
// with prot; the caller holds state().mu.
bool accessible(uintptr_t p, size_t n, int prot) {
  State& s = state();
  uintptr_t end = p + n;
  if (n == 0 || end < p) {
    return n == 0;
  }
  auto inside = [&](auto& m) {
    auto it = containing(m, p);
    return it != m.end() && end - it->first <= it->second.size;
  };
  if (inside(s.allocs) || inside(s.ipcMappings) || inside(s.hostAllocs)) {
    return true;
  }
  // VMM: one or more adjacent mappings, each with the access asked for.
  for (auto it = containing(s.mappings, p);
       it != s.mappings.end() && (it->second.prot & prot) == prot;
       ++it) {
    uintptr_t mapEnd = it->first + it->second.size;
    auto next = std::next(it);
    if (end <= mapEnd) {
      return true;
    }
    if (next == s.mappings.end() || next->first != mapEnd) {
      return false;
    }
  }
  return false;
}

// The bases of the whole mappings that exactly cover [p, p + n), in order;
// empty if there are none such. The caller holds state().mu.
std::vector<uintptr_t> mappingsCovering(uintptr_t p, size_t n) {
  std::vector<uintptr_t> bases;
  auto& m = state().mappings;
  uintptr_t at = p;
  for (auto it = m.find(p); it != m.end() && it->first == at && at - p < n;
       ++it) {
    bases.push_back(at);
    at += it->second.size;
  }
  if (at - p != n) {
    bases.clear();
  }
  return bases;
}

CUresult checkProp(const char* fn, const CUmemAllocationProp* prop) {
  if (state().noVmm) {
    return fail(fn, CUDA_ERROR_NOT_SUPPORTED, "FAKE_CUDA_NO_VMM=1");
  }
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return fail(fn, CUDA_ERROR_INVALID_VALUE, "not PINNED on a device");
  }
  if (!validDevice(prop->location.id)) {
    return fail(fn, CUDA_ERROR_INVALID_DEVICE, "no such device");
  }
  return CUDA_SUCCESS;
}

// The memfd and its mapping behind cuMemAlloc, events and VMM handles.
int makeMemfd(const char* name, size_t size) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

void* mapShared(int fd, size_t size) {
  int prot = PROT_READ | PROT_WRITE;
  void* p = mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// ------------------------------------------------------------- legacy IPC

template <class Handle>
void encodeHandle(Handle* out, uint32_t kind, int fd, size_t size) {
  struct stat st{};
  fstat(fd, &st);
  IpcHandle h{kIpcMagic, kind, getpid(), fd, size, st.st_dev, st.st_ino};
  memset(out, 0, sizeof(*out));
  memcpy(out->reserved, &h, sizeof(h));
}

// The handle of that kind in `reserved`: one of ours, from another process.
CUresult decodeHandle(
    const char* fn,
    const char* reserved,
    uint32_t kind,
    IpcHandle* h) {
  memcpy(h, reserved, sizeof(*h));
  if (h->magic != kIpcMagic || h->kind != kind) {
    return fail(fn, CUDA_ERROR_INVALID_HANDLE, "not a handle of that kind");
  }
  if (h->pid == getpid() && !state().ipcSelf) { // as real drivers refuse them
    return fail(fn, CUDA_ERROR_INVALID_CONTEXT, "this very process's handle");
  }
  return CUDA_SUCCESS;
}

// The exporter's file, opened again through /proc (or pidfd_getfd), or -1
// if that process has gone or no longer has the file the handle names.
int openPeerFile(const IpcHandle& h) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd/%d", h.pid, h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  if (fd < 0) {
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, h.pid, 0));
    if (pidfd >= 0) {
      fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, h.fd, 0));
      close(pidfd);
    }
  }
#endif
  struct stat st{};
  if (fd >= 0 &&
      (fstat(fd, &st) != 0 || st.st_dev != h.dev || st.st_ino != h.ino)) {
    close(fd);
    fd = -1;
  }
  return fd;
}

// ---------------------------------------------------------------- kernels

void kernelError(const char* format, ...) {
  char text[256];
  va_list args;
  va_start(args, format);
  vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  Stats& stats = state().stats;
  stats.kernelErrors++;
  fprintf(stderr, "fake_libcuda: kernel error: %s\n", text);
  Lock lock(stats.mu);
  stats.lastKernelError = text;
}

// What the copy kernels do with [src, src + n) and dst. They assume the two
// do not overlap (their threads copy in no particular order).
// The device whose stream runs the kernel being run on this thread (a
// stream's worker), or -1 (a pthread key, as the state above).
int kernelDevice() {
  auto v = reinterpret_cast<uintptr_t>(pthread_getspecific(threadKey(3)));
  return static_cast<int>(v) - 1;
}
void setKernelDevice(int device) {
  pthread_setspecific(
      threadKey(3),
      reinterpret_cast<void*>(static_cast<uintptr_t>(device + 1)));
}

// Whether a copy kernel on kernelDevice() may touch [p, p + n): a VMM
// mapping only if cuMemSetAccess granted that device access.
bool reachableFromKernel(u64 p, u64 n) {
  const int device = kernelDevice();
  if (device < 0 || n == 0) {
    return true;
  }
  State& s = state();
  Lock lock(s.mu);
  for (u64 at : {p, p + n - 1}) {
    auto it = containing(s.mappings, at);
    if (it != s.mappings.end() && !it->second.devices.count(device)) {
      return false;
    }
  }
  return true;
}

void copyBytes(const char* kernel, u64 dst, u64 src, u64 n) {
  if (n == 0) {
    return;
  }
  if (!reachableFromKernel(dst, n) || !reachableFromKernel(src, n)) {
    return kernelError(
        "%s: %#llx or %#llx is memory device %d was not granted access to",
        kernel,
        dst,
        src,
        kernelDevice());
  }
  if (dst != src && (dst < src ? src - dst : dst - src) < n) {
    kernelError("%s: dst %#llx and src %#llx overlap", kernel, dst, src);
  }
  memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n);
  state().stats.kernelBytes += n;
}

// copy_segments(table, count, chunk_bytes): rows of (dst, src, nbytes,
// chunk_begin), where chunk_begin counts the chunks of the rows before.
void copySegments(u64 table, u64 count, u64 chunk) {
  if (count == 0 || chunk == 0) {
    return; // the kernel returns at once
  }
  if (table % 8 != 0) {
    return kernelError("copy_segments: table %#llx misaligned", table);
  }
  const u64* rows = reinterpret_cast<const u64*>(table);
  u64 expected = 0;
  for (u64 r = 0; r < count; ++r) {
    const u64* row = rows + 4 * r;
    if (row[3] != expected) {
      return kernelError(
          "copy_segments: row %llu has chunk_begin %llu, not %llu; "
          "nothing copied",
          r,
          row[3],
          expected);
    }
    expected += (row[2] + chunk - 1) / chunk;
  }
  for (u64 r = 0; r < count; ++r) {
    const u64* row = rows + 4 * r;
    copyBytes("copy_segments", row[0], row[1], row[2]);
  }
}

// pack_strided(dst, src, desc) and unpack_strided(dst, src, desc): desc is
// (ndim, elem_size, numel, sizes[ndim], strides[ndim] in elements).
void stridedCopy(bool pack, u64 contiguous, u64 strided, u64 desc) {
  const char* kernel = pack ? "pack_strided" : "unpack_strided";
  if (desc % 8 != 0) {
    return kernelError("%s: descriptor %#llx misaligned", kernel, desc);
  }
  const u64* d = reinterpret_cast<const u64*>(desc);
  u64 ndim = d[0], elem = d[1], numel = d[2];
  const u64* sizes = d + 3;
  const u64* strides = sizes + ndim;
  if ((elem != 1 && elem != 2 && elem != 4 && elem != 8 && elem != 16) ||
      ndim > 64) {
    return kernelError("%s: elem_size %llu, ndim %llu", kernel, elem, ndim);
  }
  u64 product = 1;
  for (u64 k = 0; k < ndim; ++k) {
    product *= sizes[k];
    if (!pack && sizes[k] > 1 && strides[k] == 0) {
      kernelError("%s: dimension %llu overlaps itself", kernel, k);
    }
  }
  if (product != numel) {
    return kernelError("%s: numel %llu, sizes %llu", kernel, numel, product);
  }
  u64 align = std::min<u64>(elem, 8);
  if (contiguous % align != 0 || strided % align != 0) {
    return kernelError("%s: addresses not %llu-aligned", kernel, align);
  }
  for (u64 i = 0; i < numel; ++i) {
    u64 rest = i, offset = 0;
    for (u64 k = ndim; k-- > 0;) {
      offset += rest % sizes[k] * strides[k];
      rest /= sizes[k];
    }
    char* a = reinterpret_cast<char*>(contiguous + i * elem);
    char* b = reinterpret_cast<char*>(strided + offset * elem);
    pack ? memcpy(a, b, elem) : memcpy(b, a, elem);
  }
  state().stats.kernelBytes += numel * elem;
}

void runKernel(FakeKernel kernel, u64 a, u64 b, u64 c) {
  switch (kernel) {
    case kCopyContiguous:
      return copyBytes("copy_contiguous", a, b, c);
    case kCopySegments:
      return copySegments(a, b, c);
    case kPackStrided:
      return stridedCopy(true, a, b, c);
    case kUnpackStrided:
      return stridedCopy(false, b, a, c);
    case kUnknownKernel:
      return;
  }
}

// Which of our kernels an entry is: its exact name, or the name in Itanium
// mangling, after its length (numba: ..._cuda7kernels14unpack_stridedB2v9..).
// "12pack_strided" is not in "14unpack_strided", so the two stay apart.
FakeKernel kernelOf(const std::string& entry) {
  for (int k = 0; k < kUnknownKernel; ++k) {
    std::string name = kKernelNames[k];
    std::string mangled = std::to_string(name.size()) + name;
    for (size_t at = entry.find(mangled); at != std::string::npos;
         at = entry.find(mangled, at + 1)) {
      if (at == 0 || !isdigit(static_cast<unsigned char>(entry[at - 1]))) {
        return static_cast<FakeKernel>(k);
      }
    }
    if (entry == name) {
      return static_cast<FakeKernel>(k);
    }
  }
  return kUnknownKernel;
}

bool identChar(char c) {
  return isalnum(static_cast<unsigned char>(c)) || strchr("_$.%", c);
}

// Where `word` occurs as a whole token in text, from `from` on.
size_t findWord(const std::string& text, const char* word, size_t from) {
  size_t n = strlen(word);
  for (size_t at = text.find(word, from); at != std::string::npos;
       at = text.find(word, at + 1)) {
    bool after = at + n == text.size() || !identChar(text[at + n]);
    if ((at == 0 || !identChar(text[at - 1])) && after) {
      return at;
    }
  }
  return std::string::npos;
}

std::string stripComments(const char* text) {
  std::string out;
  for (const char* p = text; *p;) {
    if (p[0] == '/' && p[1] == '/') {
      p += strcspn(p, "\n");
    } else if (p[0] == '/' && p[1] == '*') {
      const char* end = strstr(p + 2, "*/");
      p = end ? end + 2 : p + strlen(p);
    } else {
      out += *p++;
    }
  }
  return out;
}

// Fills mod->functions from the PTX text, as far as the fake needs it.
CUresult parsePtx(const char* image, CUmod_st* mod, const char** why) {
  std::string ptx = stripComments(image);
  constexpr auto npos = std::string::npos;
  size_t at = findWord(ptx, ".version", 0);
  int major = 0, minor = 0, sm = 0;
  *why = "no .version";
  if (at == npos ||
      sscanf(ptx.c_str() + at + 8, " %d.%d", &major, &minor) != 2) {
    return CUDA_ERROR_INVALID_PTX;
  }
  *why = "PTX ISA newer than this driver's CUDA version loads";
  if (major * 10 + minor > maxIsaOf(state().driverVersion)) {
    return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
  }
  at = findWord(ptx, ".target", 0);
  *why = ".target newer than the device's sm_90";
  if (at != npos && sscanf(ptx.c_str() + at + 7, " sm_%d", &sm) == 1 &&
      sm > kSm) {
    return CUDA_ERROR_INVALID_PTX;
  }
  auto skipSpace = [&](size_t p) {
    size_t q = ptx.find_first_not_of(" \t\r\n", p);
    return q == npos ? ptx.size() : q;
  };
  *why = "malformed .entry";
  for (at = findWord(ptx, ".entry", 0); at != npos;
       at = findWord(ptx, ".entry", at + 1)) {
    size_t line = ptx.rfind('\n', at);
    line = line == npos ? 0 : line + 1;
    if (findWord(ptx.substr(line, at - line), ".visible", 0) == npos) {
      continue;
    }
    size_t begin = skipSpace(at + 6), end = begin;
    while (end < ptx.size() && identChar(ptx[end])) {
      ++end;
    }
    size_t open = skipSpace(end), close = ptx.find(')', open);
    if (end == begin || open == ptx.size() || ptx[open] != '(' ||
        close == npos) {
      return CUDA_ERROR_INVALID_PTX;
    }
    auto fn = std::make_unique<CUfunc_st>();
    *fn = {mod, ptx.substr(begin, end - begin), kUnknownKernel, 0, 0};
    fn->kernel = kernelOf(fn->entry);
    for (size_t p = findWord(ptx, ".param", open); p < close;
         p = findWord(ptx, ".param", p + 1)) {
      size_t type = skipSpace(p + 6);
      ++fn->params;
      fn->u64Params += findWord(ptx, ".u64", type) == type;
    }
    mod->functions.push_back(std::move(fn));
  }
  *why = "no .visible .entry";
  return mod->functions.empty() ? CUDA_ERROR_INVALID_PTX : CUDA_SUCCESS;
}

// Copies go on a stream; the synchronous ones on the NULL stream, waited
// for. The sides said to be on the device must be device memory.
CUresult copyOn(
    const char* fn,
    const void* caller,
    CUstream h,
    uintptr_t dst,
    uintptr_t src,
    size_t n,
    bool dstDevice,
    bool srcDevice,
    bool wait) {
  std::shared_ptr<CUstream_st> s;
  CHECK(enter(fn, true, caller));
  CHECK(getStream(fn, h, &s));
  {
    Lock lock(state().mu);
    if (n != 0 && (dst == 0 || src == 0)) {
      return fail(fn, CUDA_ERROR_INVALID_VALUE, "null pointer");
    }
    if ((dstDevice && !accessible(dst, n, PROT_WRITE)) ||
        (srcDevice && !accessible(src, n, PROT_READ))) {
      return fail(fn, CUDA_ERROR_INVALID_VALUE, "not device memory");
    }
    if (!wait && n != 0 && dstDevice != srcDevice) {
      const uintptr_t host = dstDevice ? src : dst;
      auto pinnedIn = [&](auto& m) {
        auto it = containing(m, host);
        return it != m.end() && host + n - it->first <= it->second.size;
      };
      if (!pinnedIn(state().hostAllocs) && !pinnedIn(state().hostRegistered)) {
        state().stats.pageableCopies++;
      }
    }
  }
  state().stats.memcpys++;
  state().stats.memcpyBytes += n;
  // An asynchronous copy runs late as a kernel does ($FAKE_CUDA_KERNEL_
  // DELAY_MS), so a reader of either side not ordered after it is caught.
  const long delayMs = wait ? 0 : state().kernelDelayMs.load();
  const bool fault = !wait && srcDevice && !dstDevice &&
      state().dtohLeft.load() >= 0 && state().dtohLeft.fetch_sub(1) == 0;
  CUstream_st* stream = s.get(); // (alive while its work runs)
  enqueue(*s, [=] {
    if (delayMs > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    }
    if (fault) {
      stream->faultPending = true; // the next event recorded on it says so
      return;
    }
#if defined(__SANITIZE_THREAD__)
    // A synchronous copy is a test's peek or poke (the extension makes
    // asynchronous ones only): outside every stream by design (a test polls
    // a landing's bytes so), which TSan is not to judge.
    if (wait) {
      __tsan_ignore_thread_begin();
    }
#endif
    memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n);
#if defined(__SANITIZE_THREAD__)
    if (wait) {
      __tsan_ignore_thread_end();
    }
#endif
  });
  if (wait) {
    drain(*s);
  }
  return CUDA_SUCCESS;
}

void appendJson(std::string& out, const char* key, uint64_t value) {
  out += "\"" + std::string(key) + "\": " + std::to_string(value) + ", ";
}

void appendJson(std::string& out, const char* key, const std::string& value) {
  out += "\"" + std::string(key) + "\": \"";
  for (char c : value) {
    out += c == '"' || c == '\\' ? '\'' : (c < 0x20 && c >= 0 ? ' ' : c);
  }
  out += "\", ";
}

void closeJson(std::string& out) {
  out.resize(out.size() - 2); // the last ", "
  out += "}";
}

} // namespace

extern "C" {

// ------------------------------------------------- initialisation, devices

CUresult CUDAAPI cuInit(unsigned int flags) {
  pid_t pid = g_initPid.load();
  REQUIRE(pid == 0 || pid == getpid(), CUDA_ERROR_NOT_INITIALIZED, "forked");
  REQUIRE(flags == 0, CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  State& s = state();
  Lock lock(s.mu);
  if (pid != 0) {
    return CUDA_SUCCESS;
  }
  long devices = 1;
  char* end = nullptr;
  if (const char* env = getenv("FAKE_CUDA_DEVICES"); env && *env) {
    devices = strtol(env, &end, 10);
    REQUIRE(
        *end == '\0' && devices >= 0 && devices <= 64,
        CUDA_ERROR_INVALID_VALUE,
        "$FAKE_CUDA_DEVICES is not 0..64");
  }
  REQUIRE(devices > 0, CUDA_ERROR_NO_DEVICE, "FAKE_CUDA_DEVICES=0");
  if (const char* env = getenv("FAKE_CUDA_KERNEL_DELAY_MS"); env && *env) {
    const long ms = strtol(env, &end, 10);
    REQUIRE(
        *end == '\0' && ms >= 0 && ms <= 10000,
        CUDA_ERROR_INVALID_VALUE,
        "$FAKE_CUDA_KERNEL_DELAY_MS is not 0..10000");
    s.kernelDelayMs.store(ms);
  }
  if (const char* env = getenv("FAKE_CUDA_DRIVER_VERSION"); env && *env) {
    s.driverVersion = static_cast<int>(strtol(env, &end, 10));
    REQUIRE(
        *end == '\0' && s.driverVersion >= 9000,
        CUDA_ERROR_INVALID_VALUE,
        "$FAKE_CUDA_DRIVER_VERSION is not a CUDA version such as 12040");
  }
  if (const char* env = getenv("FAKE_CUDA_MEM_LIMIT"); env && *env) {
    s.memLimit = strtoull(env, &end, 10);
    REQUIRE(
        *end == '\0',
        CUDA_ERROR_INVALID_VALUE,
        "$FAKE_CUDA_MEM_LIMIT is not a number of bytes");
  }
  const char* noVmm = getenv("FAKE_CUDA_NO_VMM");
  const char* salt = getenv("FAKE_CUDA_UUID_SALT");
  s.noVmm = noVmm && strcmp(noVmm, "1") == 0;
  const char* noIpcEvents = getenv("FAKE_CUDA_NO_IPC_EVENTS");
  s.noIpcEvents = noIpcEvents && strcmp(noIpcEvents, "1") == 0;
  const char* noPeer = getenv("FAKE_CUDA_NO_PEER_ACCESS");
  s.noPeerAccess = noPeer && strcmp(noPeer, "1") == 0;
  const char* ipcSelf = getenv("FAKE_CUDA_IPC_SELF");
  s.ipcSelf = ipcSelf && strcmp(ipcSelf, "1") == 0;
  const char* openFails = getenv("FAKE_CUDA_IPC_MEM_OPEN_FAILS");
  s.ipcMemOpenFails = openFails && strcmp(openFails, "1") == 0;
  const char* handleFails = getenv("FAKE_CUDA_IPC_MEM_HANDLE_FAILS");
  s.ipcMemHandleFails = handleFails && strcmp(handleFails, "1") == 0;
  const char* importFails = getenv("FAKE_CUDA_IPC_IMPORT_FAILS");
  s.ipcImportFails = importFails && strcmp(importFails, "1") == 0;
  s.salt = salt ? salt : "";
  s.devices = static_cast<int>(devices);
  for (int d = 0; d < s.devices; ++d) {
    s.contexts.push_back(std::make_unique<CUctx_st>());
    s.contexts.back()->device = d;
  }
  if (const char* env = getenv("FAKE_CUDA_EXIT_DELAY_MS"); env && *env) {
    g_exitDelayMs = strtol(env, &end, 10);
  }
  // Registered after the program's own exit handlers of its start-up (the
  // extension's, made at import), so it runs before them, as the real
  // driver's does.
  std::atexit(shutDownAtExit);
  g_initPid = getpid();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  REQUIRE(version, CUDA_ERROR_INVALID_VALUE, "null pointer");
  // Also before cuInit, as the real one (which reads no state either).
  const char* env = getenv("FAKE_CUDA_DRIVER_VERSION");
  *version = env && *env ? atoi(env) : kDefaultDriverVersion;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** str) {
  const ErrorText* e = errorText(error);
  if (str != nullptr) {
    *str = e ? e->name : nullptr;
  }
  return e && str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** str) {
  const ErrorText* e = errorText(error);
  if (str != nullptr) {
    *str = e ? e->text : nullptr;
  }
  return e && str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuDeviceGetCount(int* count) {
  ENTER(false);
  REQUIRE(count, CUDA_ERROR_INVALID_VALUE, "null pointer");
  *count = state().devices;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  ENTER(false);
  REQUIRE(device, CUDA_ERROR_INVALID_VALUE, "null pointer");
  REQUIRE(validDevice(ordinal), CUDA_ERROR_INVALID_DEVICE, "no such device");
  *device = ordinal;
  return CUDA_SUCCESS;
}

// 16 bytes from (salt, index): the same in every process of one "machine".
CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  ENTER(false);
  REQUIRE(uuid, CUDA_ERROR_INVALID_VALUE, "null pointer");
  REQUIRE(validDevice(dev), CUDA_ERROR_INVALID_DEVICE, "no such device");
  auto mix = [](uint64_t x) { // splitmix64's finaliser
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t h = 0xcbf29ce484222325ull; // FNV-1a over the salt
  for (char c : "fake-cuda/" + state().salt) {
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  }
  uint64_t words[2] = {mix(h + 2 * dev + 1), mix(h + 2 * dev + 2)};
  memcpy(uuid->bytes, words, sizeof(words));
  return CUDA_SUCCESS;
}

// The attributes listed; any other is CUDA_ERROR_INVALID_VALUE, so that code
// asking for one the fake does not model is noticed.
CUresult CUDAAPI
cuDeviceGetAttribute(int* value, CUdevice_attribute attrib, CUdevice dev) {
  ENTER(false);
  REQUIRE(value, CUDA_ERROR_INVALID_VALUE, "null pointer");
  REQUIRE(validDevice(dev), CUDA_ERROR_INVALID_DEVICE, "no such device");
  const std::map<CUdevice_attribute, int> attributes = {
      {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 4},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, kSm / 10},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, kSm % 10},
      {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, !state().noVmm},
      {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
       !state().noVmm},
      {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
      {CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, !state().noIpcEvents},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024},
      {CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32},
  };
  auto it = attributes.find(attrib);
  REQUIRE(it != attributes.end(), CUDA_ERROR_INVALID_VALUE, "not modelled");
  *value = it->second;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI
cuDeviceCanAccessPeer(int* canAccess, CUdevice dev, CUdevice peer) {
  ENTER(false);
  REQUIRE(canAccess, CUDA_ERROR_INVALID_VALUE, "null pointer");
  REQUIRE(
      validDevice(dev) && validDevice(peer),
      CUDA_ERROR_INVALID_DEVICE,
      "no such device");
  *canAccess = dev != peer && !state().noPeerAccess;
  return CUDA_SUCCESS;
}

// --------------------------------------------------------------- contexts

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  ENTER(false);
  REQUIRE(ctx, CUDA_ERROR_INVALID_VALUE, "null pointer");
  REQUIRE(validDevice(dev), CUDA_ERROR_INVALID_DEVICE, "no such device");
  *ctx = state().contexts[dev].get();
  (*ctx)->retains++;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  ENTER(false);
  REQUIRE(validDevice(dev), CUDA_ERROR_INVALID_DEVICE, "no such device");
  std::atomic<int>& retains = state().contexts[dev]->retains;
  int n = retains.load();
  do {
    REQUIRE(n > 0, CUDA_ERROR_INVALID_CONTEXT, "released more than retained");
  } while (!retains.compare_exchange_weak(n, n - 1));
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext* ctx) {
  ENTER(false);
  REQUIRE(ctx, CUDA_ERROR_INVALID_VALUE, "null pointer");
  *ctx = currentContext();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  ENTER(false);
  auto& all = state().contexts;
  bool known = std::any_of(
      all.begin(), all.end(), [&](auto& c) { return c.get() == ctx; });
  REQUIRE(!ctx || known, CUDA_ERROR_INVALID_CONTEXT, "not a context");
  setCurrentContext(ctx);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------- device memory

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* dptr, size_t bytesize) {
  if (const long ms = state().allocDelayMs.load(); ms > 0) {
    // (fake_cuda_set_alloc_delay_ms: a slow allocation, as under memory
    // pressure, widens the window around it.)
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
  UNSAFE_IN_CAPTURE();
  ENTER(true);
  REQUIRE(dptr && bytesize, CUDA_ERROR_INVALID_VALUE, "null pointer, size 0");
  size_t length = roundUp(bytesize, kPage); // page-aligned: 256 at least
  CHECK(fitsMemLimit(__func__, length));
  int fd = makeMemfd("fake_cuda_alloc", length);
  void* p = fd < 0 ? nullptr : mapShared(fd, length);
  if (p == nullptr) {
    close(fd);
  }
  REQUIRE(p, CUDA_ERROR_OUT_OF_MEMORY, "memfd");
  Lock lock(state().mu);
  state().allocs[reinterpret_cast<uintptr_t>(p)] = {bytesize, length, fd};
  *dptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  Alloc a;
  {
    Lock lock(state().mu);
    auto it = state().allocs.find(dptr);
    REQUIRE(
        it != state().allocs.end(),
        CUDA_ERROR_INVALID_VALUE,
        "not the base of a cuMemAlloc");
    a = it->second;
    state().allocs.erase(it);
  }
  drainAll(); // work queued before may still use it
  munmap(reinterpret_cast<void*>(dptr), a.length);
  close(a.fd);
  return CUDA_SUCCESS;
}

// The allocation, IPC mapping or VMM mapping holding dptr.
CUresult CUDAAPI
cuMemGetAddressRange(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  ENTER(false);
  State& s = state();
  Lock lock(s.mu);
  uintptr_t base = 0;
  size_t size = 0;
  auto find = [&](auto& m) {
    auto it = containing(m, dptr);
    if (it != m.end()) {
      base = it->first;
      size = it->second.size;
    }
    return it != m.end();
  };
  bool found = find(s.allocs) || find(s.ipcMappings) || find(s.mappings);
  REQUIRE(found, CUDA_ERROR_NOT_FOUND, "not device memory");
  if (pbase != nullptr) {
    *pbase = base;
  }
  if (psize != nullptr) {
    *psize = size;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
  UNSAFE_IN_CAPTURE();
  auto s = reinterpret_cast<uintptr_t>(src);
  return copyOn(
      __func__,
      __builtin_return_address(0),
      nullptr,
      dst,
      s,
      n,
      true,
      false,
      true);
}

CUresult CUDAAPI cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
  UNSAFE_IN_CAPTURE();
  auto d = reinterpret_cast<uintptr_t>(dst);
  return copyOn(
      __func__,
      __builtin_return_address(0),
      nullptr,
      d,
      src,
      n,
      false,
      true,
      true);
}

// Any two addresses (unified addressing), as the real one.
CUresult CUDAAPI
cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
  return copyOn(
      __func__,
      __builtin_return_address(0),
      h,
      dst,
      src,
      n,
      false,
      false,
      false);
}

// A pitched copy of Height rows of WidthInBytes (the driver's 2D copy, what
// a strided view whose rows are contiguous moves by). Device, host and
// unified sides; each row must lie in memory of the side's kind.
CUresult CUDAAPI cuMemcpy2DAsync(const CUDA_MEMCPY2D* c, CUstream h) {
  const char* fn = __func__;
  std::shared_ptr<CUstream_st> s;
  CHECK(enter(fn, true, __builtin_return_address(0)));
  CHECK(getStream(fn, h, &s));
  REQUIRE(c != nullptr, CUDA_ERROR_INVALID_VALUE, "null CUDA_MEMCPY2D");
  auto side = [](CUmemorytype type, CUdeviceptr d, const void* host) {
    return type == CU_MEMORYTYPE_HOST ? reinterpret_cast<uintptr_t>(host)
                                      : static_cast<uintptr_t>(d);
  };
  auto known = [](CUmemorytype t) {
    return t == CU_MEMORYTYPE_HOST || t == CU_MEMORYTYPE_DEVICE ||
        t == CU_MEMORYTYPE_UNIFIED;
  };
  REQUIRE(
      known(c->srcMemoryType) && known(c->dstMemoryType),
      CUDA_ERROR_INVALID_VALUE,
      "memory type not host, device or unified");
  REQUIRE(
      c->WidthInBytes <= c->srcPitch && c->WidthInBytes <= c->dstPitch,
      CUDA_ERROR_INVALID_VALUE,
      "a pitch narrower than the width");
  const uintptr_t src = side(c->srcMemoryType, c->srcDevice, c->srcHost) +
      c->srcXInBytes + c->srcY * c->srcPitch;
  const uintptr_t dst = side(c->dstMemoryType, c->dstDevice, c->dstHost) +
      c->dstXInBytes + c->dstY * c->dstPitch;
  const size_t width = c->WidthInBytes;
  const size_t rows = c->Height;
  const size_t srcPitch = c->srcPitch;
  const size_t dstPitch = c->dstPitch;
  if (width != 0 && rows != 0) {
    Lock lock(state().mu);
    REQUIRE(src != 0 && dst != 0, CUDA_ERROR_INVALID_VALUE, "null pointer");
    const size_t srcSpan = (rows - 1) * srcPitch + width;
    const size_t dstSpan = (rows - 1) * dstPitch + width;
    REQUIRE(
        (c->dstMemoryType != CU_MEMORYTYPE_DEVICE ||
         accessible(dst, dstSpan, PROT_WRITE)) &&
            (c->srcMemoryType != CU_MEMORYTYPE_DEVICE ||
             accessible(src, srcSpan, PROT_READ)),
        CUDA_ERROR_INVALID_VALUE,
        "not device memory");
  }
  state().stats.memcpys++;
  state().stats.memcpyBytes += width * rows;
  const long delayMs = state().kernelDelayMs.load();
  enqueue(*s, [=] {
    if (delayMs > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    }
    for (size_t r = 0; r < rows; ++r) {
      memmove(
          reinterpret_cast<void*>(dst + r * dstPitch),
          reinterpret_cast<void*>(src + r * srcPitch),
          width);
    }
  });
  return CUDA_SUCCESS;
}

CUresult CUDAAPI
cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream h) {
  auto s = reinterpret_cast<uintptr_t>(src);
  return copyOn(
      __func__, __builtin_return_address(0), h, dst, s, n, true, false, false);
}

CUresult CUDAAPI
cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream h) {
  auto d = reinterpret_cast<uintptr_t>(dst);
  return copyOn(
      __func__, __builtin_return_address(0), h, d, src, n, false, true, false);
}

CUresult CUDAAPI cuMemHostAlloc(void** pp, size_t bytesize, unsigned flags) {
  UNSAFE_IN_CAPTURE();
  ENTER(true);
  unsigned known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
      CU_MEMHOSTALLOC_WRITECOMBINED;
  REQUIRE(
      pp && bytesize && !(flags & ~known),
      CUDA_ERROR_INVALID_VALUE,
      "null pointer, size 0 or unknown flags");
  size_t length = roundUp(bytesize, kPage);
  int prot = PROT_READ | PROT_WRITE;
  void* p = mmap(nullptr, length, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(p != MAP_FAILED, CUDA_ERROR_OUT_OF_MEMORY, "mmap");
  Lock lock(state().mu);
  state().hostAllocs[reinterpret_cast<uintptr_t>(p)] = {bytesize, length};
  *pp = p;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFreeHost(void* p) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  HostAlloc a;
  {
    Lock lock(state().mu);
    auto it = state().hostAllocs.find(reinterpret_cast<uintptr_t>(p));
    REQUIRE(
        it != state().hostAllocs.end(),
        CUDA_ERROR_INVALID_VALUE,
        "not from cuMemHostAlloc");
    a = it->second;
    state().hostAllocs.erase(it);
  }
  drainAll();
  munmap(p, a.length);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostRegister(void* p, size_t bytesize, unsigned flags) {
  UNSAFE_IN_CAPTURE();
  ENTER(true);
  unsigned known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
      CU_MEMHOSTREGISTER_READ_ONLY;
  REQUIRE(
      p && bytesize && !(flags & ~known),
      CUDA_ERROR_INVALID_VALUE,
      "null pointer, size 0 or unknown flags");
  auto base = reinterpret_cast<uintptr_t>(p);
  Lock lock(state().mu);
  auto& m = state().hostRegistered;
  auto next = m.lower_bound(base);
  bool overlaps = (next != m.end() && next->first < base + bytesize) ||
      (next != m.begin() &&
       std::prev(next)->first + std::prev(next)->second.size > base);
  REQUIRE(
      !overlaps,
      CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
      "a range already registered");
  m[base] = {bytesize, bytesize};
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostUnregister(void* p) {
  UNSAFE_IN_CAPTURE();
  ENTER(true);
  {
    Lock lock(state().mu);
    auto it = state().hostRegistered.find(reinterpret_cast<uintptr_t>(p));
    REQUIRE(
        it != state().hostRegistered.end(),
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        "not the start of a registered range");
    state().hostRegistered.erase(it);
  }
  // As on a GPU, work still using the range must be done first.
  drainAll();
  return CUDA_SUCCESS;
}

// -------------------------------------------------- virtual memory (VMM)

CUresult CUDAAPI cuMemGetAllocationGranularity(
    size_t* granularity,
    const CUmemAllocationProp* prop,
    CUmemAllocationGranularity_flags option) {
  ENTER(false);
  CHECK(checkProp(__func__, prop));
  REQUIRE(
      granularity &&
          (option == CU_MEM_ALLOC_GRANULARITY_MINIMUM ||
           option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
      CUDA_ERROR_INVALID_VALUE,
      "null pointer or unknown option");
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemCreate(
    CUmemGenericAllocationHandle* handle,
    size_t size,
    const CUmemAllocationProp* prop,
    unsigned long long flags) {
  UNSAFE_IN_CAPTURE();
  ENTER(true);
  CHECK(checkProp(__func__, prop));
  REQUIRE(
      handle && flags == 0 && size && size % kGranularity == 0,
      CUDA_ERROR_INVALID_VALUE,
      "size must be a multiple of 2 MiB");
  unsigned types = prop->requestedHandleTypes;
  REQUIRE(
      !(types & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      CUDA_ERROR_NOT_SUPPORTED,
      "only POSIX fd handles are modelled");
  CHECK(fitsMemLimit(__func__, size));
  int fd = makeMemfd("fake_cuda_vmm", size);
  REQUIRE(fd >= 0, CUDA_ERROR_OUT_OF_MEMORY, "memfd");
  Lock lock(state().mu);
  *handle = state().nextVmmHandle++;
  state().vmmHandles[*handle] = {fd, size, types != 0, true};
  return CUDA_SUCCESS;
}

// The memory lives on while mapped (the mappings hold the memfd).
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  Lock lock(state().mu);
  auto it = state().vmmHandles.find(handle);
  REQUIRE(
      it != state().vmmHandles.end(),
      CUDA_ERROR_INVALID_VALUE,
      "unknown handle");
  close(it->second.fd);
  state().vmmHandles.erase(it);
  return CUDA_SUCCESS;
}

// POSIX fd only: *(int*)shareable = a new fd, the caller's to close. A handle
// made without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested is refused
// with CUDA_ERROR_INVALID_VALUE (of the codes real drivers give, the fake's
// pick).
CUresult CUDAAPI cuMemExportToShareableHandle(
    void* shareable,
    CUmemGenericAllocationHandle handle,
    CUmemAllocationHandleType type,
    unsigned long long flags) {
  ENTER(false);
  REQUIRE(
      type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      CUDA_ERROR_NOT_SUPPORTED,
      "only POSIX fd handles are modelled");
  Lock lock(state().mu);
  auto it = state().vmmHandles.find(handle);
  REQUIRE(
      shareable && flags == 0 && it != state().vmmHandles.end(),
      CUDA_ERROR_INVALID_VALUE,
      "null pointer, flags or unknown handle");
  REQUIRE(
      it->second.exportable,
      CUDA_ERROR_INVALID_VALUE,
      "made without a POSIX fd handle type");
  int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  REQUIRE(fd >= 0, CUDA_ERROR_OUT_OF_MEMORY, "dup");
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

// osHandle is the fd itself, (void*)(intptr_t)fd, and the caller keeps it;
// anything but an fd of one of the fake's VMM memfds is refused.
CUresult CUDAAPI cuMemImportFromShareableHandle(
    CUmemGenericAllocationHandle* handle,
    void* osHandle,
    CUmemAllocationHandleType type) {
  ENTER(false);
  REQUIRE(!state().noVmm, CUDA_ERROR_NOT_SUPPORTED, "FAKE_CUDA_NO_VMM=1");
  REQUIRE(
      type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      CUDA_ERROR_NOT_SUPPORTED,
      "only POSIX fd handles are modelled");
  auto fd = reinterpret_cast<intptr_t>(osHandle);
  char path[64], target[64] = {};
  snprintf(path, sizeof(path), "/proc/self/fd/%ld", static_cast<long>(fd));
  struct stat st{};
  REQUIRE(
      handle && fd >= 0 && fd <= INT32_MAX &&
          readlink(path, target, sizeof(target) - 1) > 0 &&
          strncmp(target, "/memfd:fake_cuda_vmm", 20) == 0 &&
          fstat(static_cast<int>(fd), &st) == 0,
      CUDA_ERROR_INVALID_VALUE,
      "not an fd that cuMemExportToShareableHandle gave");
  REQUIRE(
      !state().ipcImportFails,
      CUDA_ERROR_OUT_OF_MEMORY,
      "$FAKE_CUDA_IPC_IMPORT_FAILS=1");
  int own = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
  REQUIRE(own >= 0, CUDA_ERROR_OUT_OF_MEMORY, "dup");
  Lock lock(state().mu);
  *handle = state().nextVmmHandle++;
  state().vmmHandles[*handle] = {own, static_cast<size_t>(st.st_size), true};
  return CUDA_SUCCESS;
}

// PROT_NONE address space; addr (a hint) is ignored.
CUresult CUDAAPI cuMemAddressReserve(
    CUdeviceptr* ptr,
    size_t size,
    size_t alignment,
    CUdeviceptr /*addr*/,
    unsigned long long flags) {
  ENTER(true);
  REQUIRE(!state().noVmm, CUDA_ERROR_NOT_SUPPORTED, "FAKE_CUDA_NO_VMM=1");
  REQUIRE(
      ptr && flags == 0 && size && size % kGranularity == 0 &&
          (alignment & (alignment - 1)) == 0,
      CUDA_ERROR_INVALID_VALUE,
      "size, alignment or flags");
  alignment = std::max(alignment, kGranularity);
  int anon = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  void* p = mmap(nullptr, size + alignment, PROT_NONE, anon, -1, 0);
  REQUIRE(p != MAP_FAILED, CUDA_ERROR_OUT_OF_MEMORY, "mmap");
  auto raw = reinterpret_cast<uintptr_t>(p);
  uintptr_t base = roundUp(raw, alignment);
  if (base > raw) {
    munmap(p, base - raw);
  }
  munmap(reinterpret_cast<void*>(base + size), raw + alignment - base);
  Lock lock(state().mu);
  state().reservations[base] = {size};
  *ptr = base;
  return CUDA_SUCCESS;
}

// The fake also refuses a range that is still mapped (unmap first).
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  State& s = state();
  Lock lock(s.mu);
  auto it = s.reservations.find(ptr);
  REQUIRE(
      it != s.reservations.end() && it->second.size == size,
      CUDA_ERROR_INVALID_VALUE,
      "not a reservation's base and size");
  auto mapped = s.mappings.lower_bound(ptr);
  REQUIRE(
      mapped == s.mappings.end() || mapped->first >= ptr + size,
      CUDA_ERROR_INVALID_VALUE,
      "still mapped");
  munmap(reinterpret_cast<void*>(ptr), size);
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

// Maps the handle's memfd there, still PROT_NONE (see cuMemSetAccess).
CUresult CUDAAPI cuMemMap(
    CUdeviceptr ptr,
    size_t size,
    size_t offset,
    CUmemGenericAllocationHandle handle,
    unsigned long long flags) {
  ENTER(true);
  State& s = state();
  Lock lock(s.mu);
  auto h = s.vmmHandles.find(handle);
  REQUIRE(h != s.vmmHandles.end(), CUDA_ERROR_INVALID_VALUE, "bad handle");
  REQUIRE(
      flags == 0 && offset == 0 && size && size % kGranularity == 0 &&
          ptr % kGranularity == 0 && size <= h->second.size,
      CUDA_ERROR_INVALID_VALUE,
      "flags, offset (must be 0) or size");
  auto r = containing(s.reservations, ptr);
  REQUIRE(
      r != s.reservations.end() && ptr + size - r->first <= r->second.size,
      CUDA_ERROR_INVALID_VALUE,
      "not inside a reservation");
  auto next = s.mappings.lower_bound(ptr);
  REQUIRE(
      (next == s.mappings.end() || next->first >= ptr + size) &&
          containing(s.mappings, ptr) == s.mappings.end(),
      CUDA_ERROR_INVALID_VALUE,
      "already mapped");
  int shared = MAP_SHARED | MAP_FIXED;
  void* at = reinterpret_cast<void*>(ptr);
  void* p = mmap(at, size, PROT_NONE, shared, h->second.fd, 0);
  REQUIRE(p != MAP_FAILED, CUDA_ERROR_OUT_OF_MEMORY, "mmap");
  s.mappings[ptr] = {size, PROT_NONE};
  return CUDA_SUCCESS;
}

// Back to a PROT_NONE reservation, once all work queued before is done.
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  drainAll();
  State& s = state();
  Lock lock(s.mu);
  std::vector<uintptr_t> bases = mappingsCovering(ptr, size);
  REQUIRE(!bases.empty(), CUDA_ERROR_INVALID_VALUE, "not whole mappings");
  for (uintptr_t base : bases) {
    s.mappings.erase(base);
  }
  int anon = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
  mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, anon, -1, 0);
  return CUDA_SUCCESS;
}

// Whole mappings only. The most any descriptor grants applies to the whole
// process on the host side; our copy kernels check the devices granted.
CUresult CUDAAPI cuMemSetAccess(
    CUdeviceptr ptr,
    size_t size,
    const CUmemAccessDesc* desc,
    size_t count) {
  ENTER(true);
  REQUIRE(desc && count, CUDA_ERROR_INVALID_VALUE, "no descriptors");
  int prot = PROT_NONE;
  std::set<int> devices;
  for (size_t i = 0; i < count; ++i) {
    const CUmemLocation& where = desc[i].location;
    REQUIRE(
        where.type == CU_MEM_LOCATION_TYPE_DEVICE,
        CUDA_ERROR_INVALID_VALUE,
        "not a device location");
    REQUIRE(validDevice(where.id), CUDA_ERROR_INVALID_DEVICE, "no device");
    CUmemAccess_flags f = desc[i].flags;
    REQUIRE(
        f == CU_MEM_ACCESS_FLAGS_PROT_NONE ||
            f == CU_MEM_ACCESS_FLAGS_PROT_READ ||
            f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        CUDA_ERROR_INVALID_VALUE,
        "unknown access flags");
    prot |= f == CU_MEM_ACCESS_FLAGS_PROT_NONE ? PROT_NONE
        : f == CU_MEM_ACCESS_FLAGS_PROT_READ   ? PROT_READ
                                               : PROT_READ | PROT_WRITE;
    if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE) {
      devices.insert(where.id);
    }
  }

  State& s = state();
  Lock lock(s.mu);
  std::vector<uintptr_t> bases = mappingsCovering(ptr, size);
  REQUIRE(!bases.empty(), CUDA_ERROR_INVALID_VALUE, "not whole mappings");
  // Each call sets the access of the devices it names (others keep
  // theirs). Memory lives on one device; another reaches it only peer to
  // peer.
  for (uintptr_t base : bases) {
    std::set<int> all = s.mappings[base].devices;
    all.insert(devices.begin(), devices.end());
    REQUIRE(
        all.size() < 2 || !s.noPeerAccess,
        CUDA_ERROR_INVALID_DEVICE,
        "access for two devices without peer access");
  }
  for (uintptr_t base : bases) {
    Mapping& m = s.mappings[base];
    if (prot == PROT_NONE) {
      m.prot = PROT_NONE;
      m.devices.clear();
    } else {
      m.prot |= prot;
      m.devices.insert(devices.begin(), devices.end());
    }
    mprotect(reinterpret_cast<void*>(base), m.size, m.prot);
  }
  return CUDA_SUCCESS;
}

// ------------------------------------------------ legacy IPC: memory

// The handle of the cuMemAlloc allocation holding dptr (any interior
// pointer names the whole allocation, as with real handles).
CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr dptr) {
  ENTER(false);
  Lock lock(state().mu);
  auto it = containing(state().allocs, dptr);
  REQUIRE(
      handle && it != state().allocs.end(),
      CUDA_ERROR_INVALID_VALUE,
      "not in a cuMemAlloc allocation");
  REQUIRE(
      !state().ipcMemHandleFails,
      CUDA_ERROR_MAP_FAILED,
      "$FAKE_CUDA_IPC_MEM_HANDLE_FAILS=1");
  encodeHandle(handle, kIpcMemory, it->second.fd, it->second.size);
  return CUDA_SUCCESS;
}

// Refcounted per exporter allocation: opening it again gives the same
// address. Flags must be CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, as documented.
CUresult CUDAAPI
cuIpcOpenMemHandle(CUdeviceptr* dptr, CUipcMemHandle handle, unsigned flags) {
  ENTER(true);
  IpcHandle h;
  REQUIRE(
      dptr && flags == CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
      CUDA_ERROR_INVALID_VALUE,
      "null pointer, or flags not LAZY_ENABLE_PEER_ACCESS");
  REQUIRE(
      !state().ipcMemOpenFails,
      CUDA_ERROR_OUT_OF_MEMORY,
      "$FAKE_CUDA_IPC_MEM_OPEN_FAILS=1");
  CHECK(decodeHandle(__func__, handle.reserved, kIpcMemory, &h));
  State& s = state();
  Lock lock(s.mu);
  auto known = s.ipcByFile.find({h.dev, h.ino});
  if (known != s.ipcByFile.end()) {
    s.ipcMappings[known->second].refs++;
    *dptr = known->second;
    return CUDA_SUCCESS;
  }
  int fd = openPeerFile(h);
  REQUIRE(fd >= 0, CUDA_ERROR_INVALID_HANDLE, "exporter or memory gone");
  void* p = mapShared(fd, h.size);
  close(fd);
  REQUIRE(p, CUDA_ERROR_MAP_FAILED, "mmap");
  auto base = reinterpret_cast<uintptr_t>(p);
  s.ipcMappings[base] = {h.size, {h.dev, h.ino}, 1, h.pid, h.fd};
  s.ipcByFile[{h.dev, h.ino}] = base;
  s.stats.ipcMemOpens++;
  *dptr = base;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
  ENTER(false);
  size_t size = 0;
  {
    Lock lock(state().mu);
    auto it = state().ipcMappings.find(dptr);
    REQUIRE(
        it != state().ipcMappings.end(),
        CUDA_ERROR_INVALID_VALUE,
        "not from cuIpcOpenMemHandle");
    if (--it->second.refs > 0) {
      return CUDA_SUCCESS;
    }
    // The exporter, still there, no longer has the memory: it freed it
    // before this close (a dead exporter's memory is the driver's to keep).
    IpcHandle h{};
    h.pid = it->second.exporter;
    h.fd = it->second.exporterFd;
    h.dev = it->second.file.first;
    h.ino = it->second.file.second;
    if (kill(h.pid, 0) == 0) {
      int fd = openPeerFile(h);
      if (fd < 0) {
        poisonedUse(__func__, "memory its exporter freed");
      } else {
        close(fd);
      }
    }
    size = it->second.size;
    state().ipcByFile.erase(it->second.file);
    state().ipcMappings.erase(it);
  }
  drainAll();
  munmap(reinterpret_cast<void*>(dptr), size);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- streams

CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned flags) {
  ENTER(true);
  REQUIRE(
      stream && !(flags & ~unsigned{CU_STREAM_NON_BLOCKING}),
      CUDA_ERROR_INVALID_VALUE,
      "null pointer or unknown flags");
  Lock lock(state().mu);
  std::shared_ptr<CUstream_st> s = startStream(currentContext()->device);
  state().streams[s.get()] = s;
  *stream = s.get();
  return CUDA_SUCCESS;
}

// Returns at once, as the real one; the worker finishes the queued work.
CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  ENTER(false);
  std::shared_ptr<CUstream_st> s;
  {
    Lock lock(state().mu);
    auto it = state().streams.find(stream);
    REQUIRE(
        it != state().streams.end(),
        CUDA_ERROR_INVALID_HANDLE,
        "not a stream from cuStreamCreate");
    s = it->second;
    state().streams.erase(it);
  }
  Lock lock(s->mu);
  s->stopping = true;
  s->cv.notify_all();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  std::shared_ptr<CUstream_st> s;
  CHECK(getStream(__func__, stream, &s));
  drain(*s);
  return CUDA_SUCCESS;
}

// Waits, on the stream, for the record that is the event's latest now.
CUresult CUDAAPI cuStreamWaitEvent(CUstream stream, CUevent ev, unsigned flg) {
  ENTER(true);
  std::shared_ptr<CUstream_st> s;
  std::shared_ptr<FakeCounterBlock> block;
  CHECK(getStream(__func__, stream, &s));
  CHECK(getEvent(__func__, ev, &block));
  REQUIRE(flg == 0, CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  uint64_t n = block->counters->recorded.load();
  enqueue(*s, [block, n] {
    waitCompleted(block->counters, n);
    interprocessSeen(*block);
  });
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* data) {
  ENTER(true);
  std::shared_ptr<CUstream_st> s;
  CHECK(getStream(__func__, stream, &s));
  REQUIRE(fn, CUDA_ERROR_INVALID_VALUE, "null function");
  state().stats.hostFuncs++;
  enqueue(*s, [fn, data] { fn(data); });
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  ENTER(false);
  REQUIRE(mode, CUDA_ERROR_INVALID_VALUE, "null pointer");
  REQUIRE(
      *mode == CU_STREAM_CAPTURE_MODE_GLOBAL ||
          *mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL ||
          *mode == CU_STREAM_CAPTURE_MODE_RELAXED,
      CUDA_ERROR_INVALID_VALUE,
      "unknown mode");
  const CUstreamCaptureMode previous = captureMode();
  setCaptureMode(*mode);
  *mode = previous;
  return CUDA_SUCCESS;
}

// ----------------------------------------------------------------- events

CUresult CUDAAPI cuEventCreate(CUevent* ev, unsigned flags) {
  ENTER(true);
  unsigned known =
      CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  REQUIRE(
      ev && !(flags & ~known),
      CUDA_ERROR_INVALID_VALUE,
      "null pointer or unknown flags");
  bool ipc = flags & CU_EVENT_INTERPROCESS;
  REQUIRE(
      !ipc || (flags & CU_EVENT_DISABLE_TIMING),
      CUDA_ERROR_INVALID_VALUE,
      "INTERPROCESS needs DISABLE_TIMING");
  REQUIRE(
      !ipc || !state().noIpcEvents,
      CUDA_ERROR_NOT_SUPPORTED,
      "FAKE_CUDA_NO_IPC_EVENTS=1");
  auto e = std::make_unique<CUevent_st>();
  e->flags = flags;
  e->device = currentContext()->device;
  e->block = std::make_shared<FakeCounterBlock>();
  if (!ipc) {
    e->block->counters = new FakeCounters();
  } else {
    int fd = makeMemfd("fake_cuda_event", kPage);
    void* p = fd < 0 ? nullptr : mapShared(fd, kPage);
    if (p == nullptr) {
      close(fd);
    }
    REQUIRE(p, CUDA_ERROR_OUT_OF_MEMORY, "memfd");
    e->block->fd = fd;
    e->block->counters = new (p) FakeCounters();
  }
  Lock lock(state().mu);
  *ev = e.get();
  state().events[e.get()] = std::move(e);
  return CUDA_SUCCESS;
}

// Work already queued on the event keeps its counters alive. An exporter's
// destroy poisons the processes' that opened it.
CUresult CUDAAPI cuEventDestroy(CUevent ev) {
  ENTER(false);
  Lock lock(state().mu);
  auto it = state().events.find(ev);
  REQUIRE(it != state().events.end(), CUDA_ERROR_INVALID_HANDLE, "no event");
  const auto& e = *it->second;
  if (e.block->fd >= 0 && !e.opened) {
    e.block->counters->exporterDestroyed.store(1);
  } else if (e.opened && e.block->counters->exporterDestroyed.load() != 0) {
    poisonedUse(__func__, "an IPC event its exporter destroyed");
  }
  state().events.erase(it);
  return CUDA_SUCCESS;
}

// recorded becomes n now; completed reaches n when the stream gets here.
// Event and stream must be of one device (CUDA_ERROR_INVALID_HANDLE).
CUresult CUDAAPI cuEventRecord(CUevent ev, CUstream stream) {
  ENTER(true);
  std::shared_ptr<CUstream_st> s;
  std::shared_ptr<FakeCounterBlock> block;
  int device = 0;
  CHECK(getStream(__func__, stream, &s));
  CHECK(getEvent(__func__, ev, &block, &device));
  REQUIRE(device == s->device, CUDA_ERROR_INVALID_HANDLE, "another device");
  uint64_t n = recordPending(block->counters);
  CUstream_st* on = s.get(); // (alive while its work runs)
  enqueue(*s, [block, n, on] {
    if (on->faultPending) {
      on->faultPending = false;
      block->counters->faulted = 1;
    }
    interprocessRecorded(*block);
    completeRecord(block->counters, n);
  });
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventQuery(CUevent ev) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  std::shared_ptr<FakeCounterBlock> block;
  CHECK(getEvent(__func__, ev, &block));
  FakeCounters* c = block->counters;
  bool done = recordDone(c, c->recorded.load());
  if (done) {
    interprocessSeen(*block);
  }
  if (done && c->faulted.exchange(0) != 0) {
    return fail(__func__, CUDA_ERROR_LAUNCH_FAILED, "a copy faulted (test)");
  }
  return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY; // not an error
}

CUresult CUDAAPI cuEventSynchronize(CUevent ev) {
  UNSAFE_IN_CAPTURE();
  ENTER(false);
  std::shared_ptr<FakeCounterBlock> block;
  CHECK(getEvent(__func__, ev, &block));
  waitCompleted(block->counters, block->counters->recorded.load());
  interprocessSeen(*block);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle* handle, CUevent ev) {
  ENTER(false);
  std::shared_ptr<FakeCounterBlock> block;
  CHECK(getEvent(__func__, ev, &block));
  REQUIRE(
      handle && block->fd >= 0,
      CUDA_ERROR_INVALID_VALUE,
      "not an INTERPROCESS event");
  encodeHandle(handle, kIpcEvent, block->fd, kPage);
  return CUDA_SUCCESS;
}

// A new event on the same counters.
CUresult CUDAAPI cuIpcOpenEventHandle(CUevent* ev, CUipcEventHandle handle) {
  ENTER(true);
  IpcHandle h;
  REQUIRE(ev, CUDA_ERROR_INVALID_VALUE, "null pointer");
  CHECK(decodeHandle(__func__, handle.reserved, kIpcEvent, &h));
  int fd = openPeerFile(h);
  REQUIRE(fd >= 0, CUDA_ERROR_INVALID_HANDLE, "exporter or event gone");
  void* p = mapShared(fd, kPage);
  if (p == nullptr) {
    close(fd);
  }
  REQUIRE(p, CUDA_ERROR_MAP_FAILED, "mmap");
  auto e = std::make_unique<CUevent_st>();
  e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
  e->device = currentContext()->device;
  e->opened = true;
  e->block = std::make_shared<FakeCounterBlock>();
  e->block->fd = fd;
  e->block->counters = static_cast<FakeCounters*>(p);
  Lock lock(state().mu);
  state().stats.ipcEventOpens++;
  *ev = e.get();
  state().events[e.get()] = std::move(e);
  return CUDA_SUCCESS;
}

// ----------------------------------------------------- modules and kernels

// PTX text only (no cubin or fatbin).
CUresult CUDAAPI cuModuleLoadData(CUmodule* module, const void* image) {
  UNSAFE_IN_CAPTURE();
  ENTER(true);
  REQUIRE(module && image, CUDA_ERROR_INVALID_VALUE, "null pointer");
  const char* text = static_cast<const char*>(image);
  REQUIRE(
      strncmp(
          text,
          "\x7f"
          "ELF",
          4) != 0,
      CUDA_ERROR_INVALID_IMAGE,
      "only PTX is modelled, not cubins");
  auto mod = std::make_unique<CUmod_st>();
  mod->context = currentContext();
  const char* why = "";
  CUresult rc = parsePtx(text, mod.get(), &why);
  REQUIRE(rc == CUDA_SUCCESS, rc, why);
  Lock lock(state().mu);
  for (auto& fn : mod->functions) {
    state().functions.insert(fn.get());
  }
  *module = mod.get();
  state().modules[mod.get()] = std::move(mod);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule module) {
  ENTER(true);
  Lock lock(state().mu);
  auto it = state().modules.find(module);
  REQUIRE(it != state().modules.end(), CUDA_ERROR_INVALID_HANDLE, "no module");
  for (auto& fn : it->second->functions) {
    state().functions.erase(fn.get());
  }
  state().modules.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI
cuModuleGetFunction(CUfunction* fn, CUmodule module, const char* name) {
  ENTER(true);
  REQUIRE(fn && name, CUDA_ERROR_INVALID_VALUE, "null pointer");
  Lock lock(state().mu);
  auto it = state().modules.find(module);
  REQUIRE(it != state().modules.end(), CUDA_ERROR_INVALID_HANDLE, "no module");
  for (auto& f : it->second->functions) {
    if (f->entry == name) {
      *fn = f.get();
      return CUDA_SUCCESS;
    }
  }
  return fail(
      __func__, CUDA_ERROR_NOT_FOUND, "no .visible .entry by that name");
}

// Queues the kernel's semantics on the stream, with the entry's .u64
// parameters read from kernelParams[i]. `extra` is not modelled.
CUresult CUDAAPI cuLaunchKernel(
    CUfunction f,
    unsigned gridDimX,
    unsigned gridDimY,
    unsigned gridDimZ,
    unsigned blockDimX,
    unsigned blockDimY,
    unsigned blockDimZ,
    unsigned sharedMemBytes,
    CUstream stream,
    void** kernelParams,
    void** extra) {
  ENTER(true);
  std::shared_ptr<CUstream_st> s;
  CHECK(getStream(__func__, stream, &s));
  CUfunc_st fn;
  {
    Lock lock(state().mu);
    REQUIRE(
        state().functions.count(f),
        CUDA_ERROR_INVALID_HANDLE,
        "unknown function (its module unloaded?)");
    fn = *f;
  }
  REQUIRE(
      fn.module->context == currentContext() &&
          s->device == currentContext()->device,
      CUDA_ERROR_INVALID_CONTEXT,
      "module or stream of another context");
  uint64_t threads = uint64_t{blockDimX} * blockDimY * blockDimZ;
  REQUIRE(
      gridDimX && gridDimY && gridDimZ && threads && threads <= 1024 &&
          blockDimZ <= 64 && gridDimX <= INT32_MAX && gridDimY <= 65535 &&
          gridDimZ <= 65535 && sharedMemBytes <= 48 * 1024,
      CUDA_ERROR_INVALID_VALUE,
      "grid, block or shared memory size");
  REQUIRE(!extra, CUDA_ERROR_NOT_SUPPORTED, "`extra` is not modelled");
  REQUIRE(
      kernelParams || fn.params == 0,
      CUDA_ERROR_INVALID_VALUE,
      "no kernelParams");
  REQUIRE(
      fn.kernel != kUnknownKernel && fn.params == 3 && fn.u64Params == 3,
      CUDA_ERROR_NOT_SUPPORTED,
      "the fake runs our three-u64 copy kernels only");
  uint64_t p[3];
  for (int i = 0; i < 3; ++i) {
    memcpy(&p[i], kernelParams[i], sizeof(p[i]));
  }
  FakeKernel kernel = fn.kernel;
  state().stats.launches[kernel]++;
  const long delayMs = state().kernelDelayMs.load();
  const int device = s->device;
  enqueue(*s, [=] {
    if (delayMs > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    }
    setKernelDevice(device);
    runKernel(kernel, p[0], p[1], p[2]);
    setKernelDevice(-1);
  });
  return CUDA_SUCCESS;
}

// ------------------------------------------------------ test-only exports

// A JSON object of counters (tests/cuda_fake/test_fake_driver.py reads it);
// returns its length and writes what fits in len, NUL-terminated.
// The (n+1)-th asynchronous device-to-host copy from now faults (see the
// top of this file); n < 0: none.
__attribute__((visibility("default"))) void fake_cuda_fail_dtoh_after(long n) {
  state().dtohLeft = n < 0 ? -1 : n;
}

__attribute__((visibility("default"))) int fake_cuda_stats(
    char* buf,
    size_t len) {
  State& s = state();
  std::string j = "{\"launches\": {";
  for (int k = 0; k <= kUnknownKernel; ++k) {
    appendJson(j, kKernelNames[k], s.stats.launches[k].load());
  }
  closeJson(j);
  j += ", \"live\": {";
  {
    Lock lock(s.mu);
    int retains = 0;
    for (auto& c : s.contexts) {
      retains += c->retains.load();
    }
    appendJson(j, "allocations", s.allocs.size());
    appendJson(j, "device_bytes", deviceBytesLocked());
    appendJson(j, "host_allocations", s.hostAllocs.size());
    appendJson(j, "host_registered", s.hostRegistered.size());
    appendJson(j, "ipc_mem_mappings", s.ipcMappings.size());
    appendJson(j, "vmm_handles", s.vmmHandles.size());
    appendJson(j, "vmm_reservations", s.reservations.size());
    appendJson(j, "vmm_mappings", s.mappings.size());
    appendJson(j, "streams", s.streams.size());
    appendJson(j, "stream_workers", s.workers.size());
    appendJson(j, "events", s.events.size());
    // Events opened from another process's handle and not yet destroyed:
    // 0 once this process has closed every import of its peers' blocks.
    size_t opened = 0;
    for (const auto& [h, e] : s.events) {
      opened += e->opened ? 1 : 0;
    }
    appendJson(j, "opened_ipc_events", opened);
    appendJson(j, "modules", s.modules.size());
    appendJson(j, "context_retains", retains);
    // Per device, by index: a process holds a context only on the devices
    // it uses (each costs hundreds of MiB on a GPU; EXCLUSIVE_PROCESS
    // devices refuse a second process's).
    j += "\"context_retains_by_device\": [";
    for (size_t d = 0; d < s.contexts.size(); ++d) {
      j += (d == 0 ? "" : ", ") + std::to_string(s.contexts[d]->retains.load());
    }
    j += "], ";
  }
  closeJson(j);
  j += ", ";
  appendJson(j, "memcpys", s.stats.memcpys.load());
  appendJson(j, "memcpy_bytes", s.stats.memcpyBytes.load());
  appendJson(j, "kernel_bytes", s.stats.kernelBytes.load());
  appendJson(j, "host_funcs", s.stats.hostFuncs.load());
  appendJson(j, "ipc_mem_opens", s.stats.ipcMemOpens.load());
  appendJson(j, "ipc_event_opens", s.stats.ipcEventOpens.load());
  appendJson(j, "errors", s.stats.errors.load());
  appendJson(j, "kernel_errors", s.stats.kernelErrors.load());
  appendJson(j, "poisoned_uses", s.stats.poisonedUses.load());
  appendJson(j, "capture_violations", s.stats.captureViolations.load());
  appendJson(j, "pageable_copies", s.stats.pageableCopies.load());
  {
    Lock lock(s.stats.mu);
    appendJson(j, "last_error", s.stats.lastError);
    appendJson(j, "last_kernel_error", s.stats.lastKernelError);
    // "name": {"key": n, ...}, for each map of counts.
    for (const auto& [name, counts] :
         {std::pair{"calls", &s.stats.calls},
          std::pair{"calls_from", &s.stats.callsFrom}}) {
      j += std::string("\"") + name + "\": {";
      for (const auto& [key, n] : *counts) {
        appendJson(j, key.c_str(), n);
      }
      if (counts->empty()) {
        j += "}, ";
      } else {
        closeJson(j);
        j += ", ";
      }
    }
  }
  closeJson(j);
  if (buf != nullptr && len > 0) {
    size_t n = std::min(len - 1, j.size());
    memcpy(buf, j.data(), n);
    buf[n] = '\0';
  }
  return static_cast<int>(j.size());
}

// Kernels and asynchronous copies queued from now on run this long late, as
// $FAKE_CUDA_KERNEL_DELAY_MS says at start (tests: a copy still queued
// past a deadline).
__attribute__((visibility("default"))) void fake_cuda_set_kernel_delay_ms(
    long ms) {
  state().kernelDelayMs.store(ms < 0 ? 0 : ms);
}

// cuMemAlloc returns this long late from now on (tests: a window around an
// allocation made wide enough to act in).
__attribute__((visibility("default"))) void fake_cuda_set_alloc_delay_ms(
    long ms) {
  state().allocDelayMs.store(ms < 0 ? 0 : ms);
}

// Zeroes the counters (not the live objects).
// Whether a stream of this process is capturing in global mode (tests).
__attribute__((visibility("default"))) void fake_cuda_set_global_capture(
    int on) {
  g_globalCapture.store(on != 0);
}

__attribute__((visibility("default"))) void fake_cuda_reset_stats(void) {
  Stats& s = state().stats;
  for (auto& n : s.launches) {
    n = 0;
  }
  for (auto* n :
       {&s.memcpys,
        &s.memcpyBytes,
        &s.kernelBytes,
        &s.hostFuncs,
        &s.ipcMemOpens,
        &s.ipcEventOpens,
        &s.errors,
        &s.kernelErrors,
        &s.poisonedUses,
        &s.captureViolations}) {
    *n = 0;
  }
  Lock lock(s.mu);
  s.lastError.clear();
  s.lastKernelError.clear();
  s.calls.clear();
  s.callsFrom.clear();
}

} // extern "C"
