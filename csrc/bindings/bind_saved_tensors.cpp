// bind_saved_tensors.cpp -- the saved-tensor hot path (Note [The saved-tensor fast path]) and the
// activation numbering it shares with the profiler. Includes torch headers (See Note [One module,
// several binding files]).
#include <torch/python.h>

#include <torch/csrc/autograd/python_variable.h>

#include "bindings/bindings.h"
#include "core/check.h"
#include "torch/activation_numbering.h"
#include "torch/saved_tensor_path.h"

namespace memsched::bindings {

namespace py = pybind11;

namespace {

const at::Tensor& tensor_arg(const py::handle& obj, const char* where) {
  MEMSCHED_CHECK(THPVariable_Check(obj.ptr()), where, ": expected a torch.Tensor, got ",
                 std::string(py::str(py::type::of(obj).attr("__name__"))));
  return THPVariable_Unpack(obj.ptr());
}

}  // namespace

void bind_saved_tensors(py::module_& m) {
  prepare_kept_type(m);
  prepare_offloaded_type(m);
  m.def("kept_pack", [](py::handle t) {
    PyObject* out = kept_pack(t.ptr());
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }, py::arg("tensor"), "Pack a saved tensor as kept, version-checked at kept_unpack (Note [Version checks]).");
  m.def("kept_unpack", [](py::handle packed) {
    PyObject* out = kept_unpack(packed.ptr());
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }, py::arg("packed"), "The tensor of a kept_pack save; raises PyTorch's error if it was modified in place.");
  m.def(
      "activation_label",
      [](int64_t ordinal, const std::string& module_path, const py::handle& tensor) {
        return activation_label(ordinal, module_path, tensor_arg(tensor, "activation_label"));
      },
      py::arg("ordinal"), py::arg("module_path"), py::arg("tensor"),
      "act:<ordinal>:<module_path>:<shape>:<dtype> (Note [Activation identity]).");

  py::class_<ActivationNumbering, std::shared_ptr<ActivationNumbering>>(
      m, "ActivationNumbering",
      "Numbers the saved activations of one step (Note [Activation identity]); the executor's hot "
      "path uses the same rule.")
      .def(py::init<>())
      .def("set_parameters", &ActivationNumbering::set_parameters, py::arg("parameters"))
      .def("start_step", &ActivationNumbering::start_step)
      .def(
          "number",
          [](ActivationNumbering& n, const py::handle& tensor, const std::string& module_path) -> py::object {
            const at::Tensor& t = tensor_arg(tensor, "ActivationNumbering.number");
            const StorageIdentity id = SavedTensorPath::identity_of(tensor.ptr(), t);
            const ActivationNumbering::Result r = n.number(t, id, module_path);
            if (r.ordinal < 0) return py::none();
            return py::make_tuple(r.ordinal, r.is_first_pack, n.label(r.ordinal));
          },
          py::arg("tensor"), py::arg("module_path") = "",
          "None for a parameter/buffer storage, else (ordinal, is_first_pack, label).")
      .def(
          "is_parameter",
          [](ActivationNumbering& n, const py::handle& tensor) {
            const at::Tensor& t = tensor_arg(tensor, "ActivationNumbering.is_parameter");
            return n.is_parameter(SavedTensorPath::identity_of(tensor.ptr(), t).key);
          },
          py::arg("tensor"))
      .def_property_readonly("count", &ActivationNumbering::count)
      .def_property_readonly("labels", [](const ActivationNumbering& n) { return n.labels(); });

  py::class_<SavedTensorPath, std::shared_ptr<SavedTensorPath>>(
      m, "SavedTensorPath", "The offload executor's saved-tensor hooks (Note [The saved-tensor fast path]).")
      .def(py::init([](const std::string& device, py::object owner) {
             return std::make_shared<SavedTensorPath>(at::Device(device), std::move(owner));
           }),
           py::arg("device"), py::arg("owner"))
      .def("pack_function", &SavedTensorPath::pack_function)
      .def("set_copy_engine", &SavedTensorPath::set_copy_engine, py::arg("engine"),
           "Poll this engine's completions from the hooks, in C++.")
      .def("unpack_function", &SavedTensorPath::unpack_function)
      .def("set_parameters",
           [](SavedTensorPath& p, std::vector<at::Tensor> params) { p.numbering().set_parameters(std::move(params)); },
           py::arg("parameters"))
      .def("begin_step", &SavedTensorPath::begin_step, py::arg("t0_s"))
      .def("set_schedule", &SavedTensorPath::set_schedule, py::arg("labels"), py::arg("planned"),
           py::arg("first_bwd_op"), py::arg("triggers"), py::arg("before_step") = py::tuple())
      .def("clear_schedule", &SavedTensorPath::clear_schedule)
      .def("observe", &SavedTensorPath::observe, py::arg("ordinal"))
      .def_property_readonly("backward_open", &SavedTensorPath::backward_open,
                             "A backward pass that unpacked a save of this step began and has not completed "
                             "(Note [A step whose backward raised] in offload/executor.py).")
      .def("set_trigger_nodes", &SavedTensorPath::set_trigger_nodes, py::arg("node_to_op"))
      .def("hook_nodes", &SavedTensorPath::hook_nodes, py::arg("roots"),
           "Pre-hooks on the trigger nodes behind these tensors (Note [Backward node triggers]).")
      .def("track", [](SavedTensorPath& p, const py::handle& t) { p.track(tensor_arg(t, "SavedTensorPath.track")); },
           py::arg("tensor"))
      .def("sample", &SavedTensorPath::sample)
      .def_property_readonly("lifetimes",
                             [](const SavedTensorPath& p) {
                               py::list out;
                               for (const auto& l : p.lifetimes())
                                 out.append(py::make_tuple(l.born, l.died == SavedTensorPath::kAliveClock ? -1 : l.died,
                                                           l.bytes));
                               return out;
                             },
                             "CPU: this step's tracked storages as (born, died or -1, bytes) on the step clock "
                             "(Note [Measured from birth])")
      .def("finish_step", &SavedTensorPath::finish_step,
           "CPU: the step's peak of tracked storages, each from its birth, into peak_bytes "
           "(Note [Measured from birth]).")
      .def("alive_bytes", &SavedTensorPath::alive_bytes)
      .def("label", [](SavedTensorPath& p, int64_t k) { return p.numbering().label(k); }, py::arg("ordinal"))
      .def_property_readonly("count", [](SavedTensorPath& p) { return p.numbering().count(); })
      .def_readwrite("step_active", &SavedTensorPath::step_active)
      .def_readwrite("diverged", &SavedTensorPath::diverged)
      .def_readwrite("check_fetched", &SavedTensorPath::check_fetched)
      .def_readwrite("need_poll", &SavedTensorPath::need_poll)
      .def_property("has_queued", [](const SavedTensorPath& p) { return p.has_queued; },
                    &SavedTensorPath::set_has_queued,
                    "D2H copies queued until their op has run (Note [Copies issued at the next op])")
      .def_readwrite("queued_op", &SavedTensorPath::queued_op)
      .def_property_readonly("next_op_armed", &SavedTensorPath::next_op_armed,
                             "whether the next-op callback of queued copies is registered (Note [Copies issued at the next op])")
      .def_readwrite("timeline", &SavedTensorPath::timeline)
      .def_readwrite("track_memory", &SavedTensorPath::track_memory)
      .def_readwrite("min_bytes", &SavedTensorPath::min_bytes)
      .def_readwrite("fail_next_issue", &SavedTensorPath::fail_next_issue,
                     "Tests: the next issue of queued copies raises this message.")
      .def("set_prefetches", &SavedTensorPath::set_prefetches, py::arg("prefetch_at"),
           "The plan's prefetches: {trigger op: [ordinals]} (Note [Offloaded saves in C++]).")
      .def("set_recompute", &SavedTensorPath::set_recompute, py::arg("ordinals"),
           "Ordinals the plan recomputes: their saves go to the executor's Python slow path.")
      .def("issue_copies", &SavedTensorPath::issue_copies, "Issue the queued D2H copies now.")
      .def("set_memory_guard", &SavedTensorPath::set_memory_guard, py::arg("budget_bytes"), py::arg("headroom"),
           py::arg("allocated_fn") = 0,
           "Accelerator: keep the allocator's count within budget_bytes by releasing D2H copies in flight in "
           "stream order; headroom[ordinal] = bytes the ops after it allocate; allocated_fn: address of a C "
           "function int64_t(int device) counting the installed allocator's bytes, 0 for the device "
           "allocator's own (Note [Memory guard]).")
      .def("clear_memory_guard", &SavedTensorPath::clear_memory_guard)
      .def_property_readonly("guard_budget", &SavedTensorPath::guard_budget, "0: no memory guard")
      .def_readwrite("guard_error", &SavedTensorPath::guard_error,
                     "Why the memory guard turned itself off (the allocator's count could not be read); \"\" if it did not")
      .def("allocated_bytes", &SavedTensorPath::allocated_bytes,
           "Accelerator: the allocator's count of allocated bytes now, as the memory guard reads it.")
      .def_property_readonly("offload_counters",
                             [](const SavedTensorPath& p) {
                               const auto& c = p.counters;
                               py::dict d;
                               d["offloaded"] = c.offloaded;
                               d["offloaded_bytes"] = c.offloaded_bytes;
                               d["prefetched"] = c.prefetched;
                               d["on_demand"] = c.on_demand;
                               d["late_prefetches"] = c.late_prefetches;
                               d["host_limited"] = c.host_limited;
                               d["guard_waits"] = c.guard_waits;
                               d["guard_releases"] = c.guard_releases;
                               d["guard_released_bytes"] = c.guard_released_bytes;
                               d["sampled_peak_bytes"] = c.sampled_peak_bytes;
                               d["in_flight_at_sampled_peak"] = c.in_flight_at_sampled_peak;
                               d["stall_s"] = c.stall_s;
                               return d;
                             },
                             "This step's offload counters.")
      .def("offloaded_sources", &SavedTensorPath::offloaded_sources,
           "This step's offloaded storages: [(ordinal, storage key while the device storage lives, else 0)].")
      .def("check_offload_invariants", &SavedTensorPath::check_offload_invariants)
      .def_readonly("fired_upto", &SavedTensorPath::fired_upto)
      .def_readonly("activations", &SavedTensorPath::activations)
      .def_readonly("activation_bytes", &SavedTensorPath::activation_bytes)
      .def_readonly("peak_bytes", &SavedTensorPath::peak_bytes)
      .def_readonly("samples", &SavedTensorPath::samples);
}

}  // namespace memsched::bindings
