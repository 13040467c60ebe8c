// capsule_function.h -- a Python callable that is a C function over a capsule owning its state.
//
// The hot-path callables memsched hands to PyTorch (gradient hooks, a layer's fast path) are
// PyCFunctions whose `self` is a capsule holding a heap-allocated target: no Python frame and no
// pybind11 dispatch per call, and the target dies with the last reference to the function.
#pragma once

#include <torch/python.h>

namespace memsched {

// A new callable running def->ml_meth with a capsule named `name` (a string literal) that owns
// `target` (deleted with the capsule, or at once if the callable cannot be made).
template <typename T>
pybind11::object capsule_function(PyMethodDef* def, const char* name, T* target) {
  PyObject* capsule = PyCapsule_New(target, name, [](PyObject* c) {
    delete static_cast<T*>(PyCapsule_GetPointer(c, PyCapsule_GetName(c)));
  });
  if (capsule == nullptr) {
    delete target;
    throw pybind11::error_already_set();
  }
  PyObject* fn = PyCFunction_New(def, capsule);
  Py_DECREF(capsule);
  if (fn == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(fn);
}

}  // namespace memsched
