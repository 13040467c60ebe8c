// adam_update.h -- torch.optim.Adam / AdamW's update of one ready group of parameters, in C++:
// the fused update of out-of-order backward (dw_runtime.h) runs it for a layer whose gradients
// became final, with no Python on the way.
//
// Entry point: adam_update(hyper, params, grads, slots).
//
// Note [Adam update in C++]
//   Rationale: the fused update called torch's functional adam() from Python once per ready
//   group (a layer's weight and bias): about 50 us a call on CPU for 2 parameters, where
//   the kernels themselves take a fraction of that. On a 6-layer toy decoder the fused update
//   ran at 1.37-1.41x a plain step (issue 13's goal: at most 1.20x).
//   Approach: the same ATen ops, in the same order, with the same scalar arguments, as the
//   implementation torch.optim would pick for the parameters' group -- _single_tensor_adam,
//   _multi_tensor_adam (foreach) or _fused_adam (torch 2.14's torch/optim/adam.py) -- for the
//   configuration those share with a plain float hyper-parameter setup: non-capturable,
//   non-differentiable, float lr and betas, no grad scaler, real dtypes. Scalars are computed
//   in double exactly as the Python floats are (1 - beta1 ** step with the step's item(), C's
//   pow as CPython's float ** calls it), so the result is bitwise torch's. The Python side
//   (fused.py's ParamStepper.native_plan) decides per param group whether this applies and
//   gathers each parameter's state tensors (optimizer.state[p]) once per backward pass; any
//   other configuration, a parameter whose state torch has not created yet (its first step),
//   step hooks, or a replaced step() take the Python path.
//   Limitations: Adam and AdamW only (SGD stays on the Python path); no profiler range
//   "Optimizer.step#..." for these updates.
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace memsched {

enum class AdamKernel { kSingleTensor = 0, kForeach = 1, kFused = 2 };

// One param group's hyper-parameters, read at the start of the backward pass.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled = false;  // AdamW's decoupled weight decay
  AdamKernel kernel = AdamKernel::kSingleTensor;
};

// One parameter's optimizer state: the tensors of torch's optimizer.state[p] (shared, updated in
// place).
struct AdamSlot {
  at::Tensor step;            // 0-dim float; on CPU unless the group is fused
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
  at::Tensor max_exp_avg_sq;  // amsgrad only
};

// Updates params in place from grads (dense, defined), as torch.optim would for a group with
// `hyper`; the state in slots[i] belongs to params[i].
void adam_update(const AdamHyper& hyper, const std::vector<at::Tensor>& params,
                 const std::vector<at::Tensor>& grads, const std::vector<const AdamSlot*>& slots);

}  // namespace memsched
