// bind_ooo.cpp -- memsched._C.DwRuntime and the deferred Linear/Conv Functions of out-of-order
// backward (csrc/torch/dw_runtime.h, deferred_layers.h). Includes torch headers (See Note [One
// module, several binding files]).
#include <torch/python.h>

#include <torch/csrc/Exceptions.h>

#include "bindings/bindings.h"
#include "core/check.h"
#include "torch/deferred_layers.h"
#include "torch/dw_runtime.h"
#include "torch/layer_fast_path.h"

namespace memsched::bindings {

namespace py = pybind11;

namespace {

// (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, kernel) -> AdamHyper.
AdamHyper adam_hyper(const py::tuple& t) {
  MEMSCHED_CHECK(t.size() == 9, "adam hyper-parameters: a tuple of 9 fields, got ", t.size());
  AdamHyper h;
  h.lr = t[0].cast<double>();
  h.beta1 = t[1].cast<double>();
  h.beta2 = t[2].cast<double>();
  h.eps = t[3].cast<double>();
  h.weight_decay = t[4].cast<double>();
  h.amsgrad = t[5].cast<bool>();
  h.maximize = t[6].cast<bool>();
  h.decoupled = t[7].cast<bool>();
  const int kernel = t[8].cast<int>();
  MEMSCHED_CHECK(kernel >= 0 && kernel <= 2, "adam hyper-parameters: kernel must be 0, 1 or 2, got ", kernel);
  h.kernel = static_cast<AdamKernel>(kernel);
  return h;
}

// A Python error carried through C++ as torch's python_error is raised as the original
// exception (a MemschedError stays one), not as a RuntimeError.
template <typename F>
auto reraising(F&& f) {
  try {
    return f();
  } catch (python_error& e) {
    e.restore();
    throw py::error_already_set();
  }
}

}  // namespace

void bind_ooo(py::module_& m) {
  m.def(
      "adam_update",
      [](const py::tuple& hyper, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& exp_avgs,
         const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<std::optional<at::Tensor>>& maxes) {
        const size_t n = params.size();
        MEMSCHED_CHECK(grads.size() == n && steps.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                           maxes.size() == n,
                       "adam_update: one grad, step, exp_avg, exp_avg_sq and max_exp_avg_sq per parameter");
        std::vector<AdamSlot> slots(n);
        std::vector<const AdamSlot*> ptrs(n);
        for (size_t i = 0; i < n; ++i) {
          slots[i] = AdamSlot{steps[i], exp_avgs[i], exp_avg_sqs[i], maxes[i].value_or(at::Tensor())};
          ptrs[i] = &slots[i];
        }
        adam_update(adam_hyper(hyper), params, grads, ptrs);
      },
      py::arg("hyper"), py::arg("params"), py::arg("grads"), py::arg("steps"), py::arg("exp_avgs"),
      py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
      "The fused update's C++ Adam/AdamW step on given tensors (Note [Adam update in C++]); fused.py checks it "
      "against torch's own step once per configuration before using it.");
  py::class_<DwRuntime, std::shared_ptr<DwRuntime>>(
      m, "DwRuntime", "Out-of-order backward's dW queue, pending sums and streams (Note [dW runtime in C++]).")
      .def(py::init([](int64_t max_deferred_bytes, const std::string& executor, py::object owner) {
             return std::make_shared<DwRuntime>(max_deferred_bytes, executor, std::move(owner));
           }),
           py::arg("max_deferred_bytes"), py::arg("executor"), py::arg("owner"))
      .def("add_param", &DwRuntime::add_param, py::arg("param"), py::arg("bucket") = -1)
      .def("begin_iteration", &DwRuntime::begin_iteration, py::arg("last_micro_step"))
      .def("expect_contribution", &DwRuntime::expect_contribution, py::arg("param"))
      .def("expected", &DwRuntime::expected, py::arg("param"))
      .def("received", &DwRuntime::received, py::arg("param"))
      .def_property_readonly("queued", &DwRuntime::queued)
      .def("run", [](DwRuntime& rt, bool urgent_only) { reraising([&] { rt.run(urgent_only); }); },
           py::arg("urgent_only"))
      .def("drain",
           [](DwRuntime& rt) {
             reraising([&] {
               py::gil_scoped_release release;
               rt.drain();
             });
           })
      .def("contribute", [](DwRuntime& rt, int32_t i) { reraising([&] { rt.contribute(i); }); }, py::arg("param"))
      .def("add_autograd_grad", &DwRuntime::add_autograd_grad, py::arg("param"), py::arg("grad"))
      .def("end_iteration", [](DwRuntime& rt, bool allow) { reraising([&] { rt.end_iteration(allow); }); },
           py::arg("allow_missing") = false)
      .def("sync_streams", &DwRuntime::sync_streams)
      .def("abandon",
           [](DwRuntime& rt) {
             py::gil_scoped_release release;  // waits for the worker, which may need the GIL
             rt.abandon();
           })
      .def("shutdown", [](DwRuntime& rt) { rt.shutdown(); })
      .def("track", &DwRuntime::track_locked, py::arg("delta_bytes"), py::arg("transient_bytes") = 0)
      .def("start_tracking", &DwRuntime::start_tracking)
      .def("note_deferred_use", &DwRuntime::note_deferred_use, py::arg("weight_idx"), py::arg("bias_idx"))
      .def("note_autograd_use", &DwRuntime::note_autograd_use, py::arg("params"))
      .def("grad_hook", &DwRuntime::grad_hook, py::arg("param"))
      .def("accumulated_hook", &DwRuntime::accumulated_hook, py::arg("param"))
      .def_readwrite("phase", &DwRuntime::phase)
      .def_readwrite("fast_calls", &DwRuntime::fast_calls)
      .def("first_regraded", &DwRuntime::first_regraded,
           "The first parameter converted (dtype or device) since it was registered, whose AccumulateGrad node is "
           "new, or -1.")
      .def("set_iteration_dicts", &DwRuntime::set_iteration_dicts, py::arg("kind"), py::arg("cast_uses"),
           "The owner's per-iteration kind and cast_uses dicts, which the layers' fast path reads and writes in "
           "place (Note [Fast path of a patched layer call]).")
      .def("set_cast_state", &DwRuntime::set_cast_state, py::arg("region"), py::arg("eligible"), py::arg("mixed"),
           "The owner's autocast region dict, eligible set and mixed marker, which the fast path of a call under "
           "autocast reads and writes in place (Note [Deferred calls under autocast]).")
      .def("set_graph", &DwRuntime::set_graph, py::arg("graph"), py::arg("graph_ref"))
      .def("graph_token", &DwRuntime::graph_token,
           "The object every Deferred* node of this iteration keeps (Note [A failed backward]).")
      .def(
          "linear_fast_path",
          [](const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx) {
            return linear_fast_path(rt, weight_idx, bias_idx);
          },
          py::arg("weight_idx"), py::arg("bias_idx"),
          "fast(module, x) for a patched Linear: its deferred output, or NotImplemented when the Python path "
          "must decide (Note [Fast path of a patched layer call]).")
      .def(
          "conv_fast_path",
          [](const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx, int64_t nd) {
            return conv_fast_path(rt, weight_idx, bias_idx, nd);
          },
          py::arg("weight_idx"), py::arg("bias_idx"), py::arg("nd"),
          "fast(module, x) for a patched Conv1d/2d/3d (nd spatial dimensions): its deferred output, or "
          "NotImplemented (Note [Fast path of a patched layer call]).")
      .def(
          "autograd_use_hook",
          [](const std::shared_ptr<DwRuntime>& rt, std::vector<int32_t> params) {
            return autograd_use_hook(rt, std::move(params));
          },
          py::arg("params"), "A forward pre-hook counting one autograd use of `params`.")
      .def("set_units", &DwRuntime::set_units, py::arg("unit_of"))
      .def("take_partial_units", &DwRuntime::take_partial_units)
      .def_readonly("installed", &DwRuntime::installed)
      .def_readwrite("notify", &DwRuntime::notify)
      .def_property(
          "fused", [](const DwRuntime& rt) { return rt.fused; }, &DwRuntime::set_fused,
          "Whether the owner steps parameters during backward (counted process-wide until shutdown()).")
      .def("held_params", &DwRuntime::held_params)
      .def("params_with_grad", &DwRuntime::params_with_grad,
           "Indices of the registered parameters whose .grad is defined, ascending.")
      .def_property("watching", &DwRuntime::watching, &DwRuntime::set_watch,
                    "Whether every parameter is held while a ParameterReadWatch observes the iteration's "
                    "reads; set False, the parameters it saw read are held from then on.")
      .def_readonly("holds", &DwRuntime::holds)
      .def("snapshot_versions", &DwRuntime::snapshot_versions)
      .def("first_changed_version", &DwRuntime::first_changed_version, py::arg("start") = 0)
      .def_readwrite("poll_after_defer", &DwRuntime::poll_after_defer)
      .def_readwrite("backward_started", &DwRuntime::backward_started)
      .def_readonly("grad_bytes", &DwRuntime::grad_bytes)
      .def_readonly("peak_grad_bytes", &DwRuntime::peak_grad_bytes)
      .def_property_readonly("max_deferred_bytes", &DwRuntime::max_deferred_bytes)
      .def("stats", [](DwRuntime& rt) { return dw_stats_dict(rt.stats()); })
      .def(
          "set_adam",
          [](DwRuntime& rt, const std::vector<py::tuple>& hypers, std::vector<int32_t> group_of,
             const std::vector<std::optional<at::Tensor>>& steps, const std::vector<std::optional<at::Tensor>>& exp_avgs,
             const std::vector<std::optional<at::Tensor>>& exp_avg_sqs,
             const std::vector<std::optional<at::Tensor>>& max_exp_avg_sqs) {
            std::vector<AdamHyper> hs;
            for (const py::tuple& t : hypers) hs.push_back(adam_hyper(t));
            const size_t n = group_of.size();
            MEMSCHED_CHECK(steps.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                               max_exp_avg_sqs.size() == n,
                           "DwRuntime.set_adam: one step, exp_avg, exp_avg_sq and max_exp_avg_sq per parameter");
            std::vector<AdamSlot> slots(n);
            for (size_t i = 0; i < n; ++i) {
              if (group_of[i] < 0) continue;
              slots[i] = AdamSlot{steps[i].value_or(at::Tensor()), exp_avgs[i].value_or(at::Tensor()),
                                  exp_avg_sqs[i].value_or(at::Tensor()), max_exp_avg_sqs[i].value_or(at::Tensor())};
            }
            rt.set_adam(std::move(hs), std::move(group_of), std::move(slots));
          },
          py::arg("hypers"), py::arg("group_of"), py::arg("steps"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
          py::arg("max_exp_avg_sqs"),
          "For this backward pass: the fused update of Adam/AdamW parameters runs in C++ (Note [Adam update in "
          "C++]); hypers: (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, kernel 0 single "
          "tensor / 1 foreach / 2 fused) per param group; group_of[p] < 0: p is stepped in Python.")
      .def(
          "set_adam_hypers",
          [](DwRuntime& rt, const std::vector<py::tuple>& hypers) {
            std::vector<AdamHyper> hs;
            for (const py::tuple& t : hypers) hs.push_back(adam_hyper(t));
            rt.set_adam_hypers(std::move(hs));
          },
          py::arg("hypers"), "The plan set last, with new hyper-parameters per param group (an LR scheduler stepped).")
      .def_property_readonly("has_adam", &DwRuntime::has_adam)
      .def("clear_adam", &DwRuntime::clear_adam)
      .def("set_hook_dicts", &DwRuntime::set_hook_dicts, py::arg("param"), py::arg("tensor_hooks"),
           py::arg("post_hooks"), py::arg("own_post_key"),
           "The parameter's _backward_hooks and _post_accumulate_grad_hooks, and the key of memsched's own "
           "post-accumulate-grad hook (Note [Parameters with gradient hooks]).")
      .def("first_hooked_deferred", &DwRuntime::first_hooked_deferred,
           "The first parameter a deferred use of this iteration feeds that now carries a caller's hook, or -1.")
      .def("post_hooks_last", &DwRuntime::post_hooks_last,
           "Moves memsched's post-accumulate-grad hook behind the caller's wherever it is not last.")
      .def("take_native_stepped", &DwRuntime::take_native_stepped,
           "The parameters (indices) the C++ Adam update stepped since the last call.")
      .def("step_native", &DwRuntime::step_native, py::arg("params"))
      .def_property_readonly("native_updates", &DwRuntime::native_updates)
      .def_property_readonly("native_calls", &DwRuntime::native_calls)
      .def_property("update_batch_bytes", &DwRuntime::update_batch_bytes, &DwRuntime::set_update_batch_bytes,
                    "Complete step units wait until their gradients reach this many bytes, then are updated "
                    "together; 0: each unit at once (Note [Update batches] in backward.py).");

  m.def(
      "autocast_cast",
      [](const at::Tensor& t, const std::string& device_type) {
        return autocast_cast(t, c10::Device(device_type).type());
      },
      py::arg("t"), py::arg("device_type"),
      "at::autocast::cached_cast to the device type's autocast dtype (Note [Deferred calls under autocast]).");
  m.def("note_backward_parameter_read", &note_backward_parameter_read, py::arg("t"),
        "The profiler saw backward read t, on a parameter's storage: a parameter whose gradient is already final "
        "is held to the end of backward from now on (Note [The profiled step updates after backward]).");
  m.def("fused_update_installed", &fused_update_installed,
        "Whether an out-of-order backward with the fused update is installed (a DwRuntime with fused set).");
  m.def("guard_retained_graph", &guard_retained_graph,
        "In a backward pass that keeps its graph: pre-hooks on its first nodes that refuse a second pass over it "
        "(Note [A retained graph after a fused update]); whether it hooked any.");
  m.def(
      "deferred_linear",
      [](const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, int32_t weight_idx, int32_t bias_idx, py::handle token, bool flat) {
        return deferred_linear(rt, x, weight, bias, weight_idx, bias_idx, token, flat);
      },
      py::arg("rt"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("weight_idx"), py::arg("bias_idx"),
      py::arg("graph_token"), py::arg("flat") = false,
      "F.linear whose backward returns dX and defers dW, db to rt (flat: the [rows, out] output of a flattened "
      "input with a bias, for the caller to view back).");
  m.def(
      "deferred_conv",
      [](const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, std::vector<int64_t> stride, std::vector<int64_t> padding,
         std::vector<int64_t> dilation, int64_t groups, int32_t weight_idx, int32_t bias_idx, py::handle token) {
        return deferred_conv(rt, x, weight, bias, std::move(stride), std::move(padding), std::move(dilation),
                             groups, weight_idx, bias_idx, token);
      },
      py::arg("rt"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
      py::arg("dilation"), py::arg("groups"), py::arg("weight_idx"), py::arg("bias_idx"), py::arg("graph_token"),
      "F.conv1d/2d/3d (zero padding given as numbers) whose backward returns dX and defers dW, db to rt.");
}

}  // namespace memsched::bindings
