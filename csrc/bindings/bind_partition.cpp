// bind_partition.cpp -- memsched._C.PartitionProblem: the multi-device
// partition model (csrc/core/partition/), its evaluation, the S3 partitioner
// and the contiguous baselines. Python wraps it in memsched.partition.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/partition/contiguous_split.h"
#include "core/partition/partition_eval.h"
#include "core/partition/partition_problem.h"
#include "core/partition/s3_partitioner.h"

namespace py = pybind11;

namespace memsched::bindings {
namespace {

py::dict eval_dict(const PartitionEval& ev) {
  py::dict d;
  d["makespan_us"] = ev.makespan_us;
  d["busy_us"] = ev.busy_us;
  d["peak_bytes"] = ev.peak_bytes;
  d["peak_op"] = ev.peak_op;
  d["ops_per_device"] = ev.ops_per_device;
  d["bytes_moved"] = ev.bytes_moved;
  d["num_transfers"] = ev.num_transfers;
  d["excess_bytes"] = ev.excess_bytes;
  d["fits"] = ev.fits;
  return d;
}

PartitionDevices make_devices(std::vector<DeviceModel> devices, std::vector<int64_t> caps,
                              std::vector<double> links, double link_bw_gbps, double link_latency_us) {
  PartitionDevices d;
  d.devices = std::move(devices);
  d.caps_bytes = std::move(caps);
  d.link_bw_gbps = std::move(links);
  d.default_link_bw_gbps = link_bw_gbps;
  d.link_latency_us = link_latency_us;
  return d;
}

S3Options s3_options(double time_limit_s, int64_t max_refine_trials, int64_t restarts, uint64_t seed,
                     bool contiguous_starts) {
  S3Options o;
  o.time_limit_s = time_limit_s;
  o.max_refine_trials = max_refine_trials;
  o.restarts = restarts;
  o.seed = seed;
  o.contiguous_starts = contiguous_starts;
  return o;
}

}  // namespace

void bind_partition(py::module_& m) {
  py::class_<PartitionProblem>(m, "PartitionProblem",
                               "A trace placed on several devices under memory caps (Note [Partition model])")
      .def(py::init([](const Trace& trace, std::vector<DeviceModel> devices, std::vector<int64_t> caps,
                       std::vector<double> links, double link_bw_gbps, double link_latency_us) {
             return PartitionProblem(trace, make_devices(std::move(devices), std::move(caps), std::move(links),
                                                         link_bw_gbps, link_latency_us));
           }),
           py::arg("trace"), py::arg("devices"), py::arg("caps"), py::arg("links") = std::vector<double>{},
           py::arg("link_bw_gbps") = 450.0, py::arg("link_latency_us") = 5.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_ops", &PartitionProblem::num_ops)
      .def_property_readonly("num_devices", &PartitionProblem::num_devices)
      .def_property_readonly("num_layers", &PartitionProblem::num_layers)
      .def_property_readonly("caps", [](const PartitionProblem& p) { return p.devices().caps_bytes; })
      .def("layer_of", [](const PartitionProblem& p) {
        std::vector<int64_t> out(p.num_ops());
        for (int64_t i = 0; i < p.num_ops(); ++i) out[i] = p.layer_of(i);
        return out;
      })
      .def("op_us", &PartitionProblem::op_us, py::arg("op"), py::arg("device"))
      .def("comm_us", &PartitionProblem::comm_us, py::arg("bytes"), py::arg("from_device"), py::arg("to_device"))
      .def("inputs", &PartitionProblem::inputs, py::arg("op"), "tensors op reads (not produced by it), ascending")
      .def("tensors", [](const PartitionProblem& p) {
        py::list out;
        for (const auto& t : p.tensors())
          out.append(py::make_tuple(t.bytes, t.producer, t.home_op, t.start, t.end, t.reasons));
        return out;
      }, "one (bytes, producer, home_op, start, end, reasons) tuple per trace tensor")
      .def("evaluate", [](const PartitionProblem& p, const std::vector<int>& a) {
        PartitionEval ev;
        {
          py::gil_scoped_release release;
          ev = evaluate_partition(p, a);
        }
        return eval_dict(ev);
      }, py::arg("device_of_op"))
      .def("schedule", [](const PartitionProblem& p, const std::vector<int>& a) {
        check_assignment(p, a);
        std::vector<double> start, finish;
        simulate_makespan(p, a, &start, &finish);
        return py::make_tuple(start, finish);
      }, py::arg("device_of_op"), "per-op (start_us, finish_us) lists of the simulated schedule")
      .def("transfers", [](const PartitionProblem& p, const std::vector<int>& a) {
        py::list out;
        for (const auto& x : partition_transfers(p, a))
          out.append(py::make_tuple(x.tensor, x.from_device, x.to_device, x.bytes, x.ready_us, x.arrive_us));
        return out;
      }, py::arg("device_of_op"), "one (tensor, from, to, bytes, ready_us, arrive_us) tuple per transfer")
      .def("even_layer_split", &even_layer_split)
      .def("flop_balanced_split", &flop_balanced_split)
      .def("cluster_mapping", [](const PartitionProblem& p) { return s3_cluster_mapping(p); })
      .def("s3", [](const PartitionProblem& p, double time_limit_s, int64_t max_refine_trials, int64_t restarts,
                    uint64_t seed, bool contiguous_starts,
                    std::vector<std::pair<std::string, std::vector<int>>> extra_starts) {
        S3Result r;
        {
          py::gil_scoped_release release;
          S3Options o = s3_options(time_limit_s, max_refine_trials, restarts, seed, contiguous_starts);
          o.extra_starts = std::move(extra_starts);
          r = partition_s3(p, o);
        }
        py::dict d;
        d["device_of_op"] = r.device_of_op;
        d["eval"] = eval_dict(r.eval);
        d["start"] = r.start;
        d["num_clusters"] = r.num_clusters;
        d["fits"] = r.fits;
        d["seconds"] = r.seconds;
        return d;
      }, py::arg("time_limit_s") = 40.0, py::arg("max_refine_trials") = -1, py::arg("restarts") = -1,
         py::arg("seed") = 1, py::arg("contiguous_starts") = true,
         py::arg("extra_starts") = std::vector<std::pair<std::string, std::vector<int>>>{})
      .def("least_uniform_cap", [](const PartitionProblem& p, double time_limit_s) {
        py::gil_scoped_release release;
        return least_uniform_cap(p, s3_options(time_limit_s, -1, -1, 1, true));
      }, py::arg("time_limit_s") = 40.0);
}

}  // namespace memsched::bindings
