// layer_fast_path.cpp -- see layer_fast_path.h, Note [Fast path of a patched layer call].
#include "torch/layer_fast_path.h"

#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "core/check.h"
#include "torch/capsule_function.h"
#include "torch/deferred_layers.h"

namespace py = pybind11;

namespace memsched {

namespace {

constexpr const char* kLinearCapsule = "memsched.LinearFastPath";
constexpr const char* kConvCapsule = "memsched.ConvFastPath";
constexpr const char* kUseHookCapsule = "memsched.AutogradUseHook";
constexpr long kDeferred = 1;  // backward.py's _DEFERRED

struct LayerTarget {
  std::weak_ptr<DwRuntime> rt;
  int32_t weight_idx;  // >= 0: only layers whose weight was trainable at install get a fast path
  int32_t bias_idx;    // -1: no bias, or a bias frozen at install
  int64_t nd;          // conv: spatial dimensions (1, 2, 3); 0: Linear
};

struct UseHookTarget {
  std::weak_ptr<DwRuntime> rt;
  std::vector<int32_t> params;
};

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw python_error();
  return o;  // immortal for our purposes: held by the static that caches it
}

// The kind the owner's dict gives parameter i this iteration: 0 unset, else its value; -1 on error.
long kind_of(PyObject* kinds, int32_t i) {
  PyObject* key = PyLong_FromLong(i);
  if (key == nullptr) return -1;
  PyObject* v = PyDict_GetItemWithError(kinds, key);  // borrowed
  Py_DECREF(key);
  if (v == nullptr) return PyErr_Occurred() ? -1 : 0;
  return PyLong_AsLong(v);
}

bool set_default_deferred(PyObject* kinds, int32_t i) {
  PyObject* key = PyLong_FromLong(i);
  PyObject* value = PyLong_FromLong(kDeferred);
  PyObject* r = key != nullptr && value != nullptr ? PyDict_SetDefault(kinds, key, value) : nullptr;
  Py_XDECREF(key);
  Py_XDECREF(value);
  return r != nullptr;  // borrowed
}

// The registered parameter `idx` if `obj` is still it and requires grad (the Python path's
// `w_idx if mod.weight.requires_grad`), else nullptr.
const at::Tensor* same_trainable(PyObject* obj, const DwRuntime& rt, int32_t idx) {
  if (obj == nullptr || !THPVariable_Check(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.unsafeGetTensorImpl() != rt.param(idx).unsafeGetTensorImpl() || !t.requires_grad()) return nullptr;
  return &t;
}

void refuse_late_use(const DwRuntime& rt, int32_t late) {
  py::object owner = rt.owner();
  if (owner.is_none()) return;
  owner.attr("_refuse_late_use")(late);  // raises
}

// The module's parameters if they are the registered ones with their install-time requires_grad and
// no caller's hook, and x is a tensor; else false (NotImplemented). Sets *w (borrowed from the module),
// *bias and *cast (autocast is on for x's device: Note [Deferred calls under autocast] in backward.py).
bool common_checks(const LayerTarget& target, const DwRuntime& rt, PyObject* module, const at::Tensor& x,
                   const at::Tensor** w, std::optional<at::Tensor>* bias, bool* cast) {
  static PyObject* s_parameters = interned("_parameters");
  static PyObject* s_weight = interned("weight");
  static PyObject* s_bias = interned("bias");
  py::object params = py::reinterpret_steal<py::object>(PyObject_GetAttr(module, s_parameters));
  if (!params) throw python_error();
  if (!PyDict_Check(params.ptr())) return false;
  PyObject* wo = PyDict_GetItemWithError(params.ptr(), s_weight);  // borrowed
  PyObject* bo = wo != nullptr ? PyDict_GetItemWithError(params.ptr(), s_bias) : nullptr;
  if (PyErr_Occurred()) throw python_error();
  *w = same_trainable(wo, rt, target.weight_idx);
  if (*w == nullptr || rt.user_hooked(target.weight_idx)) return false;
  // See Note [Layer calls out-of-order backward leaves to autograd] (backward.py): no __torch_function__
  // override (a Tensor or a Parameter, exactly) nor mode, nothing complex
  if (!THPVariable_CheckExact(wo) || (bo != nullptr && bo != Py_None && !THPVariable_CheckExact(bo)) ||
      at::impl::torch_function_mode_enabled() || x.is_complex() || (*w)->is_complex()) {
    return false;
  }
  // ... no torch.func transform, no forward-mode tangent (_forward_mode in backward.py)
  if (at::functorch::maybeCurrentDynamicLayer().has_value() || x._fw_grad(/*level=*/0).defined()) return false;
  if (target.bias_idx >= 0) {
    const at::Tensor* b = same_trainable(bo, rt, target.bias_idx);
    if (b == nullptr || rt.user_hooked(target.bias_idx)) return false;
    *bias = *b;
  } else if (bo != nullptr && bo != Py_None) {
    if (!THPVariable_Check(bo)) return false;
    *bias = THPVariable_Unpack(bo);
    if ((*bias)->requires_grad()) return false;  // unfrozen since install: the Python path refuses it
  }
  *cast = at::autocast::is_autocast_enabled(x.device().type());
  return true;
}

// Both parameters' kind this iteration is unset or deferred (See Note [One kind of use per parameter
// and iteration] in backward.py): set them to deferred and count the use (what _deferred_indices does
// for such a call); false: leave the call to Python.
bool take_as_deferred(const LayerTarget& target, DwRuntime& rt, PyObject* kinds) {
  const long kw = kind_of(kinds, target.weight_idx);
  const long kb = target.bias_idx >= 0 ? kind_of(kinds, target.bias_idx) : 0;
  if (kw < 0 || kb < 0) {
    if (PyErr_Occurred()) throw python_error();
    return false;
  }
  if ((kw != 0 && kw != kDeferred) || (kb != 0 && kb != kDeferred)) return false;
  if (!set_default_deferred(kinds, target.weight_idx)) throw python_error();
  if (target.bias_idx >= 0 && !set_default_deferred(kinds, target.bias_idx)) throw python_error();
  const int32_t late = rt.note_deferred_use(target.weight_idx, target.bias_idx);
  if (late >= 0) {
    refuse_late_use(rt, late);  // raises (py::error_already_set), unless the owner is gone
    return false;
  }
  return true;
}

constexpr long kDeferredCast = 3;  // backward.py's _DEFERRED_CAST

// The autocast state admits deferring this call in autocast's dtype: every trained parameter of it is
// eligible (its every use last iteration was a deferrable call of one autocast region) and its kind this
// iteration unset or deferred-in-autocast (the first half of _cast_indices' success case).
bool cast_eligible(const LayerTarget& target, const DwRuntime& rt) {
  PyObject* kinds = rt.kind_dict().ptr();
  PyObject* eligible = rt.cast_eligible_set().ptr();
  if (eligible == nullptr || rt.cast_region_dict().ptr() == nullptr || PySet_GET_SIZE(eligible) == 0) return false;
  for (int32_t i : {target.weight_idx, target.bias_idx}) {
    if (i < 0) continue;
    PyObject* key = PyLong_FromLong(i);
    if (key == nullptr) throw python_error();
    const int in = PySet_Contains(eligible, key);
    Py_DECREF(key);
    if (in < 0) throw python_error();
    const long k = kind_of(kinds, i);
    if (k < 0) throw python_error();
    if (in == 0 || (k != 0 && k != kDeferredCast)) return false;
  }
  return true;
}

// The second half of _cast_indices' success case, for a call the deferred Function takes as it is:
// every trained parameter's autocast region this iteration is unset or `region` (the weight's cached cast,
// which tells regions apart); then the regions are noted, the kinds set to deferred-in-autocast and the
// use counted. false: nothing was changed, and Python decides (it marks the parameters mixed).
bool take_as_cast_deferred(const LayerTarget& target, DwRuntime& rt, PyObject* region) {
  PyObject* regions = rt.cast_region_dict().ptr();
  PyObject* mixed = rt.cast_mixed().ptr();
  const int32_t ids[2] = {target.weight_idx, target.bias_idx};
  py::object keys[2];
  bool unset[2] = {false, false};
  for (int k = 0; k < 2; ++k) {
    if (ids[k] < 0) continue;
    keys[k] = py::reinterpret_steal<py::object>(PyLong_FromLong(ids[k]));
    if (!keys[k]) throw python_error();
    PyObject* r = PyDict_GetItemWithError(regions, keys[k].ptr());  // borrowed
    if (r == nullptr) {
      if (PyErr_Occurred()) throw python_error();
      unset[k] = true;
      continue;
    }
    if (r == mixed || !PyWeakref_CheckRef(r) || PyWeakref_GetObject(r) != region) return false;
  }
  py::object ref;
  for (int k = 0; k < 2; ++k) {
    if (!unset[k]) continue;
    if (!ref) {
      ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(region, nullptr));
      if (!ref) throw python_error();
    }
    if (PyDict_SetItem(regions, keys[k].ptr(), ref.ptr()) != 0) throw python_error();
  }
  py::object value = py::reinterpret_steal<py::object>(PyLong_FromLong(kDeferredCast));
  if (!value) throw python_error();
  PyObject* kinds = rt.kind_dict().ptr();
  for (int k = 0; k < 2; ++k) {
    if (ids[k] >= 0 && PyDict_SetItem(kinds, keys[k].ptr(), value.ptr()) != 0) throw python_error();
  }
  const int32_t late = rt.note_deferred_use(target.weight_idx, target.bias_idx);
  if (late >= 0) {
    refuse_late_use(rt, late);  // raises (py::error_already_set), unless the owner is gone
    return false;
  }
  return true;
}

// The runtime when the fast path may run at all: grad mode on, the iteration's forward phase (its
// first call goes to Python, which begins it), no queueing executor, no autocast use of a deferred
// parameter this iteration.
std::shared_ptr<DwRuntime> live_runtime(const LayerTarget& target) {
  if (!at::GradMode::is_enabled()) return nullptr;
  std::shared_ptr<DwRuntime> rt = target.rt.lock();
  if (rt == nullptr || !rt->installed || !rt->fast_calls || rt->phase != 1) return nullptr;
  PyObject* kinds = rt->kind_dict().ptr();
  PyObject* cast_uses = rt->cast_uses_dict().ptr();
  if (kinds == nullptr || cast_uses == nullptr || PyDict_GET_SIZE(cast_uses) != 0) return nullptr;
  return rt;
}

bool int_tuple(PyObject* seq, std::vector<int64_t>* out) {
  if (!PyTuple_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return false;
    (*out)[static_cast<size_t>(i)] = PyLong_AsLongLong(items[i]);
  }
  return !PyErr_Occurred();
}

// One call of fast(module, x): what both layer kinds check first (See common_checks()).
struct LayerCall {
  const LayerTarget* target = nullptr;
  std::shared_ptr<DwRuntime> rt;
  const at::Tensor* x = nullptr;  // the input, or x_cast under autocast
  const at::Tensor* w = nullptr;  // the module's weight (borrowed), or w_cast under autocast
  std::optional<at::Tensor> bias;  // cast under autocast
  bool cast = false;               // under autocast: x, w and bias are autocast's casts of the call's
  at::Tensor x_cast, w_cast;
  py::object region;               // under autocast: w_cast's Python object, which tells regions apart
};

// Under autocast: the call's arguments as autocast's own wrapper of linear/conv casts them (_cast_args in
// backward.py), when the deferred path reproduces that and the autocast state admits the call
// (cast_eligible); false leaves it to Python.
bool cast_arguments(LayerCall* call) {
  const c10::DeviceType device_type = call->x->device().type();
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  if (!at::autocast::is_autocast_cache_enabled() || (dtype != at::kHalf && dtype != at::kBFloat16) ||
      call->w->scalar_type() != at::kFloat || (call->bias && call->bias->scalar_type() != at::kFloat) ||
      (call->x->scalar_type() != at::kFloat && call->x->scalar_type() != dtype) ||
      !cast_eligible(*call->target, *call->rt)) {
    return false;
  }
  call->x_cast = autocast_cast(*call->x, device_type);
  call->w_cast = autocast_cast(*call->w, device_type);
  if (call->bias) call->bias = autocast_cast(*call->bias, device_type);
  call->x = &call->x_cast;
  call->w = &call->w_cast;
  call->region = py::reinterpret_steal<py::object>(THPVariable_Wrap(call->w_cast));
  if (!call->region) throw python_error();
  return true;
}

// False: NotImplemented (or a Python error set, when PyErr_Occurred()).
bool begin_call(PyObject* capsule, const char* name, PyObject* const* args, Py_ssize_t nargs, LayerCall* call) {
  call->target = static_cast<LayerTarget*>(PyCapsule_GetPointer(capsule, name));
  if (call->target == nullptr || nargs != 2 || !THPVariable_CheckExact(args[1])) return false;
  call->rt = live_runtime(*call->target);
  if (call->rt == nullptr) return false;
  call->x = &THPVariable_Unpack(args[1]);
  if (!common_checks(*call->target, *call->rt, args[0], *call->x, &call->w, &call->bias, &call->cast)) return false;
  return !call->cast || cast_arguments(call);
}

// The kinds and use count of a call the deferred Function takes as it is (See take_as_deferred(),
// take_as_cast_deferred()).
bool take_call(const LayerCall& call) {
  if (call.cast) return take_as_cast_deferred(*call.target, *call.rt, call.region.ptr());
  return take_as_deferred(*call.target, *call.rt, call.rt->kind_dict().ptr());
}

// fast(module, x) of either layer kind: `take(call, module)` applies the deferred Function, or returns
// nullptr (no error set) to leave the call to Python.
template <typename Take>
PyObject* layer_entry(PyObject* capsule, const char* name, PyObject* const* args, Py_ssize_t nargs, Take take) {
  HANDLE_TH_ERRORS
  LayerCall call;
  if (begin_call(capsule, name, args, nargs, &call)) {
    if (PyObject* out = take(call, args[0])) return out;
  }
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NOTIMPLEMENTED;
  END_HANDLE_TH_ERRORS
}

PyObject* take_linear(const LayerCall& call, PyObject* /*module*/) {
  const LayerTarget* target = call.target;
  const std::shared_ptr<DwRuntime>& rt = call.rt;
  const at::Tensor& x = *call.x;
  const at::Tensor* w = call.w;
  // See Notes [Linear inputs that at::linear reduces in another order], [Linear calls the deferred
  // path gives at::linear's own rows] (backward.py): only the inputs _linear_rows hands over as they are
  const int64_t d = x.dim();
  if (d == 2) {
    if (x.stride(0) == 1 && x.stride(1) == x.size(0)) return nullptr;  // column-major
  } else if (d > 2) {
    if (!(x.is_contiguous() && x.numel() > x.size(-1) && x.size(-1) > 1)) return nullptr;
  } else {
    return nullptr;
  }
  if (!(w->dim() == 2 && w->stride(1) == 1 && w->stride(0) == w->size(1))) return nullptr;
  if (!take_call(call)) return nullptr;
  py::object token = rt->graph_token();
  if (d > 2 && call.bias) {
    // at::linear's own form (_linear_output in backward.py): with a bias it flattens x to rows and returns
    // a view of addmm's output, which an in-place op rebases or regenerates as plain's does
    at::Tensor out = deferred_linear(rt, x, *w, call.bias, target->weight_idx, target->bias_idx, token,
                                     /*flat=*/true);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out.size(-1);
    return THPVariable_Wrap(out.view(shape));
  }
  at::Tensor out = deferred_linear(rt, x, *w, call.bias, target->weight_idx, target->bias_idx, token);
  return THPVariable_Wrap(std::move(out));
}

PyObject* take_conv(const LayerCall& call, PyObject* module) {
  const LayerTarget* target = call.target;
  const std::shared_ptr<DwRuntime>& rt = call.rt;
  const at::Tensor& x = *call.x;
  const at::Tensor* w = call.w;
  // See Note [Conv weight gradients in the weight's layout] (backward.py)
  if (x.dim() != target->nd + 2 || !x.is_contiguous() || !w->is_contiguous()) return nullptr;
  static PyObject* s_stride = interned("stride");
  static PyObject* s_padding = interned("padding");
  static PyObject* s_dilation = interned("dilation");
  static PyObject* s_groups = interned("groups");
  static PyObject* s_padding_mode = interned("padding_mode");
  py::object mode = py::reinterpret_steal<py::object>(PyObject_GetAttr(module, s_padding_mode));
  if (!mode) throw python_error();
  if (!PyUnicode_Check(mode.ptr()) || PyUnicode_CompareWithASCIIString(mode.ptr(), "zeros") != 0) {
    return nullptr;  // the deferred Function pads with zeros
  }
  std::vector<int64_t> stride, padding, dilation;
  py::object so = py::reinterpret_steal<py::object>(PyObject_GetAttr(module, s_stride));
  py::object po = so ? py::reinterpret_steal<py::object>(PyObject_GetAttr(module, s_padding)) : py::object();
  py::object dl = po ? py::reinterpret_steal<py::object>(PyObject_GetAttr(module, s_dilation)) : py::object();
  py::object go = dl ? py::reinterpret_steal<py::object>(PyObject_GetAttr(module, s_groups)) : py::object();
  if (!go) throw python_error();
  if (!int_tuple(so.ptr(), &stride) || !int_tuple(po.ptr(), &padding) || !int_tuple(dl.ptr(), &dilation) ||
      !PyLong_CheckExact(go.ptr())) {
    PyErr_Clear();
    return nullptr;
  }
  const int64_t groups = PyLong_AsLongLong(go.ptr());
  if (PyErr_Occurred()) return nullptr;
  if (!take_call(call)) return nullptr;
  py::object token = rt->graph_token();
  at::Tensor out = deferred_conv(rt, x, *w, call.bias, std::move(stride), std::move(padding), std::move(dilation), groups,
                                 target->weight_idx, target->bias_idx, token);
  return THPVariable_Wrap(std::move(out));
}

PyObject* linear_call(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  return layer_entry(capsule, kLinearCapsule, args, nargs, take_linear);
}

PyObject* conv_call(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  return layer_entry(capsule, kConvCapsule, args, nargs, take_conv);
}

PyObject* use_hook_call(PyObject* capsule, PyObject* const* /*args*/, Py_ssize_t /*nargs*/) {
  HANDLE_TH_ERRORS
  auto* target = static_cast<UseHookTarget*>(PyCapsule_GetPointer(capsule, kUseHookCapsule));
  if (target == nullptr) return nullptr;
  std::shared_ptr<DwRuntime> rt = target->rt.lock();
  if (rt == nullptr || !rt->installed) Py_RETURN_NONE;
  if (at::GradMode::is_enabled() && rt->phase == 1) {
    const int32_t late = rt->note_autograd_use(target->params);
    if (late >= 0) refuse_late_use(*rt, late);
    Py_RETURN_NONE;
  }
  py::object owner = rt->owner();
  if (!owner.is_none()) owner.attr("_note_autograd_use")(py::cast(target->params));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef linear_def{"memsched_ooo_linear_fast_path", reinterpret_cast<PyCFunction>(
                                                            reinterpret_cast<void (*)()>(linear_call)),
                       METH_FASTCALL,
                       "fast(module, x): the deferred Linear's output, or NotImplemented (See Note [Fast path of "
                       "a patched layer call])."};
PyMethodDef conv_def{"memsched_ooo_conv_fast_path", reinterpret_cast<PyCFunction>(
                                                        reinterpret_cast<void (*)()>(conv_call)),
                     METH_FASTCALL,
                     "fast(module, x): the deferred conv's output, or NotImplemented (See Note [Fast path of a "
                     "patched layer call])."};
PyMethodDef use_hook_def{"memsched_ooo_autograd_use_hook", reinterpret_cast<PyCFunction>(
                                                              reinterpret_cast<void (*)()>(use_hook_call)),
                         METH_FASTCALL,
                         "A forward pre-hook counting an autograd use (See Note [Fast path of a patched layer "
                         "call])."};

}  // namespace

at::Tensor autocast_cast(const at::Tensor& t, c10::DeviceType device_type) {
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(device_type), t, device_type);
}

py::object linear_fast_path(const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx) {
  MEMSCHED_CHECK(rt != nullptr && weight_idx >= 0, "linear_fast_path: a runtime and a registered weight are needed");
  return capsule_function(&linear_def, kLinearCapsule, new LayerTarget{rt, weight_idx, bias_idx, 0});
}

py::object conv_fast_path(const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx, int64_t nd) {
  MEMSCHED_CHECK(rt != nullptr && weight_idx >= 0 && nd >= 1 && nd <= 3,
                 "conv_fast_path: a runtime, a registered weight and 1-3 spatial dimensions are needed");
  return capsule_function(&conv_def, kConvCapsule, new LayerTarget{rt, weight_idx, bias_idx, nd});
}

py::object autograd_use_hook(const std::shared_ptr<DwRuntime>& rt, std::vector<int32_t> params) {
  MEMSCHED_CHECK(rt != nullptr, "autograd_use_hook: a runtime is needed");
  return capsule_function(&use_hook_def, kUseHookCapsule, new UseHookTarget{rt, std::move(params)});
}

}  // namespace memsched
