// pluggable_hooks.cpp -- see pluggable_hooks.h.
//
// Note [Wiring record_stream]
//   Rationale: torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free)
//   exposes only malloc and free to Python. Tensor.record_stream(s) calls
//   CUDAAllocator::recordStream, which the pluggable allocator forwards to
//   its record_stream_fn_ -- empty unless set from C++ with
//   set_record_stream_fn (likewise torch.cuda.empty_cache -> reset_fn_).
//   Approach: after change_current_allocator, fetch the installed allocator
//   with torch::cuda::CUDAPluggableAllocator::getCurrentAllocator() and set
//   both hooks to the shim's memsched_record_stream / memsched_empty_cache,
//   whose addresses Python reads with ctypes (the shim is loaded once, by
//   CUDAPluggableAllocator, and _C never links it).
//   Limitations: needs torch's CUDA libraries at link time (libtorch_cuda,
//   libc10_cuda); without them install() says record_stream cannot be honoured.
//
// Note [Installing from C++]
//   Rationale: torch.cuda.memory.CUDAPluggableAllocator hands torch the
//   shim's malloc as a bare C function pointer. C functions cannot throw, so
//   an out-of-memory came back as nullptr: torch kept it as the storage of a
//   non-empty tensor (a crash at first use), callers never saw
//   torch.OutOfMemoryError, and cuDNN's search, which catches that error to
//   try a plan with a smaller workspace, could not.
//   Approach: install_memsched_allocator builds the same CUDAPluggableAllocator
//   with createCustomAllocator, but its malloc is a C++ lambda around the
//   shim's: on nullptr for a non-zero size it asks the shim why and throws
//   c10::OutOfMemoryError (surfaces as torch.OutOfMemoryError) or c10::Error.
//   free is the shim's function itself. changeCurrentAllocator is the call
//   torch.cuda.memory.change_current_allocator makes, so nothing else changes.
//   The cost is one extra indirect call per malloc.
#include "torch/pluggable_hooks.h"

#include "core/check.h"

#include <c10/util/Exception.h>
#include <sys/types.h>

#include <functional>
#include <string>

#ifdef MEMSCHED_TORCH_HAS_CUDA
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#endif

namespace memsched {

bool pluggable_hooks_supported() {
#ifdef MEMSCHED_TORCH_HAS_CUDA
  return true;
#else
  return false;
#endif
}

void* memsched_malloc_or_throw(const ShimFunctions& shim, size_t size, int device, uintptr_t stream) {
  using MallocFn = void* (*)(ssize_t, int, void*);
  using LastErrorFn = const char* (*)();
  using IsOomFn = int (*)();
  void* ptr = reinterpret_cast<MallocFn>(shim.malloc_fn)(static_cast<ssize_t>(size), device,
                                                         reinterpret_cast<void*>(stream));
  if (ptr != nullptr || size == 0) return ptr;
  const char* why = shim.last_error_fn != 0 ? reinterpret_cast<LastErrorFn>(shim.last_error_fn)() : nullptr;
  const std::string message = why != nullptr && why[0] != '\0'
                                  ? std::string(why)
                                  : "memsched: allocating " + std::to_string(size) + " bytes on device " +
                                        std::to_string(device) + " failed (no reason given)";
  const bool oom = shim.last_error_is_oom_fn != 0 && reinterpret_cast<IsOomFn>(shim.last_error_is_oom_fn)() != 0;
  TORCH_CHECK_WITH(OutOfMemoryError, !oom, message);
  TORCH_CHECK(false, message);
}

void install_memsched_allocator(const ShimFunctions& shim) {
  MEMSCHED_CHECK(shim.malloc_fn != 0 && shim.free_fn != 0,
                 "install_memsched_allocator: the shim's malloc and free addresses are required");
#ifdef MEMSCHED_TORCH_HAS_CUDA
  namespace pluggable = torch::cuda::CUDAPluggableAllocator;
  // See Note [Installing from C++].
  std::function<void*(size_t, int, cudaStream_t)> alloc = [shim](size_t size, int device, cudaStream_t stream) {
    return memsched_malloc_or_throw(shim, size, device, reinterpret_cast<uintptr_t>(stream));
  };
  std::function<void(void*, size_t, int, cudaStream_t)> free_fn =
      reinterpret_cast<void (*)(void*, size_t, int, cudaStream_t)>(shim.free_fn);
  auto allocator = pluggable::createCustomAllocator(std::move(alloc), std::move(free_fn));
  try {
    pluggable::changeCurrentAllocator(allocator);
  } catch (const c10::Error& e) {
    MEMSCHED_CHECK(false, "install_memsched_allocator: torch refused to change its CUDA allocator: ",
                   e.what_without_backtrace());
  }
  install_pluggable_hooks(shim.record_stream_fn, shim.empty_cache_fn);
#else
  MEMSCHED_CHECK(false, "install_memsched_allocator: memsched was built without torch's CUDA libraries "
                 "(libtorch_cuda/libc10_cuda not found at build time); rebuild against a CUDA build of torch");
#endif
}

void install_pluggable_hooks(uintptr_t record_stream_fn, uintptr_t empty_cache_fn) {
#ifdef MEMSCHED_TORCH_HAS_CUDA
  namespace pluggable = torch::cuda::CUDAPluggableAllocator;
  auto current = pluggable::getCurrentAllocator();
  MEMSCHED_CHECK(current != nullptr && current->name() == "pluggable",
                 "install_pluggable_hooks: torch's current CUDA allocator is not a pluggable "
                 "allocator; call torch.cuda.memory.change_current_allocator first");
  auto* allocator = static_cast<pluggable::CUDAPluggableAllocator*>(current.get());
  if (record_stream_fn != 0) {
    auto* fn = reinterpret_cast<void (*)(void*, cudaStream_t)>(record_stream_fn);
    allocator->set_record_stream_fn(fn);
  }
  if (empty_cache_fn != 0) {
    auto* fn = reinterpret_cast<void (*)()>(empty_cache_fn);
    allocator->set_reset_fn(fn);
  }
#else
  (void)record_stream_fn;
  (void)empty_cache_fn;
  MEMSCHED_CHECK(false, "install_pluggable_hooks: memsched was built without torch's CUDA libraries "
                 "(libtorch_cuda/libc10_cuda not found at build time), so Tensor.record_stream cannot "
                 "be routed to memsched; rebuild against a CUDA build of torch");
#endif
}

}  // namespace memsched
