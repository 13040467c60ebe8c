// bind_trace_builder.cpp -- memsched._C.TraceBuilder: the profiler's recorder
// (See Note [Trace builder events]). Kinds and phases cross as their JSON strings.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/check.h"
#include "core/trace_builder.h"

namespace py = pybind11;

namespace memsched::bindings {
namespace {

// The profiler's hot path (Note [Profiler overhead]) passes plain Python lists
// and numbers; reading them with the C API skips pybind11's list and tuple casters.
std::vector<uint64_t> to_keys(py::handle used) {
  MEMSCHED_CHECK(PyList_Check(used.ptr()), "TraceBuilder.record_op: used must be a list of storage keys");
  const Py_ssize_t n = PyList_GET_SIZE(used.ptr());
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) keys[i] = py::cast<uint64_t>(py::handle(PyList_GET_ITEM(used.ptr(), i)));
  return keys;
}

std::vector<TraceBuilder::OutputInfo> to_outputs(py::handle outputs) {
  MEMSCHED_CHECK(PyList_Check(outputs.ptr()) && PyList_GET_SIZE(outputs.ptr()) % 3 == 0,
                 "TraceBuilder.record_op: outputs must be a flat list key, bytes, dtype, key, bytes, dtype, ...");
  const Py_ssize_t n = PyList_GET_SIZE(outputs.ptr());
  std::vector<TraceBuilder::OutputInfo> outs(static_cast<size_t>(n / 3));
  for (Py_ssize_t i = 0; i < n; i += 3) {
    TraceBuilder::OutputInfo& o = outs[static_cast<size_t>(i / 3)];
    o.key = py::cast<uint64_t>(py::handle(PyList_GET_ITEM(outputs.ptr(), i)));
    o.bytes = py::cast<int64_t>(py::handle(PyList_GET_ITEM(outputs.ptr(), i + 1)));
    o.dtype = py::cast<std::string>(py::handle(PyList_GET_ITEM(outputs.ptr(), i + 2)));
  }
  return outs;
}

double to_double(py::handle x, const char* field) {
  const double v = PyFloat_AsDouble(x.ptr());  // accepts float and int
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    MEMSCHED_CHECK(false, "TraceBuilder.record_op: ", field, " must be a number");
  }
  return v;
}

}  // namespace

void bind_trace_builder(py::module_& m) {
  py::class_<TraceBuilder>(m, "TraceBuilder",
                           "Records one step event by event into a Trace; See Note [Trace builder events].")
      .def(py::init<std::string>(), py::arg("device") = "")
      .def("begin_op",
           [](TraceBuilder& b, const std::string& name, const std::string& module_path, const std::string& phase) {
             return b.begin_op(name, module_path, phase_from_string(phase));
           },
           py::arg("name"), py::arg("module_path"), py::arg("phase"))
      .def("end_op", &TraceBuilder::end_op, py::arg("duration_us"), py::arg("flops"), py::arg("bytes_read"),
           py::arg("bytes_written"))
      .def("record_op",
           [](TraceBuilder& b, const std::string& name, const std::string& module_path, const std::string& phase,
              py::handle used, py::handle outputs, py::handle duration_us, py::handle flops, int64_t bytes_read,
              int64_t bytes_written) {
             return b.record_op(name, module_path, phase_from_string(phase), to_keys(used), to_outputs(outputs),
                                to_double(duration_us, "duration_us"), to_double(flops, "flops"), bytes_read,
                                bytes_written);
           },
           py::arg("name"), py::arg("module_path"), py::arg("phase"), py::arg("used"), py::arg("outputs"),
           py::arg("duration_us"), py::arg("flops"), py::arg("bytes_read"), py::arg("bytes_written"),
           "begin_op + tensor_used(used: list of keys) + tensor_allocated(outputs: a flat list key, bytes, "
           "dtype, key, bytes, dtype, ...) + end_op in one call (the profiler's hot path).")
      .def("set_duration_us", &TraceBuilder::set_duration_us, py::arg("op_id"), py::arg("duration_us"))
      .def("tensor_existing",
           [](TraceBuilder& b, uint64_t key, int64_t bytes, const std::string& dtype, const std::string& kind,
              const std::string& label) { return b.tensor_existing(key, bytes, dtype, tensor_kind_from_string(kind), label); },
           py::arg("key"), py::arg("bytes"), py::arg("dtype"), py::arg("kind"), py::arg("label") = "")
      .def("tensor_allocated",
           [](TraceBuilder& b, uint64_t key, int64_t bytes, const std::string& dtype, const std::string& kind,
              const std::string& label) { return b.tensor_allocated(key, bytes, dtype, tensor_kind_from_string(kind), label); },
           py::arg("key"), py::arg("bytes"), py::arg("dtype"), py::arg("kind") = "temporary", py::arg("label") = "")
      .def("tensor_used", &TraceBuilder::tensor_used, py::arg("key"))
      .def("tensor_freed", &TraceBuilder::tensor_freed, py::arg("key"))
      .def("tensor_held", &TraceBuilder::tensor_held, py::arg("key"),
           "Something besides the step's saves holds this storage during the last op begun "
           "(Note [Held by the caller] in csrc/core/trace.h).")
      .def("tensor_save_counters", &TraceBuilder::tensor_save_counters, py::arg("key"), py::arg("counters"),
           "The saves of this storage came through `counters` version counters (Note [Saves through several "
           "counters] in csrc/core/trace.h).")
      .def("upgrade_kind",
           [](TraceBuilder& b, uint64_t key, const std::string& kind, const std::string& label) {
             b.upgrade_kind(key, tensor_kind_from_string(kind), label);
           },
           py::arg("key"), py::arg("kind"), py::arg("label") = "")
      .def("is_live", &TraceBuilder::is_live, py::arg("key"))
      .def("live_keys", &TraceBuilder::live_keys)
      .def_property_readonly("num_ops", &TraceBuilder::num_ops)
      .def_property_readonly("num_records", &TraceBuilder::num_records)
      .def_property_readonly("in_op", &TraceBuilder::in_op)
      .def("finish", &TraceBuilder::finish, "The validated Trace; leaves the builder empty.")
      .def("check_invariants", &TraceBuilder::check_invariants);
}

}  // namespace memsched::bindings
