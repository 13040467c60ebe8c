// bind_pipeline.cpp -- memsched._C's pipeline schedule simulator
// (core/pipeline_sim.h) for python/memsched/pipeline/simulate.py. pybind11 only.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/pipeline_sim.h"

namespace py = pybind11;

namespace memsched::bindings {

void bind_pipeline(py::module_& m) {
  py::class_<PipelineStageCost>(m, "PipelineStageCost")
      .def(py::init<>())
      .def_readwrite("forward_us", &PipelineStageCost::forward_us)
      .def_readwrite("backward_input_us", &PipelineStageCost::backward_input_us)
      .def_readwrite("backward_weight_us", &PipelineStageCost::backward_weight_us)
      .def_readwrite("update_us", &PipelineStageCost::update_us)
      .def_readwrite("policy_us", &PipelineStageCost::policy_us)
      .def_readwrite("send_bytes", &PipelineStageCost::send_bytes);
  py::class_<PipelineLink>(m, "PipelineLink")
      .def(py::init<>())
      .def_readwrite("bandwidth_gbps", &PipelineLink::bandwidth_gbps)
      .def_readwrite("latency_us", &PipelineLink::latency_us);
  py::class_<PipelineEvent>(m, "PipelineEvent")
      .def_readonly("stage", &PipelineEvent::stage)
      .def_readonly("microbatch", &PipelineEvent::microbatch)
      .def_property_readonly("kind", [](const PipelineEvent& e) { return std::string(1, e.kind); })
      .def_readonly("start_us", &PipelineEvent::start_us)
      .def_readonly("end_us", &PipelineEvent::end_us);
  py::class_<PipelineSimResult>(m, "PipelineSimResult")
      .def_readonly("time_per_microbatch_us", &PipelineSimResult::time_per_microbatch_us)
      .def_readonly("microbatches_per_s", &PipelineSimResult::microbatches_per_s)
      .def_readonly("bubble_fraction", &PipelineSimResult::bubble_fraction)
      .def_readonly("busy_us", &PipelineSimResult::busy_us)
      .def_readonly("timeline", &PipelineSimResult::timeline);
  m.def(
      "simulate_pipeline",
      [](const std::vector<PipelineStageCost>& stages, const PipelineLink& link, const std::string& schedule,
         int32_t microbatches, int32_t steps, bool split_backward) {
        PipelineSimOptions o;
        o.schedule = pipeline_schedule_from_name(schedule);
        o.microbatches = microbatches;
        o.steps = steps;
        o.split_backward = split_backward;
        return simulate_pipeline(stages, link, o);
      },
      py::arg("stages"), py::arg("link"), py::arg("schedule"), py::arg("microbatches") = 8, py::arg("steps") = 0,
      py::arg("split_backward") = true);
  py::class_<DataParallelResult>(m, "DataParallelResult")
      .def_readonly("step_us", &DataParallelResult::step_us)
      .def_readonly("allreduce_us", &DataParallelResult::allreduce_us)
      .def_readonly("time_per_microbatch_us", &DataParallelResult::time_per_microbatch_us)
      .def_readonly("microbatches_per_s", &DataParallelResult::microbatches_per_s);
  m.def(
      "simulate_data_parallel",
      [](double compute_us_per_microbatch, double overlap_us, double update_us, int64_t grad_bytes, int32_t devices,
         int32_t microbatches, const PipelineLink& link) {
        DataParallelCost c;
        c.compute_us_per_microbatch = compute_us_per_microbatch;
        c.overlap_us = overlap_us;
        c.update_us = update_us;
        c.grad_bytes = grad_bytes;
        c.devices = devices;
        c.microbatches = microbatches;
        c.link = link;
        return simulate_data_parallel(c);
      },
      py::arg("compute_us_per_microbatch"), py::arg("overlap_us"), py::arg("update_us"), py::arg("grad_bytes"),
      py::arg("devices"), py::arg("microbatches"), py::arg("link"));
}

}  // namespace memsched::bindings
