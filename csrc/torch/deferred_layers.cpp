// deferred_layers.cpp -- see deferred_layers.h.
#include "torch/deferred_layers.h"

#include "core/check.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <stdexcept>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <unordered_set>

namespace py = pybind11;

namespace memsched {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What one node needs in backward, in one capsule (one saved_data entry per node).
struct LayerConf : torch::CustomClassHolder {
  std::weak_ptr<DwRuntime> rt;      // expired or shut down: gradients go to autograd plainly
  int32_t weight_idx = -1;
  int32_t bias_idx = -1;
  bool has_bias = false;
  bool conv = false;
  bool flat = false;                // Linear: x flattened to rows inside, the [rows, out] output returned
  std::vector<int64_t> x_sizes;     // (flat) x's sizes, for its gradient
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
  PyObject* token = nullptr;        // owned: the iteration's graph token (Note [A failed backward])
  int64_t iteration = 0;            // the runtime's iteration this node was made in

  ~LayerConf() override {
    if (token != nullptr && Py_IsInitialized()) {
      // WARNING: a node may die on an autograd device thread; take the GIL to drop the token.
      py::gil_scoped_acquire gil;
      Py_DECREF(token);
    }
  }
};

const LayerConf& conf_of(AutogradContext* ctx) {
  return *static_cast<const LayerConf*>(ctx->saved_data.at("c").toCapsule().get());
}

c10::intrusive_ptr<LayerConf> make_conf(const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx,
                                        bool has_bias, py::handle token) {
  auto conf = c10::make_intrusive<LayerConf>();
  conf->rt = rt;
  conf->weight_idx = weight_idx;
  conf->bias_idx = bias_idx;
  conf->has_bias = has_bias;
  conf->iteration = rt->iteration;
  if (token.ptr() != nullptr && !token.is_none()) {
    conf->token = token.ptr();
    Py_INCREF(conf->token);
  }
  return conf;
}

// A node of an iteration that already ended runs in a second backward pass over a retained graph
// (retain_graph=True, or backward(inputs=...) first): refused, also when a parameter autograd handles
// (a tied embedding) began a new iteration in this pass before any deferred node ran.
constexpr const char* kSecondBackward =
    "a second backward pass over a graph whose backward already ran (retain_graph=True, or backward(inputs=...) "
    "first), or the backward of a forward made before the last backward pass ran (two forwards, then a backward "
    "of each), is not supported by out-of-order backward: each backward pass needs its own forward, run after "
    "the last backward pass, and with "
    "fuse_optimizer=True the first pass already updated, in place, the parameters this graph saved. Run forward "
    "again for each backward pass (grad_accumulation_steps=K for K passes per step), or use ooo=False / "
    "fuse_optimizer=False.";

// A refusal of out-of-order backward raised from a node: memsched._C.MemschedError (a RuntimeError), as the
// Python side raises its refusals. The engine persists a python_error and re-raises it in the caller.
[[noreturn]] void refuse(const char* message) {
  {
    py::gil_scoped_acquire gil;
    PyErr_Clear();  // what it replaces (a saved-tensor hook's error in saved_of) may have left one set
    py::object type = py::module_::import("memsched._C").attr("MemschedError");
    PyErr_SetString(type.ptr(), message);
  }
  throw python_error();
}

bool from_an_ended_iteration(const LayerConf& conf, const std::shared_ptr<DwRuntime>& rt) {
  return rt != nullptr && rt->installed && (conf.weight_idx >= 0 || conf.bias_idx >= 0) &&
         conf.iteration != rt->iteration;
}

// The node's saved (input, weight), after refusing double backward. WARNING: a second backward pass over a retained graph after
// its iteration ended (phase idle) under a fused update finds the weight already stepped, so the
// saved-tensor version check would blame an in-place op "plain PyTorch raises too" (it does not):
// name the real cause instead. Only the failing path pays for the check.
variable_list saved_of(AutogradContext* ctx, const LayerConf& conf) {
  if (at::GradMode::is_enabled()) {
    // create_graph=True: the deferred dW is computed outside autograd, so a gradient of this
    // gradient (a gradient penalty) would miss it. Refused before any parameter changes -- also
    // when this pass asks only for input gradients: dX = dY W records W, so the penalty's
    // backward would reach the weight through autograd, uncounted.
    std::shared_ptr<DwRuntime> rt = conf.rt.lock();
    if (rt != nullptr && rt->installed && (conf.weight_idx >= 0 || conf.bias_idx >= 0)) {
      refuse(
          "a backward pass with create_graph=True (double backward, e.g. a gradient penalty from "
          "torch.autograd.grad(..., create_graph=True)) through a layer memsched's out-of-order backward "
          "defers is not supported: its weight gradient is computed outside autograd, so gradients of "
          "gradients would miss it. Use ooo=False / fuse_optimizer=False for this model.");
    }
  }
  try {
    return ctx->get_saved_variables();
  } catch (const std::exception&) {
    std::shared_ptr<DwRuntime> rt = conf.rt.lock();
    if (!from_an_ended_iteration(conf, rt) && (rt == nullptr || !rt->installed || rt->phase != 0 || !rt->notify)) {
      throw;
    }
  }
  refuse(kSecondBackward);
}

// dW and db of one node: deferred to the runtime when this backward pass accumulates into
// .grad and the runtime is live; returned now when torch.autograd.grad() asks for them or the
// runtime is gone; nothing when the pass does not want them (Note [Same kernels, same order] in deferred_layers.h).
void weight_grads(AutogradContext* ctx, const LayerConf& conf, DwItem item, at::Tensor* dw, at::Tensor* db) {
  std::shared_ptr<DwRuntime> rt = conf.rt.lock();
  const bool live = rt != nullptr && rt->installed;
  bool now[2] = {false, false};
  bool defer[2] = {false, false};
  const int32_t idx[2] = {conf.weight_idx, conf.bias_idx};
  for (int k = 0; k < 2; ++k) {
    if (k == 1 && !conf.has_bias) break;
    if (!ctx->needs_input_grad(1 + k)) continue;
    if (live && idx[k] >= 0) {
      bool captured = false;
      const bool runs = engine_runs(rt->accumulator(idx[k]), &captured);
      if (captured) {
        now[k] = true;
      } else if (runs) {
        defer[k] = true;
      }
    } else {
      now[k] = true;  // plain: autograd routes it (or drops it when this pass does not want it)
    }
  }
  if (now[0] || now[1]) {
    std::vector<at::Tensor> g = compute_dw(item, now[0], now[1]);
    size_t k = 0;
    if (now[0]) *dw = std::move(g[k++]);
    if (now[1]) *db = std::move(g[k++]);
  }
  if ((defer[0] || defer[1]) && from_an_ended_iteration(conf, rt)) refuse(kSecondBackward);
  if (defer[0] || defer[1]) {
    item.weight_idx = defer[0] ? idx[0] : -1;
    item.bias_idx = defer[1] ? idx[1] : -1;
    rt->defer(std::move(item));
  }
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const c10::intrusive_ptr<LayerConf>& conf) {
    // What autograd's mm/addmm saves: x only for the weight's gradient, the weight only for x's, so an
    // in-place change of a weight whose input needs no gradient (a first layer) raises here exactly
    // when it raises in plain PyTorch.
    ctx->save_for_backward({weight.requires_grad() ? x : at::Tensor(), x.requires_grad() ? weight : at::Tensor()});
    ctx->saved_data["c"] = at::IValue::make_capsule(conf);
    // flat: at::linear's own flattening (_flatten_nd_linear's reshape and addmm) inside; the caller views
    // the [rows, out] output back outside, so that view is autograd's as plain's is (Note [Linear calls the
    // deferred path gives at::linear's own rows] in backward.py)
    at::Tensor out = conf->flat ? at::linear(x.view({-1, x.size(-1)}), weight, bias) : at::linear(x, weight, bias);
    // a view returned from a custom Function may not be changed in place (relu_), where plain PyTorch's
    // may: return it as no view
    if (out.is_view()) out = at::_unsafe_view(out, out.sizes());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const LayerConf& conf = conf_of(ctx);
    variable_list saved = saved_of(ctx, conf);
    const at::Tensor& grad = grads[0];
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      dx = grad.matmul(saved[1]);  // mm_mat1_backward
      if (conf.flat) dx = dx.reshape(conf.x_sizes);  // the backward of at::linear's reshape of x
    }
    DwItem item;
    item.x = std::move(saved[0]);
    item.grad = grad;
    weight_grads(ctx, conf, std::move(item), &dw, &db);
    return {dx, dw, db, at::Tensor()};
  }
};

struct ConvFunction : torch::autograd::Function<ConvFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const c10::intrusive_ptr<LayerConf>& conf) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["c"] = at::IValue::make_capsule(conf);
    const int64_t nd = weight.dim() - 2;
    if (nd == 1) return at::conv1d(x, weight, bias, conf->stride, conf->padding, conf->dilation, conf->groups);
    if (nd == 2) return at::conv2d(x, weight, bias, conf->stride, conf->padding, conf->dilation, conf->groups);
    return at::conv3d(x, weight, bias, conf->stride, conf->padding, conf->dilation, conf->groups);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const LayerConf& conf = conf_of(ctx);
    variable_list saved = saved_of(ctx, conf);
    const at::Tensor& grad = grads[0];
    const at::Tensor& weight = saved[1];
    const int64_t nd = weight.dim() - 2;
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      const std::vector<int64_t> bias_shape{weight.size(0)};
      const at::OptionalIntArrayRef bias_sizes =
          conf.has_bias ? at::OptionalIntArrayRef(bias_shape) : at::OptionalIntArrayRef(std::nullopt);
      dx = std::get<0>(at::convolution_backward(grad, saved[0], weight, bias_sizes, conf.stride, conf.padding,
                                                conf.dilation, false, std::vector<int64_t>(nd, 0), conf.groups,
                                                {true, false, false}));
    }
    DwItem item;
    item.conv = true;
    item.x = std::move(saved[0]);
    item.grad = grad;
    item.weight = weight;  // a parameter: alive anyway, and not final (so not updated) before the item ran
    item.stride = conf.stride;
    item.padding = conf.padding;
    item.dilation = conf.dilation;
    item.groups = conf.groups;
    weight_grads(ctx, conf, std::move(item), &dw, &db);
    return {dx, dw, db, at::Tensor()};
  }
};

}  // namespace

at::Tensor deferred_linear(const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, int32_t weight_idx, int32_t bias_idx,
                           py::handle graph_token, bool flat) {
  const bool has_bias = bias.has_value() && bias->defined();
  auto conf = make_conf(rt, weight_idx, bias_idx, has_bias, graph_token);
  if (flat) {
    MEMSCHED_CHECK(x.dim() > 2 && has_bias && x.is_contiguous(),
                   "deferred_linear: flat takes a contiguous input of more than two dimensions and a bias");
    conf->flat = true;
    conf->x_sizes = x.sizes().vec();
  }
  return LinearFunction::apply(x, weight, bias, conf);
}

namespace {

struct RefuseSecondBackward : torch::autograd::FunctionPreHook {
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& /*grads*/) override {
    refuse(kSecondBackward);
  }
};

}  // namespace

bool guard_retained_graph() {
  if (torch::autograd::get_current_graph_task_id() < 0 || !torch::autograd::get_current_graph_task_keep_graph()) {
    return false;
  }
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr || nodes->empty()) return false;
  std::unordered_set<torch::autograd::Node*> has_parent;
  for (torch::autograd::Node* n : *nodes) {
    for (const torch::autograd::Edge& e : n->next_edges()) {
      if (e.function) has_parent.insert(e.function.get());
    }
  }
  bool hooked = false;
  for (torch::autograd::Node* n : *nodes) {
    if (has_parent.count(n) != 0) continue;
    n->add_pre_hook(std::make_unique<RefuseSecondBackward>());
    hooked = true;
  }
  return hooked;
}

at::Tensor deferred_conv(const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, std::vector<int64_t> stride,
                         std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                         int32_t weight_idx, int32_t bias_idx, py::handle graph_token) {
  const bool has_bias = bias.has_value() && bias->defined();
  auto conf = make_conf(rt, weight_idx, bias_idx, has_bias, graph_token);
  conf->conv = true;
  conf->stride = std::move(stride);
  conf->padding = std::move(padding);
  conf->dilation = std::move(dilation);
  conf->groups = groups;
  return ConvFunction::apply(x, weight, bias, conf);
}

}  // namespace memsched
