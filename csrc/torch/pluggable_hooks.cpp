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
#include "torch/pluggable_hooks.h"

#include "core/check.h"

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
