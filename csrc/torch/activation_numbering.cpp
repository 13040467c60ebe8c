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

namespace {

const at::TensorBase& storage_owner(const at::Tensor& tensor) {
  return tensor.is_view() ? static_cast<const at::TensorBase&>(tensor._base()) : static_cast<const at::TensorBase&>(tensor);
}

// dtype_name's inverse; Undefined for a name torch does not give a dtype.
at::ScalarType dtype_named(std::string_view name) {
  for (size_t i = 0; i < static_cast<size_t>(at::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<at::ScalarType>(i);
    if (dtype_name(type) == name) return type;
  }
  return at::ScalarType::Undefined;
}

}  // namespace

// Note [Labels built on demand]
//   Rationale: an executed step checks every activation's shape and dtype against the trace's label
//   (Note [Activation identity]); formatting a label string per saved tensor and comparing strings
//   was a tenth of the hooks' own cost on a small decoder.
//   Approach: number() records the owner's sizes and dtype (a small inline vector: no allocation up
//   to 6 dimensions); the executor parses the trace's labels once per schedule (LabelShape::parse)
//   and compares those records. label() formats the string the first time it is asked for (the
//   profiler, an offloaded tensor's messages, a mismatch). A symbolic size is kept as its string and
//   compared as a string, as before.
LabelShape LabelShape::of(const at::Tensor& tensor) {
  const at::TensorBase& owner = storage_owner(tensor);
  LabelShape shape;
  shape.dtype = owner.scalar_type();
  shape.concrete = true;
  for (const c10::SymInt& size : owner.sym_sizes()) {
    const auto concrete = size.maybe_as_int();
    if (!concrete) {
      shape.concrete = false;
      shape.sizes.clear();
      break;
    }
    shape.sizes.push_back(*concrete);
  }
  return shape;
}

LabelShape LabelShape::parse(std::string_view label) {
  LabelShape shape;
  const size_t open = label.rfind(":[");
  const size_t close = label.rfind("]:");
  if (open == std::string_view::npos || close == std::string_view::npos || close < open + 2) return shape;
  std::string_view sizes = label.substr(open + 2, close - open - 2);
  while (!sizes.empty()) {
    const size_t comma = sizes.find(", ");
    const std::string_view item = sizes.substr(0, comma);
    if (item.empty() || item.size() > 18) return LabelShape{};
    int64_t value = 0;
    for (const char c : item) {
      if (c < '0' || c > '9') return LabelShape{};  // symbolic (or not a size): compare strings
      value = value * 10 + (c - '0');
    }
    shape.sizes.push_back(value);
    sizes = comma == std::string_view::npos ? std::string_view() : sizes.substr(comma + 2);
  }
  shape.dtype = dtype_named(label.substr(close + 2));
  shape.concrete = shape.dtype != at::ScalarType::Undefined;
  if (!shape.concrete) shape.sizes.clear();
  return shape;
}

std::string symint_string(const c10::SymInt& size) {
  if (auto concrete = size.maybe_as_int()) return std::to_string(*concrete);
  std::ostringstream out;
  out << size;
  return out.str();
}

std::string activation_label(int64_t ordinal, std::string_view module_path, const at::Tensor& tensor) {
  const at::TensorBase& owner = storage_owner(tensor);
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
  parameter_order_.clear();  // start_step() rebuilds the table
}

void ActivationNumbering::start_step() {
  seen_.clear();
  records_.clear();
  // The parameters' storages are usually those of the last step: keep the table then (its weak
  // references keep the keys unique), rebuild it when any changed (`p.data = ...`).
  bool same = parameter_order_.size() == parameters_.size();
  for (size_t i = 0; same && i < parameters_.size(); ++i) same = storage_ref(parameters_[i]).key == parameter_order_[i];
  if (same) return;
  parameter_keys_.clear();
  parameter_refs_.clear();
  parameter_order_.clear();
  for (const at::Tensor& p : parameters_) {
    StorageIdentity id = storage_identity(p);
    parameter_order_.push_back(id.key);
    if (id.key == 0) continue;
    parameter_keys_.insert(id.key);
    parameter_refs_.push_back(std::move(id.weak));
  }
}

ActivationNumbering::Result ActivationNumbering::number(const at::Tensor& tensor, const StorageIdentity& id,
                                                        std::string_view module_path) {
  // See Note [Nested tensors are not planned] (activation_numbering.h)
  if (is_parameter(id.key) || tensor.is_nested()) return {};
  if (id.key != 0) {
    auto hit = seen_.find(id.key);
    // Holding the weak reference means the address cannot have been reused (Note [Storage keys
    // and reuse]); expired() is a cheap guard.
    if (hit != seen_.end() && (!hit->second.guarded || !hit->second.storage.expired())) {
      return {hit->second.ordinal, false};
    }
  }
  const int64_t ordinal = count();
  Record& record = records_.emplace_back();
  record.shape = LabelShape::of(tensor);
  record.module_path = module_path;
  if (!record.shape.concrete) record.label = activation_label(ordinal, module_path, tensor);
  if (id.key != 0) {
    seen_.insert_or_assign(id.key, Seen{id.weak, !id.weak.expired(), ordinal});
  }
  return {ordinal, true};
}

const std::string& ActivationNumbering::label(int64_t ordinal) const {
  MEMSCHED_CHECK(ordinal >= 0 && ordinal < count(), "ActivationNumbering.label: ordinal ", ordinal,
                 " is not numbered in this step (", count(), " activations so far)");
  const Record& record = records_[static_cast<size_t>(ordinal)];
  if (record.label.empty()) {
    // See Note [Labels built on demand]: the same string activation_label() makes.
    std::string& label = record.label;
    label = "act:";
    label += std::to_string(ordinal);
    label += ':';
    label += record.module_path;
    label += ":[";
    for (size_t i = 0; i < record.shape.sizes.size(); ++i) {
      if (i > 0) label += ", ";
      label += std::to_string(record.shape.sizes[i]);
    }
    label += "]:";
    label += dtype_name(record.shape.dtype);
  }
  return record.label;
}

std::vector<std::string> ActivationNumbering::labels() const {
  std::vector<std::string> out;
  out.reserve(records_.size());
  for (int64_t k = 0; k < count(); ++k) out.push_back(label(k));
  return out;
}

const LabelShape& ActivationNumbering::shape(int64_t ordinal) const {
  MEMSCHED_CHECK(ordinal >= 0 && ordinal < count(), "ActivationNumbering.shape: ordinal ", ordinal,
                 " is not numbered in this step (", count(), " activations so far)");
  return records_[static_cast<size_t>(ordinal)].shape;
}

}  // namespace memsched
