// host_tensor.h -- torch CPU tensors whose storage is a block of a memsched
// host pool: pinned (cudaHostAlloc segments, for the offload executor's
// staging buffers) or pageable (aligned malloc, works everywhere). No
// cudaHostAlloc per tensor: segments are cached and split by the BlockPool.
//
// Entry point: HostTensorPool(pinned).empty(nbytes | shape, dtype).
//
// Note [Host tensor deleter]
//   A tensor from empty() owns a shared_ptr to the pool, so the pool outlives
//   every tensor carved from it. Its deleter calls BlockPool::free, which
//   takes the pool's mutex: it is safe from any thread (autograd's worker
//   threads, the Python thread, a DataLoader thread) and from inside or
//   outside the GIL, since the pool never calls back into Python.
//   WARNING: if a pinned buffer is read by an asynchronous copy on a CUDA
//   stream, call record_stream(tensor, stream) before dropping the tensor;
//   otherwise the block can be reused while the copy still reads it.
//
// Note [Pinned tensors need torch's CUDA initialised]
//   Rationale: Tensor.is_pinned() asks at::globalContext().isPinnedPtr(),
//   which answers false -- without looking at the pointer -- until torch
//   has lazily initialised its CUDA state (ATen/Context.h: "If the device is
//   not initialized, no pointer can be pinned for it"). memsched's pinned
//   segments come from cudaHostAlloc in csrc/backend, which does not tell
//   torch, so in a process with no CUDA tensor yet is_pinned() said False
//   and torch treated the blocks as pageable (non_blocking copies).
//   Approach: a pinned pool's empty() calls lazyInitDevice(kCUDA) (a
//   call_once, as torch.empty(pin_memory=True) does); torch's check then
//   reaches cudaPointerGetAttributes, which reports cudaMemoryTypeHost for
//   every address inside a cudaHostAlloc range.
//   WARNING: that initialises torch's CUDA allocator too, so
//   memsched.allocator.install() must come before the first pinned tensor.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/alloc/block_pool.h"

namespace memsched {

class HostTensorPool {
 public:
  explicit HostTensorPool(bool pinned);
  // A uint8 tensor of `nbytes` bytes on `stream` (0 = default stream).
  at::Tensor empty_bytes(int64_t nbytes, StreamHandle stream = 0);
  // A contiguous tensor of `shape` and `dtype`.
  at::Tensor empty(const std::vector<int64_t>& shape, at::ScalarType dtype, StreamHandle stream = 0);
  // Keep `tensor`'s block from reuse until work now queued on `stream` is done.
  void record_stream(const at::Tensor& tensor, StreamHandle stream);
  bool pinned() const { return pinned_; }
  BlockPool& pool() { return *pool_; }

 private:
  bool pinned_;                      // cudaHostAlloc segments (true) or aligned malloc
  std::shared_ptr<BlockPool> pool_;  // shared with every live tensor's deleter
};

}  // namespace memsched
