// pluggable_hooks.h -- wires the hooks of torch's CUDAPluggableAllocator that
// Python cannot reach: record_stream (Tensor.record_stream) and reset
// (torch.cuda.empty_cache), to C functions of libmemsched_alloc.so.
#pragma once

#include <cstdint>

namespace memsched {

// True when this build can wire the hooks (torch with CUDA libraries found).
bool pluggable_hooks_supported();

// Requires torch's current CUDA allocator to be a CUDAPluggableAllocator
// (after torch.cuda.memory.change_current_allocator). `record_stream_fn` is
// the address of `void(void* ptr, cudaStream_t stream)`, `empty_cache_fn` of
// `void()`; either may be 0 to leave that hook alone. Throws memsched::Error
// with the reason when it cannot.
void install_pluggable_hooks(uintptr_t record_stream_fn, uintptr_t empty_cache_fn);

}  // namespace memsched
