// tensor_adapter.h -- the one place that turns an at::Tensor into the plain
// facts the core needs (storage identity and size). See Note [Storage identity].
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace memsched {

// Note [Storage identity]
//   Rationale: the Trace counts memory per storage, not per tensor: views,
//   reshapes and in-place results share one allocation. Approach: key a tensor
//   by its StorageImpl address, which is stable for the storage's lifetime (a
//   data pointer is not: resize_ may reallocate, and two empty storages may
//   share nullptr). Limitations: a key may be reused after its storage dies, so
//   callers keep the storage alive (or hold a weak reference) while they use it.
struct StorageRef {
  uintptr_t key = 0;       // StorageImpl address; 0 for tensors without storage
  int64_t nbytes = 0;      // bytes of the whole storage
  bool is_cuda = false;
};

StorageRef storage_ref(const at::Tensor& tensor);

}  // namespace memsched
