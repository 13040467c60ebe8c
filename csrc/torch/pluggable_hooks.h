// pluggable_hooks.h -- installs memsched's shim (libmemsched_alloc.so) as
// torch's CUDA allocator from C++, so that the hooks Python cannot reach are
// wired too: record_stream (Tensor.record_stream), reset
// (torch.cuda.empty_cache), and an out-of-memory that reaches torch as
// torch.OutOfMemoryError instead of a null storage.
#pragma once

#include <cstddef>
#include <cstdint>

namespace memsched {

// True when this build can wire the hooks (torch with CUDA libraries found).
bool pluggable_hooks_supported();

// Addresses of the shim's C functions (Python reads them with ctypes; _C
// never links the shim). 0 = absent.
struct ShimFunctions {
  uintptr_t malloc_fn = 0;         // void* (ssize_t size, int device, cudaStream_t stream)
  uintptr_t free_fn = 0;           // void (void* ptr, size_t size, int device, cudaStream_t stream)
  uintptr_t last_error_fn = 0;     // const char* (): why the calling thread's last malloc failed
  uintptr_t last_error_is_oom_fn = 0;  // int (): 1 if that failure was an out-of-memory
  uintptr_t record_stream_fn = 0;  // void (void* ptr, cudaStream_t stream)
  uintptr_t empty_cache_fn = 0;    // void ()
};

// Creates torch's CUDAPluggableAllocator over the shim and makes it current
// (torch.cuda.memory.change_current_allocator's C++), then sets the
// record_stream and reset hooks. Throws memsched::Error with torch's reason
// when torch's own allocator is already initialised. See Note [Installing
// from C++].
void install_memsched_allocator(const ShimFunctions& shim);

// Requires torch's current CUDA allocator to be a CUDAPluggableAllocator
// (after torch.cuda.memory.change_current_allocator). `record_stream_fn` is
// the address of `void(void* ptr, cudaStream_t stream)`, `empty_cache_fn` of
// `void()`; either may be 0 to leave that hook alone. Throws memsched::Error
// with the reason when it cannot.
void install_pluggable_hooks(uintptr_t record_stream_fn, uintptr_t empty_cache_fn);

// The malloc install_memsched_allocator gives torch, callable on its own for
// tests: the shim's pointer, or a throw of c10::OutOfMemoryError (an
// out-of-memory) or c10::Error (anything else) with the shim's message.
void* memsched_malloc_or_throw(const ShimFunctions& shim, size_t size, int device, uintptr_t stream);

}  // namespace memsched
