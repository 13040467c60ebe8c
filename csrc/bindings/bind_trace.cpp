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

// A path given as a str or an os.PathLike, as open() takes it; anything else raises os.fspath's TypeError.
std::string fspath(const py::object& path) {
  return py::module_::import("os").attr("fspath")(path).cast<std::string>();
}

template <typename T>
auto text_getter(std::string T::*member) {
  return [member](const T& self) { return text(self.*member); };
}

template <typename T>
auto text_setter(std::string T::*member) {
  return [member](T& self, const std::string& value) { self.*member = value; };
}

// Note [Builder arguments name the field]
//   add_op/add_tensor take their numbers and names as Python objects and
//   convert them here, so a value pybind cannot convert (2**63, a float where
//   an int goes, a str with a lone surrogate) is a MemschedError naming the
//   argument instead of pybind's "incompatible function arguments" listing.
int64_t int_arg(const py::handle& value, const char* name) {
  if (!PyLong_Check(value.ptr()) || PyBool_Check(value.ptr())) {
    MEMSCHED_CHECK(false, "add_op/add_tensor: ", name, " must be an int, got ",
                   std::string(py::str(py::type::of(value).attr("__name__"))));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  MEMSCHED_CHECK(overflow == 0, "add_op/add_tensor: ", name, " is out of the int64 range: ",
                 std::string(py::str(value)));
  return static_cast<int64_t>(v);
}

double float_arg(const py::handle& value, const char* name) {
  MEMSCHED_CHECK(PyFloat_Check(value.ptr()) || (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr())),
                 "add_op/add_tensor: ", name, " must be a number, got ",
                 std::string(py::str(py::type::of(value).attr("__name__"))));
  const double v = PyFloat_AsDouble(value.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    MEMSCHED_CHECK(false, "add_op/add_tensor: ", name, " is out of the range of a double");
  }
  return v;
}

// Text as UTF-8 bytes; a lone surrogate is kept as its bytes (surrogateescape) for validate() to name.
std::string str_arg(const py::handle& value, const char* name) {
  if (PyBytes_Check(value.ptr())) return std::string(py::bytes(py::reinterpret_borrow<py::bytes>(value)));
  MEMSCHED_CHECK(PyUnicode_Check(value.ptr()), "add_op/add_tensor: ", name, " must be a str, got ",
                 std::string(py::str(py::type::of(value).attr("__name__"))));
  PyObject* b = PyUnicode_AsEncodedString(value.ptr(), "utf-8", "surrogateescape");
  if (b == nullptr) {
    PyErr_Clear();
    MEMSCHED_CHECK(false, "add_op/add_tensor: ", name, " cannot be encoded as UTF-8");
  }
  std::string out(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
  Py_DECREF(b);
  return out;
}

// Note [Element lists are copies]
//   Rationale: def_readwrite of a std::vector of bound classes (Trace.ops, Trace.tensors,
//   Plan.decisions) returns a list whose elements point INTO the vector (pybind11 casts each element
//   with reference_internal): `rec = trace.tensors[0]` then `trace.add_tensor(...)` (push_back
//   reallocates) or `trace.tensors = [...]` with more elements left `rec` on freed memory -- reading it
//   gave the allocator's free-list words, writing `rec.bytes = n` corrupted the heap and crashed a later
//   allocation far away (heap-use-after-free under ASan, from pure Python).
//   Approach: these properties return the elements by value -- every Op/TensorRecord/TensorDecision in
//   the list is a copy owned by Python -- and the setter replaces the whole vector, as the docstrings
//   always said ("a copy; assign the whole list"). Changing an element in place therefore no longer
//   changes the trace or plan: assign the list back (`plan.decisions = decisions`).
template <typename T, typename V>
auto copy_getter(std::vector<V> T::*member) {
  return [member](const T& self) { return std::vector<V>(self.*member); };
}

template <typename T, typename V>
auto vector_setter(std::vector<V> T::*member) {
  return [member](T& self, std::vector<V> value) { self.*member = std::move(value); };
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
      .def_readwrite("rng", &Op::rng, "draws random numbers (dropout...): a replay restores the RNG state")
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
      .def_readwrite("held_until_op", &TensorRecord::held_until_op,
                     "last forward op a non-graph reference (a caller's frame) holds it; -1: none "
                     "(Note [Held by the caller] in csrc/core/trace.h)")
      .def_readwrite("save_counters", &TensorRecord::save_counters,
                     "version counters its saves came through (Note [Saves through several counters] in "
                     "csrc/core/trace.h)")
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
      .def_property(
          "min_offload_bytes", [](const Trace& t) { return t.min_offload_bytes; },
          [](Trace& t, py::object v) {
            // See Note [Builder arguments name the field].
            MEMSCHED_CHECK(py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v) && v.cast<int64_t>() >= 0,
                           "Trace.min_offload_bytes: expected an int >= 0 (bytes), got ", py::str(v).cast<std::string>());
            t.min_offload_bytes = v.cast<int64_t>();
          },
          "Activations below this many bytes are neither offloaded nor recomputed by any planner (the "
          "executor's min_offload_bytes); 0: none. See Note [The executor's size floor].")
      // See Note [Element lists are copies].
      .def_property("ops", copy_getter(&Trace::ops), vector_setter(&Trace::ops),
                    "list of Op (copies; use add_op to append, or assign the whole list)")
      .def_property("tensors", copy_getter(&Trace::tensors), vector_setter(&Trace::tensors),
                    "list of TensorRecord (copies; use add_tensor to append, or assign the whole list)")
      .def("add_op",
           [](Trace& t, py::object name, py::object module_path, py::object phase, py::object duration_us,
              py::object flops, py::object bytes_read, py::object bytes_written, py::object rng) {
             // See Note [Builder arguments name the field].
             Op op;
             op.id = static_cast<int64_t>(t.ops.size());
             op.name = str_arg(name, "name");
             op.module_path = str_arg(module_path, "module_path");
             op.phase = phase_from_string(str_arg(phase, "phase"));
             op.duration_us = float_arg(duration_us, "duration_us");
             op.flops = float_arg(flops, "flops");
             op.bytes_read = int_arg(bytes_read, "bytes_read");
             op.bytes_written = int_arg(bytes_written, "bytes_written");
             op.rng = is_rng_op_name(op.name);
             if (!rng.is_none()) {
               MEMSCHED_CHECK(PyBool_Check(rng.ptr()), "add_op: rng must be True, False or None (None: derived "
                              "from the op name), got ", std::string(py::str(py::type::of(rng).attr("__name__"))));
               op.rng = rng.cast<bool>();
             }
             t.ops.push_back(std::move(op));
             return t.ops.back().id;
           },
           py::arg("name"), py::arg("module_path") = py::str(""), py::arg("phase") = py::str("forward"),
           py::arg("duration_us") = py::float_(0.0), py::arg("flops") = py::float_(0.0),
           py::arg("bytes_read") = py::int_(0), py::arg("bytes_written") = py::int_(0), py::arg("rng") = py::none(),
           "Append an op; returns its id. rng=None derives it from the name (dropout, bernoulli, rand...).")
      .def("add_tensor",
           [](Trace& t, py::object bytes, py::object dtype, py::object kind, py::object producer_op,
              py::object uses, py::object freed_after_op, py::object label, py::object held_until_op) {
             // See Note [Builder arguments name the field].
             TensorRecord r;
             r.id = static_cast<int64_t>(t.tensors.size());
             r.bytes = int_arg(bytes, "bytes");
             r.dtype = str_arg(dtype, "dtype");
             r.kind = tensor_kind_from_string(str_arg(kind, "kind"));
             r.producer_op = int_arg(producer_op, "producer_op");
             MEMSCHED_CHECK(py::isinstance<py::sequence>(uses) && !py::isinstance<py::str>(uses),
                            "add_op/add_tensor: uses must be a list of op ids");
             for (const auto& u : uses) r.uses.push_back(int_arg(u, "uses[]"));
             r.freed_after_op = int_arg(freed_after_op, "freed_after_op");
             r.label = str_arg(label, "label");
             r.held_until_op = int_arg(held_until_op, "held_until_op");
             t.tensors.push_back(std::move(r));
             return t.tensors.back().id;
           },
           py::arg("bytes"), py::arg("dtype"), py::arg("kind"), py::arg("producer_op") = py::int_(kBeforeStep),
           py::arg("uses") = py::list(), py::arg("freed_after_op") = py::int_(kAfterStep),
           py::arg("label") = py::str(""), py::arg("held_until_op") = py::int_(kNotHeld),
           "Append a tensor record; returns its id.")
      .def("validate", &Trace::validate)
      .def("live_bytes", &Trace::live_bytes, "bytes live during each op: the memory curve")
      .def("peak_bytes", &Trace::peak_bytes)
      .def("peak_op", &Trace::peak_op)
      .def("activation_bytes", &Trace::activation_bytes)
      .def("bytes_of_kind", [](const Trace& t, const std::string& kind) { return t.bytes_of_kind(tensor_kind_from_string(kind)); })
      // a str or an os.PathLike (pathlib.Path: was pybind11's "incompatible function arguments")
      .def("to_json", [](const Trace& t, const py::object& path) { save_trace(t, fspath(path)); }, py::arg("path"))
      .def_static("from_json", [](const py::object& path) { return load_trace(fspath(path)); }, py::arg("path"))
      .def("to_json_string", [](const Trace& t) { return text(trace_to_json(t)); })
      .def_static("from_json_string", &trace_from_json, py::arg("text"))
      .def("__repr__", [](const Trace& t) {
        return text("Trace(device='" + t.device + "', ops=" + std::to_string(t.ops.size()) +
                    ", tensors=" + std::to_string(t.tensors.size()) + ")");
      });
}

}  // namespace memsched::bindings
