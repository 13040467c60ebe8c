// host_tensor.cpp -- see host_tensor.h.
#include "torch/host_tensor.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>

#include "backend/cuda_backend.h"
#include "backend/host_memory.h"
#include "core/alloc/virtual_memory.h"
#include "core/check.h"

namespace memsched {

HostTensorPool::HostTensorPool(bool pinned) : pinned_(pinned) {
  if (pinned) {
    auto raw = make_cuda_pinned_memory();  // first: its error explains a missing GPU best
    pool_ = std::make_shared<BlockPool>(raw, make_cuda_stream_events(-1));
  } else {
    pool_ = std::make_shared<BlockPool>(std::make_shared<HostRawMemory>(),
                                        std::make_shared<ManualStreamEvents>(/*immediate=*/true));
  }
}

at::Tensor HostTensorPool::empty_bytes(int64_t nbytes, StreamHandle stream) {
  return empty({nbytes}, at::kByte, stream);
}

at::Tensor HostTensorPool::empty(const std::vector<int64_t>& shape, at::ScalarType dtype,
                                 StreamHandle stream) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    MEMSCHED_CHECK(d >= 0, "HostTensorPool.empty: negative dimension ", d, " in the shape");
    numel *= d;
  }
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  // See Note [Pinned tensors need torch's CUDA initialised].
  if (pinned_) at::globalContext().lazyInitDevice(at::kCUDA);
  auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (nbytes == 0) return at::empty(shape, options);
  void* ptr = pool_->malloc(static_cast<size_t>(nbytes), stream);
  // See Note [Host tensor deleter].
  std::shared_ptr<BlockPool> pool = pool_;
  return at::from_blob(ptr, shape, [pool](void* p) { pool->free(p); }, options);
}

void HostTensorPool::record_stream(const at::Tensor& tensor, StreamHandle stream) {
  void* ptr = tensor.storage().mutable_data();
  MEMSCHED_CHECK(pool_->owns(ptr), "HostTensorPool.record_stream: the tensor's storage was not "
                 "allocated by this pool (pass the tensor returned by empty(), not a copy)");
  pool_->record_stream(ptr, stream);
}

}  // namespace memsched
