// bind_trace.cpp -- memsched._C.Trace, Op, TensorRecord and JSON I/O.
// Phases and kinds cross into Python as their JSON strings ("forward", "activation").
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/check.h"
#include "core/trace.h"
#include "core/trace_json.h"

namespace py = pybind11;

namespace memsched::bindings {
namespace {

// Names cross into Python decoded with errors='replace': a name that is not
// UTF-8 (set from Python bytes) reads as text with U+FFFD instead of raising
// UnicodeDecodeError from inside pybind; validate() names the field
// (See Note [Trace value bounds]).
py::str text(const std::string& s) {
  PyObject* obj = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(obj);
}

template <typename T>
auto text_getter(std::string T::*member) {
  return [member](const T& self) { return text(self.*member); };
}

template <typename T>
auto text_setter(std::string T::*member) {
  return [member](T& self, const std::string& value) { self.*member = value; };
}

}  // namespace

void bind_trace(py::module_& m) {
  py::class_<Op>(m, "Op")
      .def(py::init<>())
      .def_readwrite("id", &Op::id)
      .def_property("name", text_getter(&Op::name), text_setter(&Op::name))
      .def_property("module_path", text_getter(&Op::module_path), text_setter(&Op::module_path))
      .def_property(
          "phase", [](const Op& op) { return std::string(to_string(op.phase)); },
          [](Op& op, const std::string& s) { op.phase = phase_from_string(s); })
      .def_readwrite("duration_us", &Op::duration_us)
      .def_readwrite("flops", &Op::flops)
      .def_readwrite("bytes_read", &Op::bytes_read)
      .def_readwrite("bytes_written", &Op::bytes_written)
      .def("__repr__", [](const Op& op) {
        return text("Op(id=" + std::to_string(op.id) + ", name='" + op.name + "', module_path='" +
                    op.module_path + "', phase='" + to_string(op.phase) + "')");
      });

  py::class_<TensorRecord>(m, "TensorRecord")
      .def(py::init<>())
      .def_readwrite("id", &TensorRecord::id)
      .def_readwrite("bytes", &TensorRecord::bytes)
      .def_property("dtype", text_getter(&TensorRecord::dtype), text_setter(&TensorRecord::dtype))
      .def_property(
          "kind", [](const TensorRecord& t) { return std::string(to_string(t.kind)); },
          [](TensorRecord& t, const std::string& s) { t.kind = tensor_kind_from_string(s); })
      .def_readwrite("producer_op", &TensorRecord::producer_op)
      .def_readwrite("uses", &TensorRecord::uses)
      .def_readwrite("freed_after_op", &TensorRecord::freed_after_op)
      .def_property("label", text_getter(&TensorRecord::label), text_setter(&TensorRecord::label))
      .def("__repr__", [](const TensorRecord& t) {
        return "TensorRecord(id=" + std::to_string(t.id) + ", bytes=" + std::to_string(t.bytes) +
               ", kind='" + to_string(t.kind) + "', producer_op=" + std::to_string(t.producer_op) +
               ", freed_after_op=" + std::to_string(t.freed_after_op) + ")";
      });

  py::class_<Trace>(m, "Trace")
      .def(py::init<>())
      .def_readwrite("version", &Trace::version)
      .def_property("device", text_getter(&Trace::device), text_setter(&Trace::device))
      .def_readwrite("ops", &Trace::ops, "list of Op (a copy; use add_op to append)")
      .def_readwrite("tensors", &Trace::tensors, "list of TensorRecord (a copy; use add_tensor)")
      .def("add_op",
           [](Trace& t, const std::string& name, const std::string& module_path, const std::string& phase,
              double duration_us, double flops, int64_t bytes_read, int64_t bytes_written) {
             Op op;
             op.id = static_cast<int64_t>(t.ops.size());
             op.name = name;
             op.module_path = module_path;
             op.phase = phase_from_string(phase);
             op.duration_us = duration_us;
             op.flops = flops;
             op.bytes_read = bytes_read;
             op.bytes_written = bytes_written;
             t.ops.push_back(std::move(op));
             return t.ops.back().id;
           },
           py::arg("name"), py::arg("module_path") = "", py::arg("phase") = "forward",
           py::arg("duration_us") = 0.0, py::arg("flops") = 0.0, py::arg("bytes_read") = 0,
           py::arg("bytes_written") = 0, "Append an op; returns its id.")
      .def("add_tensor",
           [](Trace& t, int64_t bytes, const std::string& dtype, const std::string& kind, int64_t producer_op,
              std::vector<int64_t> uses, int64_t freed_after_op, const std::string& label) {
             TensorRecord r;
             r.id = static_cast<int64_t>(t.tensors.size());
             r.bytes = bytes;
             r.dtype = dtype;
             r.kind = tensor_kind_from_string(kind);
             r.producer_op = producer_op;
             r.uses = std::move(uses);
             r.freed_after_op = freed_after_op;
             r.label = label;
             t.tensors.push_back(std::move(r));
             return t.tensors.back().id;
           },
           py::arg("bytes"), py::arg("dtype"), py::arg("kind"), py::arg("producer_op") = kBeforeStep,
           py::arg("uses") = std::vector<int64_t>{}, py::arg("freed_after_op") = kAfterStep,
           py::arg("label") = "", "Append a tensor record; returns its id.")
      .def("validate", &Trace::validate)
      .def("live_bytes", &Trace::live_bytes, "bytes live during each op: the memory curve")
      .def("peak_bytes", &Trace::peak_bytes)
      .def("peak_op", &Trace::peak_op)
      .def("activation_bytes", &Trace::activation_bytes)
      .def("bytes_of_kind", [](const Trace& t, const std::string& kind) { return t.bytes_of_kind(tensor_kind_from_string(kind)); })
      .def("to_json", [](const Trace& t, const std::string& path) { save_trace(t, path); }, py::arg("path"))
      .def_static("from_json", &load_trace, py::arg("path"))
      .def("to_json_string", [](const Trace& t) { return text(trace_to_json(t)); })
      .def_static("from_json_string", &trace_from_json, py::arg("text"))
      .def("__repr__", [](const Trace& t) {
        return text("Trace(device='" + t.device + "', ops=" + std::to_string(t.ops.size()) +
                    ", tensors=" + std::to_string(t.tensors.size()) + ")");
      });
}

}  // namespace memsched::bindings
