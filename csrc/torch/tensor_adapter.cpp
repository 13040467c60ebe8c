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

// See Note [Version counter identity].
static_assert(sizeof(c10::VariableVersion) == sizeof(void*),
              "c10::VariableVersion is no longer one intrusive_ptr; revisit version_counter_key");
static_assert(sizeof(c10::intrusive_ptr<c10::intrusive_ptr_target>) == sizeof(void*),
              "c10::intrusive_ptr is no longer one raw pointer; revisit version_counter_key");

uintptr_t version_counter_key(const at::Tensor& tensor) {
  if (!tensor.defined()) return 0;
  const c10::VariableVersion& version = tensor.unsafeGetTensorImpl()->version_counter();
  if (!version.enabled()) return 0;
  return reinterpret_cast<uintptr_t>(*reinterpret_cast<void* const*>(&version));
}

}  // namespace memsched
