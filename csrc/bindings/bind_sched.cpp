// bind_sched.cpp -- memsched._C.DwScheduler (core/dw_scheduler.h) for the
// out-of-order backward executor in python/memsched/ooo. pybind11 only.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/dw_scheduler.h"

namespace py = pybind11;

namespace memsched::bindings {

py::dict dw_stats_dict(const DwStats& st) {
  py::dict d;
  d["enqueued"] = st.enqueued;
  d["completed"] = st.completed;
  d["urgent"] = st.urgent;
  d["limit_flushes"] = st.limit_flushes;
  d["held_bytes"] = st.held_bytes;
  d["peak_held_bytes"] = st.peak_held_bytes;
  d["queued"] = st.queued;
  d["peak_queued"] = st.peak_queued;
  return d;
}

void bind_sched(py::module_& m) {
  py::class_<DwCompletion>(m, "DwCompletion")
      .def_readonly("final_params", &DwCompletion::final_params)
      .def_readonly("ready_buckets", &DwCompletion::ready_buckets);

  py::class_<DwScheduler>(m, "DwScheduler")
      .def(py::init<int64_t>(), py::arg("max_deferred_bytes") = -1)
      .def("add_param", &DwScheduler::add_param, py::arg("grad_bytes"), py::arg("bucket") = -1)
      .def_property_readonly("num_params", &DwScheduler::num_params)
      .def_property_readonly("num_buckets", &DwScheduler::num_buckets)
      .def("begin_iteration", &DwScheduler::begin_iteration)
      .def("expect_contribution", &DwScheduler::expect_contribution, py::arg("param"))
      .def("expected", &DwScheduler::expected, py::arg("param"))
      .def("received", &DwScheduler::received, py::arg("param"))
      .def("is_final", &DwScheduler::is_final, py::arg("param"))
      .def("bucket_ready", &DwScheduler::bucket_ready, py::arg("bucket"))
      .def("enqueue", &DwScheduler::enqueue, py::arg("params"), py::arg("held_bytes"))
      .def("next_urgent", &DwScheduler::next_urgent)
      .def("pop", &DwScheduler::pop)
      .def("complete", &DwScheduler::complete, py::arg("id"))
      .def("contribute", &DwScheduler::contribute, py::arg("param"))
      .def("end_iteration", &DwScheduler::end_iteration, py::arg("allow_missing") = false)
      .def_property_readonly("held_bytes", &DwScheduler::held_bytes)
      .def_property_readonly("max_deferred_bytes", &DwScheduler::max_deferred_bytes)
      .def_property_readonly("queued", &DwScheduler::queued)
      .def_property_readonly("in_flight", &DwScheduler::in_flight)
      .def("stats", [](const DwScheduler& s) { return dw_stats_dict(s.stats()); })
      .def("check_invariants", &DwScheduler::check_invariants);
}

}  // namespace memsched::bindings
