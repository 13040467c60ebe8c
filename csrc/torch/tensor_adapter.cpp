// tensor_adapter.cpp -- see tensor_adapter.h.
#include "torch/tensor_adapter.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

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

namespace {

// See Note [Version counter aliases in C++]: no mode, no autograd, no version bump.
struct Unseen {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard hide{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
};

void take_counter_and_bits(at::Tensor& out, const at::Tensor& from) {
  c10::TensorImpl* impl = out.unsafeGetTensorImpl();
  impl->_set_conj(from.is_conj());
  impl->_set_neg(from.is_neg());
  impl->set_version_counter(from.unsafeGetTensorImpl()->version_counter());
}

}  // namespace

std::optional<at::Tensor> counter_alias(const at::Tensor& t) {
  if (!t.defined() || t.unsafeGetTensorImpl()->is_python_dispatch()) return std::nullopt;
  at::Tensor out;
  {
    Unseen unseen;
    out = at::empty({0}, t.options());
  }
  take_counter_and_bits(out, t);
  return out;
}

std::optional<at::Tensor> on_counter(const at::Tensor& counter, const at::Tensor& base, at::IntArrayRef size,
                                     at::IntArrayRef stride, int64_t offset) {
  if (!counter.defined() || !base.defined() || counter.unsafeGetTensorImpl()->is_python_dispatch() ||
      base.unsafeGetTensorImpl()->is_python_dispatch()) {
    return std::nullopt;
  }
  at::Tensor out;
  {
    Unseen unseen;
    out = at::empty({0}, counter.options().device(base.device())).set_(base.storage(), offset, size, stride);
  }
  take_counter_and_bits(out, counter);
  return out;
}

}  // namespace memsched
