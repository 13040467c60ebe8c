// bind_copy_engine.cpp -- memsched._C.CopyEngine, the offload executor's copies (Note [Offload copy
// ordering] in csrc/torch/copy_engine.h). Includes torch headers (See Note [One module, several
// binding files]).
#include <torch/python.h>

#include "bindings/bindings.h"
#include "torch/copy_engine.h"

namespace memsched::bindings {

namespace py = pybind11;

void bind_copy_engine(py::module_& m) {
  py::class_<CopyTicket, std::shared_ptr<CopyTicket>>(
      m, "CopyTicket", "One copy in flight: its destination and whether it has finished.")
      .def_property_readonly("dst", [](const CopyTicket& t) { return t.dst; },
                             "The flat uint8 tensor the copy writes (host block or device tensor).")
      .def_property_readonly("nbytes", [](const CopyTicket& t) { return t.nbytes; })
      .def_property_readonly("kind", [](const CopyTicket& t) { return t.d2h ? "d2h" : "h2d"; })
      .def("is_complete", &CopyTicket::is_complete, "Whether the copy has finished (never waits).");

  py::class_<StepCopyLog, std::shared_ptr<StepCopyLog>>(
      m, "StepCopyLog", "A step's copies and compute-stream stalls, read once its events completed.")
      .def_readonly("d2h_bytes", &StepCopyLog::d2h_bytes)
      .def_readonly("h2d_bytes", &StepCopyLog::h2d_bytes)
      .def("ready", &StepCopyLog::ready, "Whether resolve() would not wait.")
      .def("resolve", &StepCopyLog::resolve, py::call_guard<py::gil_scoped_release>(),
           "(duration_s, stall_s, [(kind, start_s, end_s, nbytes)]) of an accelerator step, from its "
           "events (waits for the end mark).")
      .def("host_copies", &StepCopyLog::host_copies,
           "CPU: [(kind, issued_s, finished_s, nbytes)] since the step began (timeline only).");

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(
      m, "CopyEngine",
      "D2H / H2D copies on side streams (in order on CPU), their events (pooled) and the memory they "
      "hold until they complete. See Note [Offload copy ordering].")
      .def(py::init<at::Device, std::shared_ptr<HostTensorPool>, int64_t, bool>(), py::arg("device"),
           py::arg("host_pool"), py::arg("limit_bytes") = -1, py::arg("timeline") = false)
      .def_property_readonly("is_accelerator", &CopyEngine::is_accelerator)
      .def_readwrite("on_compute_stream", &CopyEngine::on_compute_stream)
      .def_readwrite("limit_bytes", &CopyEngine::limit_bytes, "Most host bytes alive at once (-1: no limit).")
      .def("has_room", &CopyEngine::has_room, py::arg("nbytes"))
      .def("host_live_bytes", &CopyEngine::host_live_bytes)
      .def("begin_step", &CopyEngine::begin_step)
      .def("offload_many", &CopyEngine::offload_many, py::arg("sources"), py::arg("hold") = true)
      .def("fetch", &CopyEngine::fetch, py::arg("host"), py::arg("after") = py::none())
      .def("fetch_into", &CopyEngine::fetch_into, py::arg("dst"), py::arg("host"), py::arg("after") = py::none())
      .def("wait", &CopyEngine::wait, py::arg("ticket"))
      .def("poll", &CopyEngine::poll)
      .def("pending_count", &CopyEngine::pending_count)
      .def_property_readonly("held_source_bytes", &CopyEngine::held_source_bytes,
                             "Device bytes held for D2H copies in flight (their sources, until released)")
      .def("release_in_stream_order", &CopyEngine::release_in_stream_order, py::arg("bytes"),
           "Accelerator: drop the holds of the oldest D2H copies in flight after a compute-stream wait, until "
           "`bytes` are released; returns (copies, bytes) (Note [Releases in stream order]).")
      .def("end_step", &CopyEngine::end_step)
      .def("mark_end", [](CopyEngine& e, StepCopyLog& log) { log.mark_end(e.events()); }, py::arg("log"),
           "Record the step's end on the compute stream (again after the optimizer's update).")
      // The GIL stays held: poll() from a hook on another thread must not run while release()
      // empties the queues.
      .def("release", &CopyEngine::release)
      .def("check_invariants", &CopyEngine::check_invariants);
}

}  // namespace memsched::bindings
