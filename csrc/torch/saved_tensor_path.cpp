// saved_tensor_path.cpp -- see saved_tensor_path.h, Note [The saved-tensor fast path].
#include <thread>
#include "torch/saved_tensor_path.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>  // Node: node.h since torch 2.12, function.h in 2.11 (the GPU machine's)
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include "core/check.h"
#include "torch/capsule_function.h"
#include "torch/dw_runtime.h"

namespace py = pybind11;

namespace memsched {

// Whether `t` is still at `expected`; else sets PyTorch's in-place-modification error.
bool version_holds(const at::Tensor& t, uint64_t expected);

namespace {

constexpr int64_t kNoOp = std::numeric_limits<int64_t>::min();
constexpr const char* kCapsuleName = "memsched.SavedTensorPath";

SavedTensorPath* path_of(PyObject* capsule) {
  return static_cast<std::shared_ptr<SavedTensorPath>*>(PyCapsule_GetPointer(capsule, kCapsuleName))->get();
}

PyObject* pack_entry(PyObject* capsule, PyObject* tensor) { return path_of(capsule)->pack(tensor); }
PyObject* unpack_entry(PyObject* capsule, PyObject* packed) { return path_of(capsule)->unpack(packed); }

PyMethodDef pack_def{"memsched_pack", pack_entry, METH_O,
                     "memsched's saved-tensor pack hook (See Note [The saved-tensor fast path])."};
PyMethodDef unpack_def{"memsched_unpack", unpack_entry, METH_O,
                       "memsched's saved-tensor unpack hook (See Note [The saved-tensor fast path])."};

py::object make_function(PyMethodDef* def, const std::shared_ptr<SavedTensorPath>& path) {
  return capsule_function(def, kCapsuleName, new std::shared_ptr<SavedTensorPath>(path));
}

// Note [Kept saves are not Python containers]
//   A kept save is a KeptSave: a C object holding the at::Tensor (detached when it is the saving
//   op's own output), its ordinal and its version -- not a tuple holding a Python tensor. Tuples and tensors are tracked by Python's
//   cyclic GC, and allocating two of them per saved tensor made gc_collect_main the top symbol of
//   a profile of the hooks (12% of the time). A KeptSave is not GC-tracked (it refers to no
//   Python object) and the Python tensor is made only at unpack. The Python slow path packs kept
//   tensors as `(ordinal, tensor, version)` tuples; unpack() accepts both.
// Whether `t` is an output of the op saving it now: its grad_fn is the node being recorded, the
// latest this thread numbered. Such a save must not hold `t` itself (t -> grad_fn -> saved
// variable -> t is a cycle no GC sees); any other tensor is held as it is -- its grad_fn is an
// earlier node, which the saving node's edges keep alive anyway -- and unpacks to the caller's
// own Python object when it still has one (no detach, no new Python tensor).
bool saved_by_its_own_node(const at::Tensor& t) {
  const auto& fn = t.grad_fn();
  return fn && fn->sequence_nr() + 1 >= at::sequence_number::peek();
}

// Note [Keeping an output without its history]
//   An op's own output is kept as an alias without grad_fn (Note [Packing without reference
//   cycles], executor.py). tensor_data() is what PyTorch's SavedVariable stores for outputs: a
//   shallow copy of the TensorImpl sharing storage and version counter, made without a dispatcher
//   call; detach() made the same alias through the dispatcher, a third of the hooks' cost for such
//   a save. A tensor subclass (Python dispatch) still goes through detach(), which it may override.
at::Tensor without_history(const at::Tensor& t) {
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return t.detach();
  return at::Tensor(t.tensor_data());
}

struct KeptSave {
  PyObject_HEAD
  at::Tensor tensor;
  int64_t ordinal;
  uint32_t version;
};

}  // namespace

PyTypeObject saved_object_type(const char* name, Py_ssize_t basicsize, destructor dealloc, const char* doc) {
  PyTypeObject type{PyVarObject_HEAD_INIT(nullptr, 0)};
  type.tp_name = name;
  type.tp_basicsize = basicsize;
  type.tp_dealloc = dealloc;
  type.tp_flags = Py_TPFLAGS_DEFAULT;  // not Py_TPFLAGS_HAVE_GC: See Note [Kept saves are not Python containers]
  type.tp_doc = doc;
  return type;
}

namespace {

void kept_dealloc(PyObject* self) {
  reinterpret_cast<KeptSave*>(self)->tensor.~Tensor();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject kept_type = saved_object_type(
    "memsched._C.KeptSave", sizeof(KeptSave), kept_dealloc,
    "A saved tensor memsched keeps on its device (See Note [Kept saves are not Python containers]).");

PyObject* kept_save(int64_t ordinal, at::Tensor tensor, uint32_t version) {
  auto* kept = PyObject_New(KeptSave, &kept_type);
  if (kept == nullptr) return nullptr;
  new (&kept->tensor) at::Tensor(std::move(tensor));
  kept->ordinal = ordinal;
  kept->version = version;
  return reinterpret_cast<PyObject*>(kept);
}

// act:<k>:<module path>:<shape>:<dtype> -> act:<k>::<shape>:<dtype>. The shape is the last ":["
// (a module path may hold ':' but the shape and dtype hold no ":["). A label of another form is
// kept whole, so it matches nothing.
std::string without_module_path(int64_t k, const std::string& label) {
  const std::string prefix = "act:" + std::to_string(k) + ":";
  const size_t shape = label.rfind(":[");
  if (label.compare(0, prefix.size(), prefix) != 0 || shape == std::string::npos || shape + 1 < prefix.size()) {
    return label;
  }
  return prefix + label.substr(shape);
}

// The shape and dtype a trace label gives ordinal k; not concrete (compare strings) unless the label
// has the form `act:<k>:<module path>:<shape>:<dtype>` with concrete sizes.
LabelShape expected_shape(int64_t k, const std::string& label) {
  const std::string prefix = "act:" + std::to_string(k) + ":";
  if (label.compare(0, prefix.size(), prefix) != 0) return LabelShape{};
  const size_t shape = label.rfind(":[");
  if (shape == std::string::npos || shape + 1 < prefix.size()) return LabelShape{};
  return LabelShape::parse(std::string_view(label).substr(shape));
}

std::string shape_string(const at::Tensor& t) {
  std::string out = "[";
  bool first = true;
  for (const c10::SymInt& size : t.sym_sizes()) {
    if (!first) out += ", ";
    first = false;
    out += symint_string(size);
  }
  return out + "]";
}

const py::object& python_storage_key() {
  static py::object* fn = new py::object(py::module_::import("memsched.saved_tensors").attr("storage_key"));
  return *fn;
}

// See Note [Copies issued at the next op].
thread_local SavedTensorPath* t_queued_path = nullptr;  // the path whose copies wait for the next op
// An error issue_copies() raised inside the callback, which cannot raise (RecordFunction logs and drops
// what its callbacks throw): re-raised by the step's next hook call or its end.
thread_local std::unique_ptr<py::error_already_set> t_copy_error;
// Raises (as a Python error) what op_starts() caught, once.
bool raise_copy_error() {
  if (!t_copy_error) return false;
  std::unique_ptr<py::error_already_set> e = std::move(t_copy_error);
  e->restore();
  return true;
}

}  // namespace

SavedTensorPath::SavedTensorPath(at::Device device, py::object owner)
    : device_(device),
      is_cpu_(device.is_cpu()),
      owner_ref_(py::module_::import("weakref").attr("ref")(owner)) {}

py::object SavedTensorPath::pack_function() { return make_function(&pack_def, shared_from_this()); }
py::object SavedTensorPath::unpack_function() { return make_function(&unpack_def, shared_from_this()); }

py::object SavedTensorPath::owner() const { return owner_ref_(); }

template <typename... Args>
py::object SavedTensorPath::call_owner(const char* method, Args&&... args) {
  py::object executor = owner();
  MEMSCHED_CHECK(!executor.is_none(), "memsched: the offload executor of this step is gone (", method, ")");
  return executor.attr(method)(std::forward<Args>(args)...);
}

StorageIdentity SavedTensorPath::identity_of(PyObject* obj, const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.unsafeGetTensorImpl()->is_python_dispatch()) return storage_identity(tensor);
  // A tensor subclass: ask Python, exactly as memsched.saved_tensors.storage_key does.
  StorageIdentity id;
  py::object key = python_storage_key()(py::handle(obj));
  if (key.is_none()) return id;
  id.key = key.cast<uintptr_t>();
  id.nbytes = py::handle(obj).attr("untyped_storage")().attr("nbytes")().cast<int64_t>();
  try {
    id.weak = tensor.storage().getWeakStorageImpl();
  } catch (const std::exception&) {
    // no reuse guard; see StorageIdentity
  }
  return id;
}

PyObject* SavedTensorPath::pack(PyObject* obj) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "memsched pack hook: expected a torch.Tensor");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!step_active) {
    // An abandoned step or a pass-through pair: kept, and version-checked at unpack as PyTorch
    // would without hooks (Note [Version checks] in executor.py).
    return kept_pack(obj);
  }
  if (next_op_callback_ != 0 && !has_queued) disarm();
  if (raise_copy_error()) return nullptr;  // See Note [Copies issued at the next op]
  if (!is_cpu_ || !track_memory) return pack_saved(obj, t);
  tick();  // See Note [Measured from birth]
  PyObject* packed = pack_saved(obj, t);
  if (packed != nullptr && !saved_by_its_own_node(t)) mark_inputs_saved();
  return packed;
  END_HANDLE_TH_ERRORS
}

PyObject* SavedTensorPath::pack_saved(PyObject* obj, const at::Tensor& t) {
  // See Note [Copy after the op] (executor.py): queued copies go out at a later op's first save.
  if (has_queued && at::sequence_number::peek() != queued_op) issue_copies();
  if (need_poll) poll_copies();
  if (check_fetched) {
    if (PyObject* packed = pack_fetched(t)) return packed;
  }
  const StorageIdentity id = identity_of(obj, t);
  // No module path in executed steps (docs/CONVENTIONS-activation-identity.md).
  const ActivationNumbering::Result act = numbering_.number(t, id, "");
  const uint32_t version = t._version();
  if (act.ordinal < 0) {
    // A parameter or buffer: a leaf (no reference cycle), kept and version-checked.
    note_parameter_alias_saved(t);  // See Note [A parameter read after its gradient is final] (backward.py)
    return kept_save(-1, t, version);
  }
  const int64_t k = act.ordinal;
  bool may_offload = false;
  if (act.is_first_pack) {
    // A tensor without a storage counts 0 bytes and is never offloaded; the step-end count is of storages.
    activations += id.key != 0;
    activation_bytes += id.nbytes;
    if (id.nbytes > 0 && t.device() == device_ && is_cpu_ && track_memory) track_from(t, birth_of(t, k));
    if (has_schedule_ && !diverged) {
      check_label(k, id.key != 0);
      may_offload = !diverged && planned(k);
    }
    sample();
  }
  if (guard_budget_ > 0 && act.is_first_pack && need_poll) guard_memory(k);  // See Note [Memory guard]
  if (planned(k)) {
    if (k < static_cast<int64_t>(recompute_.size()) && recompute_[static_cast<size_t>(k)]) {
      return call_owner("_pack_slow", py::handle(obj), k, may_offload, id.nbytes).release().ptr();
    }
    return pack_offloaded(obj, t, k, may_offload, id.nbytes, id.key);  // See Note [Offloaded saves in C++]
  }
  // See Notes [Packing without reference cycles], [Version checks] (executor.py), and Note [Kept
  // saves are not Python containers]: only the op's own outputs need the detached alias.
  return kept_save(k, saved_by_its_own_node(t) ? without_history(t) : t, version);
}

void SavedTensorPath::poll_copies() {
  // Completions drain in order per stream in C++ (Note [Draining completions in order]).
  if (engine_ == nullptr) {  // no engine: nothing is ever in flight
    need_poll = false;
    return;
  }
  engine_->poll();
  need_poll = engine_->pending_count() > 0;
}

void SavedTensorPath::check_label(int64_t k, bool has_storage) {
  const bool known = k < static_cast<int64_t>(has_expected_.size()) && has_expected_[static_cast<size_t>(k)];
  if (known) {
    // See Note [Labels built on demand] (activation_numbering.cpp): shapes compared, no string made.
    const LabelShape& want = expected_shape_[static_cast<size_t>(k)];
    const LabelShape& got = numbering_.shape(k);
    if (want.concrete && got.concrete ? want == got : expected_[static_cast<size_t>(k)] == numbering_.label(k)) return;
  } else if (!has_storage) {
    return;
  }
  py::object expected = known ? py::object(py::str(expected_full_[static_cast<size_t>(k)])) : py::object(py::none());
  call_owner("_diverge_label", k, expected, py::str(numbering_.label(k)));
  diverged = true;
}

PyObject* SavedTensorPath::unpack(PyObject* packed) {
  HANDLE_TH_ERRORS
  if (!backward_open_->load(std::memory_order_relaxed)) open_backward();  // Note [A step whose backward raised]
  if (THPVariable_Check(packed)) return Py_NewRef(packed);
  if (raise_copy_error()) return nullptr;  // See Note [Copies issued at the next op]
  if (has_queued) issue_copies();
  if (need_poll) poll_copies();
  int64_t k = -1;
  uint64_t expected = 0;
  const at::Tensor* t = nullptr;
  PyObject* obj = nullptr;  // the Python tensor to return, when the save holds one
  if (Py_IS_TYPE(packed, &kept_type)) {
    auto* kept = reinterpret_cast<KeptSave*>(packed);
    if (kept->ordinal < 0) return kept_unpack(packed);
    k = kept->ordinal;
    expected = kept->version;
    t = &kept->tensor;
  } else if (PyTuple_CheckExact(packed) && PyTuple_GET_SIZE(packed) == 3) {
    obj = PyTuple_GET_ITEM(packed, 1);
    k = PyLong_AsLongLong(PyTuple_GET_ITEM(packed, 0));
    expected = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(packed, 2));
    if (PyErr_Occurred() || !THPVariable_Check(obj)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "memsched unpack hook: not a memsched-packed tensor");
      return nullptr;
    }
    t = &THPVariable_Unpack(obj);
  } else if (is_offloaded_save(packed)) {
    return unpack_offloaded(packed);  // See Note [Offloaded saves in C++]
  } else {
    return PyObject_CallMethod(packed, "unpack", nullptr);  // a recomputed save (recompute.py)
  }
  if (!version_holds(*t, expected)) return nullptr;
  if (k >= 0) observe(k);
  return obj != nullptr ? Py_NewRef(obj) : THPVariable_Wrap(*t);
  END_HANDLE_TH_ERRORS
}

std::string version_error_tail(bool parameter_itself, bool without_grad) {
  std::string tail =
      " (memsched checks this itself because saved-tensor hooks turn PyTorch's own check off; plain PyTorch "
      "raises the same error";
  if (parameter_itself) {
    return tail + ", unless a fused optimizer update (fuse_optimizer=True) stepped this parameter in an earlier "
                  "backward pass over the same graph: a second backward pass over a retained graph is not "
                  "supported there.)";
  }
  if (without_grad && fused_update_installed()) {
    // See Note [A parameter read after its gradient is final] (backward.py): what the hold misses.
    return tail + ", unless this tensor is a parameter read through an alias that carries no gradient to it "
                  "(weight.detach()) and the fused optimizer update (fuse_optimizer=True) had already stepped "
                  "that parameter in this backward pass, its gradient being final: plain PyTorch steps after "
                  "backward. memsched.optimize(..., fuse_optimizer=True) holds such a parameter's update to the "
                  "end of backward when its own hooks see the save; OutOfOrderBackward alone does not. Use "
                  "memsched.optimize, or fuse_optimizer=False.)";
  }
  return tail + ".)";
}

bool version_holds(const at::Tensor& t, uint64_t expected) {
  const uint32_t version = t._version();
  if (version == expected) return true;
  // See Note [Version checks] (executor.py): the error plain PyTorch raises.
  const std::string message =
      "one of the variables needed for gradient computation has been modified by an inplace operation: "
      "a saved tensor of shape " + shape_string(t) + " is at version " + std::to_string(version) +
      "; expected version " + std::to_string(expected) + " instead." +
      version_error_tail(t.is_leaf() && t.requires_grad(), !t.requires_grad());
  PyErr_SetString(PyExc_RuntimeError, message.c_str());
  return false;
}

PyObject* kept_pack(PyObject* obj) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "memsched pack hook: expected a torch.Tensor");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  note_parameter_alias_saved(t);  // See Note [A parameter read after its gradient is final] (backward.py)
  return kept_save(-1, saved_by_its_own_node(t) ? without_history(t) : t, t._version());
  END_HANDLE_TH_ERRORS
}

PyObject* kept_alias(int64_t ordinal, const at::Tensor& t) {
  return kept_save(ordinal, saved_by_its_own_node(t) ? without_history(t) : t, t._version());
}

PyObject* kept_unpack(PyObject* packed) {
  HANDLE_TH_ERRORS
  if (THPVariable_Check(packed)) return Py_NewRef(packed);
  if (!Py_IS_TYPE(packed, &kept_type)) {
    PyErr_SetString(PyExc_TypeError, "memsched unpack hook: not a memsched-packed tensor");
    return nullptr;
  }
  auto* kept = reinterpret_cast<KeptSave*>(packed);
  if (!version_holds(kept->tensor, kept->version)) return nullptr;
  return THPVariable_Wrap(kept->tensor);
  END_HANDLE_TH_ERRORS
}

void prepare_kept_type(py::module_& m) {
  if (PyType_Ready(&kept_type) < 0) throw py::error_already_set();
  Py_INCREF(&kept_type);
  m.attr("KeptSave") = py::handle(reinterpret_cast<PyObject*>(&kept_type));
}

// Note [Copies issued at the next op]
//   Rationale: a pack only queues its D2H copy (Note [Copy after the op] in executor.py: the op may
//   still write what it saved), and the copy -- and with it the release of an offloaded storage --
//   went out at the first save of a later op. An op that saves only its output (ReLU saves its
//   result) saves after its kernel, so the storage was still alive when that op allocated its
//   output, and one that saves nothing (an in-place add on a buffer) delayed it further: the plan
//   releases it once its op has run, and the measured peak was 12% over the plan's (small CNN at
//   its least budget).
//   Approach: while copies are queued, a thread-local RecordFunction start callback (ATen's own
//   per-op observer, in C++) watches for the next op entered at the autograd level (seqNr >= 0; ops
//   inside a kernel run below autograd and have none): the saving op has returned by then, so the
//   queued copies are issued there, before the next op allocates. The callback exists only while
//   copies are queued -- between an offloaded tensor's save and the next op -- so other ops pay
//   nothing; it is removed at the next pack or step boundary, never from inside itself. An error
//   the copies raise there (RecordFunction drops what its callbacks throw) is kept and raised by
//   the step's next save, unpack or end.
//   The callback is the step thread's, armed and removed there only (callback_thread_): a save packed
//   on another thread -- the autograd engine's device thread on a GPU, for a save made during
//   backward (a reentrant checkpoint's recompute, create_graph) -- queues its copy without arming
//   one, and leaves the step thread's alone. (Removing it from there warned "Requested callback is
//   not found" and leaked it on the step thread, one more a step; one armed there would have
//   outlived the executor on a thread no step boundary runs on.)
//   Limitations: factory ops with no tensor argument (empty, arange) enter below autograd and do
//   not count as the next op; the first later op that does (or a save, the end of the forward, the
//   first unpack, as before) issues the copies, as for a queue made on another thread.
namespace {


std::unique_ptr<at::ObserverContext> next_op_starts(const at::RecordFunction& fn) {
  if (fn.seqNr() >= 0 && t_queued_path != nullptr) t_queued_path->op_starts();
  return nullptr;
}

}  // namespace

void SavedTensorPath::set_has_queued(bool queued) {
  has_queued = queued;
  if (!queued) {
    if (t_queued_path == this) t_queued_path = nullptr;
    return;
  }
  if (std::this_thread::get_id() != callback_thread_) return;  // See Note [Copies issued at the next op]
  t_queued_path = this;
  if (next_op_callback_ == 0) {
    next_op_callback_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&next_op_starts).needsInputs(false).scopes({at::RecordScope::FUNCTION}));
  }
}

void SavedTensorPath::op_starts() {
  if (!has_queued || !step_active) return;
  py::gil_scoped_acquire gil;
  try {
    issue_copies();
  } catch (const std::exception& e) {
    if (!t_copy_error) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      t_copy_error = std::make_unique<py::error_already_set>();
    }
  }
}


void SavedTensorPath::disarm() {
  if (std::this_thread::get_id() != callback_thread_) return;  // not the thread that armed it
  if (next_op_callback_ != 0) at::removeCallback(next_op_callback_);
  next_op_callback_ = 0;
  if (t_queued_path == this) t_queued_path = nullptr;
}

void SavedTensorPath::begin_step(double t0_s) {
  disarm();
  if (next_op_callback_ == 0) callback_thread_ = std::this_thread::get_id();  // the step's thread
  reset_offloads();
  numbering_.start_step();
  diverged = false;
  check_fetched = false;
  need_poll = false;
  has_queued = false;
  fired_upto = -2;
  backward_open_->store(false, std::memory_order_release);
  activations = 0;
  activation_bytes = 0;
  peak_bytes = 0;
  samples.clear();
  drop_tracked();
  t0_s_ = t0_s;
  seq_base_ = at::sequence_number::peek();
  ++generation_;
}

void SavedTensorPath::set_schedule(const py::dict& labels, const py::iterable& planned,
                                   const py::dict& first_bwd_op, const py::iterable& triggers,
                                   const py::iterable& before_step) {
  clear_schedule();
  auto grow = [](auto& v, int64_t k, auto fill) {
    MEMSCHED_CHECK(k >= 0 && k < (int64_t{1} << 40), "SavedTensorPath.set_schedule: ordinal ", k, " out of range");
    if (static_cast<int64_t>(v.size()) <= k) v.resize(static_cast<size_t>(k) + 1, fill);
  };
  for (auto item : labels) {
    const int64_t k = item.first.cast<int64_t>();
    grow(expected_, k, std::string());
    grow(expected_shape_, k, LabelShape{});
    grow(expected_full_, k, std::string());
    grow(has_expected_, k, char{0});
    const std::string label = item.second.cast<std::string>();
    expected_full_[static_cast<size_t>(k)] = label;
    expected_[static_cast<size_t>(k)] = without_module_path(k, label);
    expected_shape_[static_cast<size_t>(k)] = expected_shape(k, label);
    has_expected_[static_cast<size_t>(k)] = 1;
  }
  for (auto item : planned) {
    const int64_t k = item.cast<int64_t>();
    grow(planned_, k, char{0});
    planned_[static_cast<size_t>(k)] = 1;
  }
  for (auto item : first_bwd_op) {
    const int64_t k = item.first.cast<int64_t>();
    grow(first_bwd_op_, k, kNoOp);
    first_bwd_op_[static_cast<size_t>(k)] = item.second.cast<int64_t>();
  }
  for (auto item : triggers) triggers_.push_back(item.cast<int64_t>());
  for (auto item : before_step) {
    const int64_t k = item.cast<int64_t>();
    grow(before_step_, k, char{0});
    before_step_[static_cast<size_t>(k)] = 1;
  }
  std::sort(triggers_.begin(), triggers_.end());
  has_schedule_ = true;
}

void SavedTensorPath::clear_schedule() {
  has_schedule_ = false;
  expected_.clear();
  expected_shape_.clear();
  expected_full_.clear();
  has_expected_.clear();
  planned_.clear();
  first_bwd_op_.clear();
  before_step_.clear();
  triggers_.clear();
  trigger_nodes_.clear();
  recompute_.clear();
  prefetch_at_.clear();
}

void SavedTensorPath::observe(int64_t k) {
  if (!has_schedule_ || diverged || k < 0 || k >= static_cast<int64_t>(first_bwd_op_.size())) return;
  const int64_t op = first_bwd_op_[static_cast<size_t>(k)];
  if (op == kNoOp || op <= fired_upto) return;
  // Python only when a trigger with prefetches lies in (fired_upto, op].
  auto next = std::upper_bound(triggers_.begin(), triggers_.end(), fired_upto);
  if (next != triggers_.end() && *next <= op) fire(op, fired_upto);
  fired_upto = op;
}

void SavedTensorPath::open_backward() {
  // See Note [A step whose backward raised] (offload/executor.py): one callback per backward pass.
  if (torch::autograd::get_current_graph_task_id() == -1) return;  // an unpack outside the engine
  backward_open_->store(true, std::memory_order_release);
  std::shared_ptr<std::atomic<bool>> open = backward_open_;
  torch::autograd::Engine::get_default_engine().queue_callback(
      [open] { open->store(false, std::memory_order_release); });
}

// Note [Backward node triggers]
//   Rationale: the plan issues a prefetch when the compute stream reaches backward op p; unpacks
//   alone show the executor only the ops that first read a saved tensor, so it used to fire at
//   the latest such op before p -- early, holding the fetched copy while tensors the plan had
//   already freed were still alive.
//   Approach: the profiler records, for every backward op, the sequence number of the autograd
//   node running it, as an offset from this thread's sequence number at the step's first forward
//   (nodes are numbered in creation order, so a step that matches its trace numbers its nodes
//   alike). The schedule turns a prefetch at op p into a trigger at the first op of p's node. At
//   the end of each forward the executor walks the new graph from the forward's outputs (C++,
//   not descending into nodes older than the step) and adds a pre-hook to each trigger node;
//   the hook fires every trigger up to its op when the engine starts that node. Unpacks still
//   fire triggers too, so a node the walk cannot reach (created outside the model's forward)
//   costs an early prefetch, as before, never a late one.
namespace {

struct TriggerHook : torch::autograd::FunctionPreHook {
  TriggerHook(std::weak_ptr<SavedTensorPath> path, uint64_t generation, int64_t op)
      : path_(std::move(path)), generation_(generation), op_(op) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto path = path_.lock()) {
      py::gil_scoped_acquire gil;
      path->fire_at(op_, generation_);
    }
    return grads;
  }
  std::weak_ptr<SavedTensorPath> path_;
  uint64_t generation_;
  int64_t op_;
};

}  // namespace

void SavedTensorPath::set_trigger_nodes(const py::dict& node_to_op) {
  trigger_nodes_.clear();
  for (auto item : node_to_op) {
    trigger_nodes_[item.first.cast<uint64_t>()] = item.second.cast<int64_t>();
  }
}

int64_t SavedTensorPath::hook_nodes(const std::vector<at::Tensor>& roots) {
  if (trigger_nodes_.empty() || !has_schedule_) return 0;
  std::vector<torch::autograd::Node*> todo;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const at::Tensor& root : roots) {
    if (root.defined() && root.grad_fn()) todo.push_back(root.grad_fn().get());
  }
  int64_t hooked = 0;
  const std::weak_ptr<SavedTensorPath> self = weak_from_this();
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    const uint64_t seq = node->sequence_nr();
    if (seq < seq_base_ || seq == std::numeric_limits<uint64_t>::max()) continue;  // older than the step
    if (auto hit = trigger_nodes_.find(seq - seq_base_); hit != trigger_nodes_.end()) {
      node->add_pre_hook(std::make_unique<TriggerHook>(self, generation_, hit->second));
      ++hooked;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function) todo.push_back(edge.function.get());
    }
  }
  return hooked;
}

void SavedTensorPath::fire_at(int64_t op, uint64_t generation) {
  if (generation != generation_ || !has_schedule_ || diverged || op <= fired_upto) return;
  fire(op, fired_upto);
  fired_upto = op;
}

// Note [CPU memory by weak references]
//   On CPU the executor measures memory as the bytes of saved-activation storages alive (CUDA reads
//   the allocator; the GPU path never tracks). A tracked storage gets a Python weak reference
//   whose callback records its death: torch keeps a storage's Python object exactly as long as
//   its StorageImpl (Note [Free detection] in profiler/recorder.py), so the count is exact and
//   costs O(1) per storage -- a scan of C++ weak pointers at each sample was O(n^2) per step. The
//   callback holds a raw pointer to this object: every weak reference is owned by `tracked_` and
//   dropped (which cancels its callback) by begin_step() and the destructor.
//
// Note [Measured from birth]
//   Rationale: a storage becomes known as an activation at its first save, which may come ops after
//   it was made: GELU's output is first saved by the next Linear, and by then GELU's input (saved,
//   offloaded) may be gone. Counting from the first save and sampling only at hook calls never saw
//   the two alive together, though they are (the GELU kernel writes one while reading the other),
//   and the measured peak fell 11% under the plan's on the small transformer. Memory is what is
//   alive, not what a hook happens to see.
//   Approach: a step clock ticks at each event the executor sees (each pack, each tracked birth or
//   death). Each tracked storage keeps a lifetime [born, died) on that clock, and the peak is a
//   sweep over all lifetimes at the step's end (finish_step(): O(n log n) per step, no work per
//   op). A storage's birth is read from autograd at its first save: the node that made it (a
//   view's base's grad_fn) has a sequence number s; the forward's nodes are made in that order, and
//   a node's inputs are saved before its kernel allocates the outputs. So the storage was born after
//   node s's input saves (and whatever they released) and before anything that happened later; each
//   new at::sequence_number::peek() value seen at an event gets a NodeMark with the clock of its
//   first moment and of the end of its input saves, and the birth is the latter (else the former)
//   of the mark for s + 1, or of the first later mark. A storage of no node (a leaf, a result of
//   no_grad or of an op without a derivative) counts from its first save, except where the matched
//   trace record says the profiled step found it existing already (the caller's batch: targets
//   first saved by the loss, at the end of the forward): from the step's start, which is when it
//   is alive -- the one birth autograd cannot tell. One whose node was made before the step counts
//   from the step's start too.
//   An in-place op gives a storage a later grad_fn (relu_ on BatchNorm's output), whose first edge
//   leads to the grad_fn before it: the birth walks back one node per version of the storage, so a
//   ResNet block's BatchNorm output counts from the BatchNorm, not from the relu_ two ops later
//   (the measured peak had read 19% under the real one; found by a helper).
//   Limitations: a version bumped without a new node (a write under no_grad) walks one node too far
//   back: the storage counts from the op before its producer (over, never under). Node marks assume
//   the forward runs on the step's thread (saved-tensor hooks are thread-local anyway).
namespace {

PyObject* storage_died(PyObject* capsule, PyObject* ref) {
  auto* path = static_cast<SavedTensorPath*>(PyCapsule_GetPointer(capsule, "memsched.SavedTensorPath.raw"));
  if (path != nullptr) path->forget(ref);
  Py_RETURN_NONE;
}

PyMethodDef storage_died_def{"memsched_storage_died", storage_died, METH_O,
                             "A tracked storage died (See Note [CPU memory by weak references])."};

}  // namespace

int64_t SavedTensorPath::tick() {
  const uint64_t peek = at::sequence_number::peek();
  if (marks_.empty() || peek > marks_.back().peek) marks_.push_back({peek, clock_++, -1});
  return clock_++;
}

void SavedTensorPath::mark_inputs_saved() {
  if (!marks_.empty() && marks_.back().peek == at::sequence_number::peek()) marks_.back().after_inputs = clock_++;
}

int64_t SavedTensorPath::birth_of(const at::Tensor& t, int64_t k) {
  const at::TensorBase& base = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
  const auto& fn = base.grad_fn();
  if (!fn) {
    const bool before = has_schedule_ && !diverged && k < static_cast<int64_t>(before_step_.size()) &&
                        before_step_[static_cast<size_t>(k)];
    return before ? 0 : tick();
  }
  uint64_t s = fn->sequence_nr();
  // Written in place since (BatchNorm's output, `out += identity`, relu_): each in-place op with grad rebased
  // its history on a node whose first edge is the one before; walk back at most one node per version.
  const torch::autograd::Node* node = fn.get();
  for (uint32_t v = base._version(); v > 0 && node->num_inputs() > 0 && node->next_edges().size() > 0; --v) {
    const torch::autograd::Edge& edge = node->next_edge(0);
    if (!edge.is_valid() || edge.function->sequence_nr() >= s || edge.function->sequence_nr() < seq_base_) break;
    node = edge.function.get();
    s = node->sequence_nr();
  }
  if (s < seq_base_) return 0;  // made before the step began
  auto it = std::lower_bound(marks_.begin(), marks_.end(), s + 1,
                             [](const NodeMark& m, uint64_t peek) { return m.peek < peek; });
  if (it == marks_.end()) return tick();
  return it->peek == s + 1 && it->after_inputs >= 0 ? it->after_inputs : it->first;
}

void SavedTensorPath::track(const at::Tensor& t) {
  if (is_cpu_ && track_memory) track_from(t, tick());
}

void SavedTensorPath::track_from(const at::Tensor& t, int64_t born) {
  if (!is_cpu_ || !track_memory || !t.has_storage()) return;
  if (death_callback_.is_none()) {
    PyObject* capsule = PyCapsule_New(this, "memsched.SavedTensorPath.raw", nullptr);
    if (capsule == nullptr) throw py::error_already_set();
    PyObject* fn = PyCFunction_New(&storage_died_def, capsule);
    Py_DECREF(capsule);
    if (fn == nullptr) throw py::error_already_set();
    death_callback_ = py::reinterpret_steal<py::object>(fn);
  }
  const c10::Storage& storage = t.storage();
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  py::object obj = py::reinterpret_steal<py::object>(THPStorage_Wrap(storage));
  if (!obj) throw py::error_already_set();
  PyObject* ref = PyWeakref_NewRef(obj.ptr(), death_callback_.ptr());
  if (ref == nullptr) throw py::error_already_set();
  tracked_.emplace(ref, lifetimes_.size());
  lifetimes_.push_back({born, kAliveClock, nbytes});
  tracked_bytes_ += nbytes;
}

void SavedTensorPath::forget(PyObject* ref) {
  auto it = tracked_.find(ref);
  if (it == tracked_.end()) return;
  Lifetime& life = lifetimes_[it->second];
  life.died = tick();
  tracked_bytes_ -= life.bytes;
  tracked_.erase(it);
  Py_DECREF(ref);
}

void SavedTensorPath::drop_tracked() {
  // Dropping a weak reference cancels its callback.
  for (auto& entry : tracked_) Py_DECREF(entry.first);
  tracked_.clear();
  tracked_bytes_ = 0;
  lifetimes_.clear();
  marks_.clear();
  sample_clocks_.clear();
  clock_ = 0;
}

SavedTensorPath::~SavedTensorPath() {
  disarm();  // a thread-local callback: Run exit drops the executor on the step's thread
  if (!tracked_.empty() && Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    drop_tracked();
  }
}

int64_t SavedTensorPath::alive_bytes() { return tracked_bytes_; }

void SavedTensorPath::sample() {
  const bool clocked = is_cpu_ && track_memory;
  if (!timeline) {
    if (!clocked) peak_bytes = std::max(peak_bytes, tracked_bytes_);
    return;
  }
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const int64_t value = is_cpu_ ? alive_bytes() : call_owner("_memory_allocated").cast<int64_t>();
  samples.emplace_back(now - t0_s_, value);
  if (clocked) sample_clocks_.push_back(tick());
  peak_bytes = std::max(peak_bytes, value);
}

void SavedTensorPath::finish_step() {
  if (!has_queued) disarm();  // the step's copies are out: no op after it pays for the callback
  if (raise_copy_error()) throw py::error_already_set();
  if (!is_cpu_ || !track_memory) return;
  // See Note [Measured from birth]: deaths at a clock come before births at it (key 2c vs 2c + 1).
  std::vector<std::pair<int64_t, int64_t>> events;  // (key, +/- bytes)
  events.reserve(2 * lifetimes_.size());
  for (const Lifetime& life : lifetimes_) {
    events.emplace_back(2 * life.born + 1, life.bytes);
    if (life.died != kAliveClock) events.emplace_back(2 * life.died, -life.bytes);
  }
  std::sort(events.begin(), events.end());
  int64_t alive = 0;
  int64_t peak = 0;
  size_t next_sample = 0;  // sample clocks ascend
  for (size_t e = 0; e <= events.size(); ++e) {
    const int64_t key = e < events.size() ? events[e].first : std::numeric_limits<int64_t>::max();
    while (next_sample < std::min(sample_clocks_.size(), samples.size()) && 2 * sample_clocks_[next_sample] + 1 < key) {
      samples[next_sample].second = alive;  // a sample sees births at its own clock: none (ticks are unique)
      ++next_sample;
    }
    if (e == events.size()) break;
    alive += events[e].second;
    peak = std::max(peak, alive);
  }
  peak_bytes = peak;
}

}  // namespace memsched
