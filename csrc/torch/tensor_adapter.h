// tensor_adapter.h -- the one place that turns an at::Tensor into the plain
// facts the core needs (storage identity and size). See Note [Storage identity].
#pragma once

#include <cstdint>
#include <optional>

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

// Note [Version counter identity]
//   Rationale: autograd detects an in-place change to a saved tensor by its
//   version counter, which views share with their base -- but not every alias
//   shares it: unsafe_chunk/unsafe_split outputs (ATen's GRU/LSTM cells use
//   them), `.data` and set_ make tensors over the same storage with counters
//   of their own. The offload executor copies a whole storage at its first
//   save and reuses that copy for later saves of the same storage only while
//   the bytes are provably unchanged: same counter AND same version. Equal
//   version numbers on two different counters prove nothing.
//   Approach: the counter's address identifies it. c10::VariableVersion holds
//   exactly one c10::intrusive_ptr to its (private) counter, and intrusive_ptr
//   holds exactly one raw pointer, so the first word of the VariableVersion is
//   the address (static_asserts in the .cpp check both sizes; a test checks
//   that detach() shares the key and unsafe_chunk outputs do not).
//   Limitations: 0 for tensors whose counter is disabled (inference tensors);
//   a key may be reused after every tensor using the counter died, so callers
//   hold the tensor (or a weak reference to it) while they compare keys.
uintptr_t version_counter_key(const at::Tensor& tensor);

// Note [Version counter aliases in C++]
//   Rationale: a save the plan recomputes holds its tensor's version counter without its storage, and
//   its unpack returns the recomputed bytes on that counter (Note [Version counter of a saved tensor]
//   in saved_tensors.py). Done in Python with detach() and set_(), each dispatch went through the
//   recording dispatch mode of the forward it ran in: about 30 us per recomputed save on CPU, six
//   times the same ops without the mode.
//   Approach: the empty tensor and the set_ run with the Python dispatch keys excluded and below
//   ADInplaceOrView (no version bump, no mode sees them), and the counter is set on the TensorImpl,
//   as unpack_offloaded does. Tensor subclasses (Python dispatch) are left to Python: nullopt.
//   counter_alias(t): dtype, conj and neg bits and version counter of t, no storage.
//   on_counter(counter, base, ...): a tensor of counter's dtype, bits and version counter, on base's
//   storage with the given geometry.
std::optional<at::Tensor> counter_alias(const at::Tensor& t);
std::optional<at::Tensor> on_counter(const at::Tensor& counter, const at::Tensor& base, at::IntArrayRef size,
                                     at::IntArrayRef stride, int64_t offset);

}  // namespace memsched
