// bind_plan.cpp -- memsched._C.DeviceModel, TensorDecision, Plan, SimResult,
// make_plan, simulate, planner_names and the helpers around them.
// Streams and event kinds cross into Python as strings ("compute", "d2h", "h2d"; "op").
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/check.h"
#include "core/device_model.h"
#include "core/plan.h"
#include "core/planner.h"
#include "core/recompute.h"
#include "core/simulator.h"
#include "core/synthetic_trace.h"

namespace py = pybind11;

namespace memsched::bindings {

void bind_plan(py::module_& m) {
  py::class_<DeviceModel>(m, "DeviceModel", "Performance model: op roofline, copy bandwidth and latency each way")
      .def(py::init<>())
      .def_readwrite("name", &DeviceModel::name)
      .def_readwrite("peak_flops", &DeviceModel::peak_flops, "FLOP/s")
      .def_readwrite("hbm_bw_gbps", &DeviceModel::hbm_bw_gbps, "GB/s (1e9 B/s)")
      .def_readwrite("d2h_bw_gbps", &DeviceModel::d2h_bw_gbps, "device->host GB/s")
      .def_readwrite("h2d_bw_gbps", &DeviceModel::h2d_bw_gbps, "host->device GB/s")
      .def_readwrite("d2h_latency_us", &DeviceModel::d2h_latency_us)
      .def_readwrite("h2d_latency_us", &DeviceModel::h2d_latency_us)
      .def_readwrite("memory_bytes", &DeviceModel::memory_bytes)
      .def_readwrite("use_measured_durations", &DeviceModel::use_measured_durations)
      .def_readwrite("source", &DeviceModel::source)
      .def("validate", &DeviceModel::validate)
      .def("op_time_us", &op_time_us, py::arg("op"))
      .def("d2h_time_us", &d2h_time_us, py::arg("bytes"))
      .def("h2d_time_us", &h2d_time_us, py::arg("bytes"))
      .def("__repr__", [](const DeviceModel& d) {
        return "DeviceModel(name='" + d.name + "', peak_flops=" + std::to_string(d.peak_flops) +
               ", hbm_bw_gbps=" + std::to_string(d.hbm_bw_gbps) + ", d2h_bw_gbps=" + std::to_string(d.d2h_bw_gbps) +
               ", h2d_bw_gbps=" + std::to_string(d.h2d_bw_gbps) + ")";
      });

  py::class_<TensorDecision>(m, "TensorDecision")
      .def(py::init<>())
      .def(py::init([](int64_t tensor_id, bool offload, int64_t offload_after_op, int64_t prefetch_at_op) {
             return TensorDecision{tensor_id, offload, offload_after_op, prefetch_at_op};
           }),
           py::arg("tensor_id"), py::arg("offload"), py::arg("offload_after_op") = -1, py::arg("prefetch_at_op") = -1)
      .def_readwrite("tensor_id", &TensorDecision::tensor_id)
      .def_readwrite("offload", &TensorDecision::offload)
      .def_readwrite("offload_after_op", &TensorDecision::offload_after_op)
      .def_readwrite("prefetch_at_op", &TensorDecision::prefetch_at_op)
      .def_readwrite("recompute", &TensorDecision::recompute,
                     "replayed before its first backward use instead of kept or offloaded")
      .def_readwrite("recompute_ops", &TensorDecision::recompute_ops,
                     "forward ops the replay re-runs, ascending (empty: an earlier replay recreates and keeps it)")
      .def_readwrite("recompute_at_op", &TensorDecision::recompute_at_op,
                     "the op before which the tensor is recreated (-1 unless recomputed)")
      .def_property_readonly("action", [](const TensorDecision& d) { return std::string(to_string(action_of(d))); },
                             "'keep', 'offload' or 'recompute'")
      .def("__repr__", [](const TensorDecision& d) {
        std::string s = "TensorDecision(tensor_id=" + std::to_string(d.tensor_id) + ", offload=" +
                        (d.offload ? "True" : "False") + ", offload_after_op=" + std::to_string(d.offload_after_op) +
                        ", prefetch_at_op=" + std::to_string(d.prefetch_at_op);
        if (d.recompute) {
          s += ", recompute=True, recompute_ops=[";
          for (size_t i = 0; i < d.recompute_ops.size(); ++i) s += (i ? ", " : "") + std::to_string(d.recompute_ops[i]);
          s += "], recompute_at_op=" + std::to_string(d.recompute_at_op);
        }
        return s + ")";
      });

  py::class_<Plan>(m, "Plan", "Which activations leave the device and when (See Note [Plan semantics] in plan.h)")
      .def(py::init<>())
      .def_readwrite("planner", &Plan::planner)
      .def_readwrite("budget_bytes", &Plan::budget_bytes)
      // See Note [Element lists are copies] (bind_trace.cpp): elements by value, never into the vector.
      .def_property(
          "decisions", [](const Plan& p) { return std::vector<TensorDecision>(p.decisions); },
          [](Plan& p, std::vector<TensorDecision> v) { p.decisions = std::move(v); },
          "list of TensorDecision (copies; assign the whole list)")
      .def_readwrite("objective", &Plan::objective)
      .def_readwrite("objective_name", &Plan::objective_name)
      .def_readwrite("copies_on_compute_stream", &Plan::copies_on_compute_stream)
      .def("num_offloaded", &Plan::num_offloaded)
      .def("offloaded_bytes", &Plan::offloaded_bytes, py::arg("trace"))
      .def("num_recomputed", &Plan::num_recomputed)
      .def("recomputed_bytes", &Plan::recomputed_bytes, py::arg("trace"))
      .def("recomputed_tensor_ids", [](const Plan& p) {
        std::vector<int64_t> ids;
        for (const auto& d : p.decisions)
          if (d.recompute) ids.push_back(d.tensor_id);
        return ids;
      })
      .def("offloaded_tensor_ids", [](const Plan& p) {
        std::vector<int64_t> ids;
        for (const auto& d : p.decisions)
          if (d.offload) ids.push_back(d.tensor_id);
        return ids;
      })
      .def("__repr__", [](const Plan& p) {
        return "Plan(planner='" + p.planner + "', budget_bytes=" + std::to_string(p.budget_bytes) +
               ", offloaded=" + std::to_string(p.num_offloaded()) + "/" + std::to_string(p.decisions.size()) +
               (p.num_recomputed() ? ", recomputed=" + std::to_string(p.num_recomputed()) : std::string()) + ")";
      });

  py::class_<TimelineEvent>(m, "TimelineEvent")
      .def_property_readonly("stream", [](const TimelineEvent& e) { return std::string(to_string(e.stream)); })
      .def_property_readonly("kind", [](const TimelineEvent& e) { return std::string(to_string(e.kind)); })
      .def_readonly("id", &TimelineEvent::id)
      .def_readonly("start_us", &TimelineEvent::start_us)
      .def_readonly("end_us", &TimelineEvent::end_us)
      .def_readonly("bytes", &TimelineEvent::bytes)
      .def("__repr__", [](const TimelineEvent& e) {
        return std::string("TimelineEvent(") + to_string(e.stream) + ", " + to_string(e.kind) + " " +
               std::to_string(e.id) + ", " + std::to_string(e.start_us) + "-" + std::to_string(e.end_us) + " us)";
      });

  py::class_<SimResult>(m, "SimResult", "What simulate() predicts for one step")
      .def_readonly("step_time_us", &SimResult::step_time_us)
      .def_readonly("compute_us", &SimResult::compute_us)
      .def_readonly("stall_us", &SimResult::stall_us)
      .def_readonly("recompute_us", &SimResult::recompute_us, "compute-stream time spent replaying recompute_ops")
      .def_readonly("stall_us_per_op", &SimResult::stall_us_per_op)
      .def_readonly("op_start_us", &SimResult::op_start_us)
      .def_readonly("op_end_us", &SimResult::op_end_us)
      .def_readonly("peak_bytes", &SimResult::peak_bytes)
      .def_readonly("peak_time_us", &SimResult::peak_time_us)
      .def_readonly("peak_op", &SimResult::peak_op)
      .def_readonly("bytes_to_host", &SimResult::bytes_to_host)
      .def_readonly("bytes_to_device", &SimResult::bytes_to_device)
      .def_readonly("budget_bytes", &SimResult::budget_bytes)
      .def_readonly("over_budget", &SimResult::over_budget)
      .def_readonly("events", &SimResult::events)
      .def_property_readonly("memory", [](const SimResult& r) {
        std::vector<std::pair<double, int64_t>> out;
        out.reserve(r.memory.size());
        for (const auto& s : r.memory) out.emplace_back(s.time_us, s.bytes);
        return out;
      }, "[(time_us, bytes in use from then on), ...]")
      .def_property_readonly("timeline", [](const SimResult& r) {
        py::dict streams;
        for (Stream s : {Stream::kCompute, Stream::kD2H, Stream::kH2D}) streams[to_string(s)] = py::list();
        for (const auto& e : r.events) {
          py::dict d;
          d["kind"] = to_string(e.kind);
          d["id"] = e.id;
          d["start_us"] = e.start_us;
          d["end_us"] = e.end_us;
          d["bytes"] = e.bytes;
          streams[to_string(e.stream)].cast<py::list>().append(d);
        }
        py::list mem;
        for (const auto& s : r.memory) mem.append(py::make_tuple(s.time_us, s.bytes));
        streams["memory"] = mem;
        return streams;
      }, "{'compute': [event dicts], 'd2h': [...], 'h2d': [...], 'memory': [(time_us, bytes)]}")
      .def("check_invariants", &SimResult::check_invariants, py::arg("trace"), py::arg("plan"))
      .def("__repr__", [](const SimResult& r) {
        return "SimResult(step_time_us=" + std::to_string(r.step_time_us) + ", stall_us=" + std::to_string(r.stall_us) +
               ", peak_bytes=" + std::to_string(r.peak_bytes) + ")";
      });

  m.def("planner_names", &planner_names, "registered planner names, in table order");
  m.def("planner_description", [](const std::string& name) { return create_planner(name)->description(); },
        py::arg("name"));
  m.def("make_plan", &make_plan, py::arg("trace"), py::arg("device"), py::arg("budget_bytes"), py::arg("planner"),
        py::call_guard<py::gil_scoped_release>());
  m.def("simulate", &simulate, py::arg("trace"), py::arg("plan"), py::arg("device"),
        py::call_guard<py::gil_scoped_release>());
  m.def("validate_plan", [](const Trace& t, const Plan& p) { validate_plan(t, analyze_offload(t), p); },
        py::arg("trace"), py::arg("plan"));
  m.def("least_budget_bytes", [](const Trace& t) { return least_budget_bytes(analyze_offload(t)); },
        py::arg("trace"), "the least budget any plan can reach on this trace");
  m.def("modelled_memory", [](const Trace& t, const Plan& p) { return modelled_memory(analyze_offload(t), p.decisions); },
        py::arg("trace"), py::arg("plan"), "bytes on the device during each op if copies were instantaneous");
  m.def("is_uninitialized_factory_name", &is_uninitialized_factory_name, py::arg("op_name"),
        "whether an op makes uninitialised memory (empty, empty_like, ...): Note [Memory filled outside the "
        "dispatcher] in csrc/core/recompute.cpp");
  m.def("recompute_chain",
        [](const Trace& t, int64_t tensor_id, const Plan* plan) {
          const OffloadAnalysis a = analyze_offload(t);
          MEMSCHED_CHECK(tensor_id >= 0 && tensor_id < static_cast<int64_t>(a.candidate_index.size()) &&
                             a.candidate_index[tensor_id] >= 0,
                         "recompute_chain: tensor_id ", tensor_id, " is not an offloadable activation of this trace "
                         "(see offloadable_tensor_ids(trace))");
          std::vector<TensorDecision> decisions;
          if (plan != nullptr) {
            validate_plan(t, a, *plan);
            decisions = plan->decisions;
          }
          const RecomputeChain c = recompute_chain(t, a, a.candidate_index[tensor_id], decisions);
          py::dict out;
          out["feasible"] = c.feasible;
          out["ops"] = c.ops;
          out["rng"] = c.rng;
          out["why"] = c.why;
          return out;
        },
        py::arg("trace"), py::arg("tensor_id"), py::arg("plan") = nullptr,
        "the forward ops replaying an activation from its nearest kept inputs if it were recomputed (every other "
        "activation kept, or under `plan`; empty when an earlier replay of the plan recreates it): "
        "{'feasible', 'ops', 'rng', 'why'} (See Note [Recompute model])");
  m.def("offloadable_tensor_ids", [](const Trace& t) {
        std::vector<int64_t> ids;
        for (const auto& c : analyze_offload(t).candidates) ids.push_back(c.tensor_id);
        return ids;
      }, py::arg("trace"));
  m.def("synthetic_trace",
        [](int64_t num_layers, int64_t ops_per_layer, int64_t min_bytes, int64_t max_bytes, double min_op_us,
           double max_op_us, double skip_probability, uint64_t seed) {
          SyntheticTraceOptions o;
          o.num_layers = num_layers;
          o.ops_per_layer = ops_per_layer;
          o.min_bytes = min_bytes;
          o.max_bytes = max_bytes;
          o.min_op_us = min_op_us;
          o.max_op_us = max_op_us;
          o.skip_probability = skip_probability;
          o.seed = seed;
          return make_synthetic_trace(o);
        },
        py::arg("num_layers") = 8, py::arg("ops_per_layer") = 2, py::arg("min_bytes") = 1 << 20,
        py::arg("max_bytes") = 8 << 20, py::arg("min_op_us") = 50.0, py::arg("max_op_us") = 500.0,
        py::arg("skip_probability") = 0.25, py::arg("seed") = 1,
        "a random layered training-step Trace (see csrc/core/synthetic_trace.h)");
}

}  // namespace memsched::bindings
