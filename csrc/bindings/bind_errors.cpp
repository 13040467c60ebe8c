// bind_errors.cpp -- memsched::Error becomes memsched._C.MemschedError (a RuntimeError).
#include "bindings/bindings.h"
#include "core/check.h"

namespace memsched::bindings {

void bind_errors(pybind11::module_& m) {
  static pybind11::exception<Error> error(m, "MemschedError", PyExc_RuntimeError);
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

}  // namespace memsched::bindings
