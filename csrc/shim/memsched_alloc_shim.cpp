// memsched_alloc_shim.cpp -- libmemsched_alloc.so: memsched's device block
// pools behind the plain C entry points that
// torch.cuda.memory.CUDAPluggableAllocator loads with ctypes. No torch here.
//
//   void* memsched_malloc(ssize_t size, int device, cudaStream_t stream)
//   void  memsched_free(void* ptr, size_t size, int device, cudaStream_t stream)
//   void  memsched_record_stream(void* ptr, cudaStream_t stream)   (Tensor.record_stream)
//   void  memsched_empty_cache(void)                               (torch.cuda.empty_cache)
//   ...   statistics / snapshot as JSON text, history, peak reset, last error.
//
// Note [One pool per device, process-wide]
//   Rationale: torch installs one allocator for the whole process; its C
//   callbacks carry no context pointer. Approach: a fixed array of lazily
//   created BlockPools, one per device ordinal, each over CUDA device memory
//   and CUDA events for that device. This library links its own copy of
//   memsched_core/memsched_backend: _C talks to these pools only through the
//   C functions below (JSON for statistics), never by sharing C++ objects.
//
// Note [Errors across the C ABI]
//   Rationale: exceptions must not cross into torch's C++ through a C
//   function pointer. Approach: every entry point catches; the message goes to
//   a thread-local buffer (memsched_last_error, memsched_last_error_is_oom).
//   memsched.allocator.install() gives torch a C++ wrapper around
//   memsched_malloc that turns nullptr into torch.OutOfMemoryError or a
//   RuntimeError with that message (Note [Installing from C++] in
//   csrc/torch/pluggable_hooks.cpp). Loaded directly by
//   torch.cuda.memory.CUDAPluggableAllocator, which does not check for
//   nullptr, the shim also prints a failed malloc's message to stderr.
#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "backend/cuda_backend.h"
#include "core/alloc/block_pool.h"
#include "core/alloc/pool_json.h"

namespace {

using memsched::BlockPool;
using memsched::StreamHandle;

constexpr int kMaxDevices = 64;

// Note [Pool lookup on the hot path]
//   Every CUDA tensor's malloc and free passes through pool_for/existing_pool,
//   so the lookup is one acquire load of a pointer that, once set, never
//   changes (pools are never destroyed: torch frees tensors after exit
//   handlers run). Only the first call per device takes create_mutex; a
//   std::call_once per call would add a pthread_once and two thread-local
//   writes to every allocation.
struct DevicePools {
  std::mutex create_mutex;                             // creating a pool; history settings
  std::array<std::atomic<BlockPool*>, kMaxDevices> pools{};
  bool history_enabled = false;   // applied to pools created later too
  size_t history_max_entries = 0;
};

DevicePools& device_pools() {
  static DevicePools* pools = new DevicePools();  // never destroyed: torch frees after exit handlers
  return *pools;
}

thread_local std::string last_error;
thread_local bool last_error_is_oom = false;
// memsched_malloc also prints its failures to stderr unless the C++ install
// path (Note [Installing from C++] in csrc/torch/pluggable_hooks.cpp) turns
// that off: it raises them as torch errors instead.
std::atomic<bool> report_malloc_errors_to_stderr{true};
// Calls that reached the shim through torch's hooks (diagnostics: they show
// that Tensor.record_stream / torch.cuda.empty_cache really arrive here).
std::atomic<int64_t> record_stream_calls{0};
std::atomic<int64_t> empty_cache_calls{0};

BlockPool* existing_pool(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return device_pools().pools[device].load(std::memory_order_acquire);
}

BlockPool* pool_for(int device) {
  if (BlockPool* pool = existing_pool(device)) return pool;  // See Note [Pool lookup on the hot path]
  MEMSCHED_CHECK(device >= 0 && device < kMaxDevices, "memsched_malloc: device ", device,
                 " is out of range [0, ", kMaxDevices, ")");
  DevicePools& d = device_pools();
  std::lock_guard<std::mutex> lock(d.create_mutex);
  if (BlockPool* pool = d.pools[device].load(std::memory_order_relaxed)) return pool;
  auto raw = memsched::make_cuda_device_memory(device);  // first: names a missing device
  auto pool = std::make_unique<BlockPool>(raw, memsched::make_cuda_stream_events(device));
  if (d.history_enabled) pool->record_history(true, d.history_max_entries);
  BlockPool* created = pool.release();  // never destroyed, like device_pools()
  d.pools[device].store(created, std::memory_order_release);
  return created;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* memsched_malloc(ssize_t size, int device, void* stream) {
  try {
    if (size <= 0) return nullptr;
    return pool_for(device)->malloc(static_cast<size_t>(size), reinterpret_cast<StreamHandle>(stream));
  } catch (const std::exception& e) {
    last_error = e.what();
    last_error_is_oom = dynamic_cast<const memsched::OutOfMemoryError*>(&e) != nullptr;
    if (report_malloc_errors_to_stderr.load(std::memory_order_relaxed)) std::fprintf(stderr, "%s\n", e.what());
    return nullptr;
  }
}

__attribute__((visibility("default"))) void memsched_free(void* ptr, size_t /*size*/, int device,
                                                          void* /*stream*/) {
  try {
    if (ptr == nullptr) return;
    BlockPool* pool = existing_pool(device);
    MEMSCHED_CHECK(pool != nullptr, "memsched_free: no memsched pool for device ", device);
    pool->free(ptr);
  } catch (const std::exception& e) {
    last_error = e.what();
    std::fprintf(stderr, "memsched_free: %s\n", e.what());
  }
}

// Tensor.record_stream(s) reaches here through CUDAPluggableAllocator's
// record_stream hook (See Note [Wiring record_stream] in bind_torch.cpp).
__attribute__((visibility("default"))) void memsched_record_stream(void* ptr, void* stream) {
  record_stream_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    for (int d = 0; d < kMaxDevices; ++d) {
      BlockPool* pool = existing_pool(d);
      if (pool != nullptr && pool->owns(ptr)) {
        pool->record_stream(ptr, reinterpret_cast<StreamHandle>(stream));
        return;
      }
    }
    MEMSCHED_CHECK(false, "memsched_record_stream: ", ptr, " is not a live memsched allocation");
  } catch (const std::exception& e) {
    last_error = e.what();
    std::fprintf(stderr, "%s\n", e.what());
  }
}

__attribute__((visibility("default"))) void memsched_empty_cache() {
  empty_cache_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    for (int d = 0; d < kMaxDevices; ++d) {
      if (BlockPool* pool = existing_pool(d)) pool->empty_cache();
    }
  } catch (const std::exception& e) {
    last_error = e.what();
  }
}

// Number of device pools created so far (the highest device ordinal used + 1).
__attribute__((visibility("default"))) int memsched_num_devices_used() {
  int n = 0;
  for (int d = 0; d < kMaxDevices; ++d) {
    if (existing_pool(d) != nullptr) n = d + 1;
  }
  return n;
}

// Writes the device pool's state (pool_json.h) into buf when it fits (with its
// NUL) and returns the length needed including the NUL; 0 if the device has
// no pool yet.
__attribute__((visibility("default"))) size_t memsched_state_json(int device, int include_history,
                                                                   char* buf, size_t capacity) {
  try {
    BlockPool* pool = existing_pool(device);
    if (pool == nullptr) return 0;
    const std::string text = memsched::pool_state_json(*pool, device, include_history != 0);
    if (buf != nullptr && capacity > text.size()) std::memcpy(buf, text.c_str(), text.size() + 1);
    return text.size() + 1;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 0;
  }
}

__attribute__((visibility("default"))) void memsched_record_history(int enabled, size_t max_entries) {
  DevicePools& d = device_pools();
  std::lock_guard<std::mutex> lock(d.create_mutex);
  d.history_enabled = enabled != 0;
  d.history_max_entries = max_entries;
  for (int i = 0; i < kMaxDevices; ++i) {
    if (BlockPool* pool = existing_pool(i)) pool->record_history(enabled != 0, max_entries);
  }
}

// Bytes allocated now on `device` (0 before its first allocation): the memory guard's count (Note
// [Memory guard] in csrc/torch/saved_tensor_offload.cpp), read at every activation's first save
// while copies are in flight, so it must not build the JSON statistics.
__attribute__((visibility("default"))) int64_t memsched_allocated_bytes(int device) {
  BlockPool* pool = existing_pool(device);
  if (pool == nullptr) return 0;
  return pool->stats().allocated_bytes[memsched::kAggregatePool].current;
}

// Peak bytes allocated on `device` since the last memsched_reset_peak_stats (the profiler reads it
// around every op: Note [Memory the trace does not model] in python/memsched/profiler/unmodeled.py).
__attribute__((visibility("default"))) int64_t memsched_allocated_peak_bytes(int device) {
  BlockPool* pool = existing_pool(device);
  if (pool == nullptr) return 0;
  return pool->stats().allocated_bytes[memsched::kAggregatePool].peak;
}

// Peak bytes reserved (segments) on `device` since the last memsched_reset_peak_stats.
__attribute__((visibility("default"))) int64_t memsched_reserved_peak_bytes(int device) {
  BlockPool* pool = existing_pool(device);
  if (pool == nullptr) return 0;
  return pool->stats().reserved_bytes[memsched::kAggregatePool].peak;
}

__attribute__((visibility("default"))) void memsched_reset_peak_stats(int device) {
  if (BlockPool* pool = existing_pool(device)) pool->reset_peak_stats();
}

__attribute__((visibility("default"))) int memsched_check_invariants(int device) {
  try {
    if (BlockPool* pool = existing_pool(device)) pool->check_invariants();
    return 1;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 0;
  }
}

// How many times memsched_record_stream (which == 0) or memsched_empty_cache
// (which == 1) has been called in this process.
__attribute__((visibility("default"))) int64_t memsched_hook_calls(int which) {
  return which == 0 ? record_stream_calls.load() : empty_cache_calls.load();
}

// The last error on the calling thread ("" if none).
__attribute__((visibility("default"))) const char* memsched_last_error() { return last_error.c_str(); }

// 1 if the calling thread's last failed memsched_malloc was an out-of-memory.
__attribute__((visibility("default"))) int memsched_last_error_is_oom() { return last_error_is_oom ? 1 : 0; }

// Whether memsched_malloc prints its failures to stderr (default 1).
__attribute__((visibility("default"))) void memsched_report_malloc_errors_to_stderr(int enabled) {
  report_malloc_errors_to_stderr.store(enabled != 0, std::memory_order_relaxed);
}

__attribute__((visibility("default"))) int memsched_built_with_cuda() {
#ifdef MEMSCHED_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
