// activation_numbering.cpp -- see activation_numbering.h.
#include "torch/activation_numbering.h"

#include <array>
#include <mutex>
#include <sstream>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>

#include "core/check.h"
#include "torch/tensor_adapter.h"

namespace memsched {

StorageIdentity storage_identity(const at::Tensor& tensor) {
  StorageIdentity id;
  const StorageRef ref = storage_ref(tensor);  // Note [Storage identity]
  if (ref.key == 0) return id;
  id.key = ref.key;
  id.nbytes = ref.nbytes;
  id.weak = tensor.storage().getWeakStorageImpl();
  return id;
}

namespace {

// torch's Python spelling of a dtype ("float32", "bfloat16"), as str(dtype) minus "torch.".
const std::string& dtype_name(at::ScalarType type) {
  static std::array<std::string, static_cast<size_t>(at::ScalarType::NumOptions)> names;
  static std::once_flag once;
  std::call_once(once, [] {
    for (size_t i = 0; i < names.size(); ++i) {
      // torch's registered dtype objects carry the Python name; types torch does not expose
      // (never a tensor's dtype) fall back to c10's spelling.
      try {
        const THPDtype* dtype = torch::getTHPDtype(static_cast<at::ScalarType>(i));
        names[i] = dtype != nullptr ? dtype->name : c10::toString(static_cast<at::ScalarType>(i));
      } catch (const std::exception&) {
        names[i] = c10::toString(static_cast<at::ScalarType>(i));
      }
    }
  });
  return names.at(static_cast<size_t>(type));
}

}  // namespace

std::string symint_string(const c10::SymInt& size) {
  if (auto concrete = size.maybe_as_int()) return std::to_string(*concrete);
  std::ostringstream out;
  out << size;
  return out.str();
}

std::string activation_label(int64_t ordinal, std::string_view module_path, const at::Tensor& tensor) {
  const at::TensorBase& owner =
      tensor.is_view() ? static_cast<const at::TensorBase&>(tensor._base()) : static_cast<const at::TensorBase&>(tensor);
  std::string label = "act:";
  label += std::to_string(ordinal);
  label += ':';
  label += module_path;
  label += ":[";
  bool first = true;
  for (const c10::SymInt& size : owner.sym_sizes()) {
    if (!first) label += ", ";
    first = false;
    label += symint_string(size);
  }
  label += "]:";
  label += dtype_name(owner.scalar_type());
  return label;
}

void ActivationNumbering::set_parameters(std::vector<at::Tensor> parameters) {
  parameters_ = std::move(parameters);
}

void ActivationNumbering::start_step() {
  seen_.clear();
  labels_.clear();
  parameter_keys_.clear();
  parameter_refs_.clear();
  for (const at::Tensor& p : parameters_) {
    StorageIdentity id = storage_identity(p);
    if (id.key == 0) continue;
    parameter_keys_.insert(id.key);
    parameter_refs_.push_back(std::move(id.weak));
  }
}

ActivationNumbering::Result ActivationNumbering::number(const at::Tensor& tensor, const StorageIdentity& id,
                                                        std::string_view module_path) {
  if (is_parameter(id.key)) return {};
  if (id.key != 0) {
    auto hit = seen_.find(id.key);
    // Holding the weak reference means the address cannot have been reused (Note [Storage keys
    // and reuse]); expired() is a cheap guard.
    if (hit != seen_.end() && (!hit->second.guarded || !hit->second.storage.expired())) {
      return {hit->second.ordinal, false};
    }
  }
  const int64_t ordinal = count();
  labels_.push_back(activation_label(ordinal, module_path, tensor));
  if (id.key != 0) {
    seen_.insert_or_assign(id.key, Seen{id.weak, !id.weak.expired(), ordinal});
  }
  return {ordinal, true};
}

const std::string& ActivationNumbering::label(int64_t ordinal) const {
  MEMSCHED_CHECK(ordinal >= 0 && ordinal < count(), "ActivationNumbering.label: ordinal ", ordinal,
                 " is not numbered in this step (", count(), " activations so far)");
  return labels_[static_cast<size_t>(ordinal)];
}

}  // namespace memsched
