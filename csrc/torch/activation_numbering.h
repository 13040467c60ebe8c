// activation_numbering.h -- the activation-identity rule (docs/CONVENTIONS-activation-identity.md,
// Note [Activation identity]) in C++: the one implementation that the profiler and the offload
// executor share, so a profiled step and an executed step number their saved tensors alike.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>

namespace memsched {

// What identifies a saved tensor's storage: the StorageImpl address (Note [Storage identity]) and
// a weak reference that keeps the address from being reused while it is held (Note [Storage keys
// and reuse] in saved_tensors.py). key 0: the tensor has no storage (sparse, mkldnn); each pack of
// it is a new activation. An empty `weak` with a nonzero key: the key came from Python for a
// tensor subclass whose storage C++ cannot reach (never offloaded; no reuse guard).
struct StorageIdentity {
  uintptr_t key = 0;
  int64_t nbytes = 0;
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>())};
};

// The identity of a plain tensor's storage (C++ only; tensor subclasses dispatching to Python go
// through the Python fallback in saved_tensor_path.cpp).
StorageIdentity storage_identity(const at::Tensor& tensor);

// A size as Python prints it (a concrete int, or the symbolic expression).
std::string symint_string(const c10::SymInt& size);

// torch's Python spelling of a dtype ("float32", "bfloat16"), as str(dtype) minus "torch.".
const std::string& dtype_name(at::ScalarType type);

// The shape and dtype of a label (Note [Labels built on demand]): what an executed step compares
// with the trace, without formatting a string per saved tensor.
struct LabelShape {
  c10::SmallVector<int64_t, 6> sizes;
  at::ScalarType dtype = at::ScalarType::Undefined;
  bool concrete = false;  // false: a symbolic size; compare the label strings instead

  // The storage-owning tensor's (the autograd view base when `tensor` is a view), as the label has it.
  static LabelShape of(const at::Tensor& tensor);
  // The `<shape>:<dtype>` tail of a label (`act:<k>:<path>:[2, 3]:float32`); concrete == false when
  // it does not parse as concrete sizes and a dtype torch names.
  static LabelShape parse(std::string_view label);
  bool operator==(const LabelShape& other) const {
    return concrete && other.concrete && dtype == other.dtype && sizes == other.sizes;
  }
};

// `act:<ordinal>:<module_path>:<shape>:<dtype>`, shape of the storage-owning tensor (the autograd
// view base when `tensor` is a view), dtype spelled as torch's Python name ("float32").
std::string activation_label(int64_t ordinal, std::string_view module_path, const at::Tensor& tensor);

// Numbers the saved activations of one step. number() returns ordinal -1 for a storage of the
// model's parameters or buffers, and for a nested tensor, else the storage's ordinal (views of one
// storage share it) and whether this is its first pack; the label is fixed at the first pack.
//
// Note [Nested tensors are not planned]
//   Rationale: a nested tensor (torch.nested, strided or jagged layout) has no sizes: labelling one
//   raised "NestedTensorImpl doesn't support sizes" in the profiled step where plain PyTorch trains,
//   and a jagged one's ragged size is a new symbol (j1, j2, ...) at every forward, so its label
//   never matched the trace and no step ran the plan.
//   Approach: a saved nested tensor is left as autograd saved it, like a parameter: never numbered,
//   offloaded or recomputed, in the profiled and the planned steps alike, so the other activations
//   of the step are planned as usual.
//   Limitations: its bytes are not an activation of the trace; the plan counts them as memory it
//   does not move.
class ActivationNumbering {
 public:
  struct Result {
    int64_t ordinal = -1;
    bool is_first_pack = false;
  };

  // The model's parameters and buffers; their storages are read again at every start_step(), so
  // `p.data = ...` between steps is seen.
  void set_parameters(std::vector<at::Tensor> parameters);
  void start_step();
  Result number(const at::Tensor& tensor, const StorageIdentity& id, std::string_view module_path);
  bool is_parameter(uintptr_t key) const { return key != 0 && parameter_keys_.count(key) != 0; }

  int64_t count() const { return static_cast<int64_t>(records_.size()); }
  // Built at the first call for an ordinal (See Note [Labels built on demand]).
  const std::string& label(int64_t ordinal) const;
  std::vector<std::string> labels() const;
  // The shape and dtype in the label of `ordinal` (concrete == false: symbolic; use label()).
  const LabelShape& shape(int64_t ordinal) const;

 private:
  struct Seen {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    bool guarded;  // storage is a real weak reference (see StorageIdentity)
    int64_t ordinal;
  };
  std::vector<at::Tensor> parameters_;
  std::unordered_set<uintptr_t> parameter_keys_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> parameter_refs_;  // keep the keys unique
  std::vector<uintptr_t> parameter_order_;  // parameters_[i]'s storage key when the table was built
  std::unordered_map<uintptr_t, Seen> seen_;
  struct Record {
    LabelShape shape;
    std::string module_path;
    mutable std::string label;  // "" until label() builds it (an eager one when the shape is symbolic)
  };
  std::vector<Record> records_;
};

}  // namespace memsched
