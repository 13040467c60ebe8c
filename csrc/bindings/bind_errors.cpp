// bind_errors.cpp -- memsched::Error becomes memsched._C.MemschedError (a RuntimeError).
//
// A message can quote user text that is not UTF-8 (a name from a trace file,
// Python bytes passed as a name); it is decoded with errors='replace', so the
// user sees the MemschedError, not a UnicodeDecodeError raised while raising it.
#include <string>

#include "bindings/bindings.h"
#include "core/check.h"

namespace memsched::bindings {

void bind_errors(pybind11::module_& m) {
  static pybind11::exception<Error> error(m, "MemschedError", PyExc_RuntimeError);
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      const std::string what = e.what();
      PyObject* message = PyUnicode_DecodeUTF8(what.data(), static_cast<Py_ssize_t>(what.size()), "replace");
      if (message == nullptr) return;  // out of memory: that error is set
      PyErr_SetObject(error.ptr(), message);
      Py_DECREF(message);
    }
  });
}

}  // namespace memsched::bindings
