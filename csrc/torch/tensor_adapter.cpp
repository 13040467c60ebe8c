// tensor_adapter.cpp -- see tensor_adapter.h.
#include "torch/tensor_adapter.h"

namespace memsched {

StorageRef storage_ref(const at::Tensor& tensor) {
  StorageRef ref;
  if (!tensor.defined() || !tensor.has_storage()) return ref;
  const c10::Storage& storage = tensor.storage();
  ref.key = reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl());
  ref.nbytes = static_cast<int64_t>(storage.nbytes());
  ref.is_cuda = tensor.is_cuda();
  return ref;
}

}  // namespace memsched
