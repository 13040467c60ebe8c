// adam_update.cpp -- see adam_update.h and Note [Adam update in C++]. Each function mirrors the
// one of torch/optim/adam.py (torch 2.14) named in its comment, line by line, for the
// configuration adam_update.h admits.
#include "torch/adam_update.h"

#include <cmath>
#include <utility>

#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>

namespace memsched {

namespace {

// Python's `1 - beta ** step` and `bc ** 0.5`: CPython's float ** is C's pow.
double one_minus_pow(double beta, double step) { return 1.0 - std::pow(beta, step); }

// A Python float passed where the op takes a Tensor (`t.mul_(beta2)`, `t / x`, `t.add_(eps)`): Python's
// argument parser makes it a wrapped-number tensor, and the op reads the scalar in the tensor's math
// type; the Scalar overload (mul_.Scalar) rounds it to the tensor's dtype first -- in bfloat16 0.95
// becomes 0.9492, another exp_avg_sq than torch's (found by fuzzing, Note [C++ Adam checked against
// torch's] in fused.py). Ops whose Python signature takes a Scalar (lerp_'s weight, addcmul_'s value)
// take a Scalar here too.
at::Tensor py_float(double v) { return at::native::wrapped_scalar_tensor(v); }

// _single_tensor_adam, capturable=False, differentiable=False.
void single_tensor_adam(const AdamHyper& h, const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& grads, const std::vector<const AdamSlot*>& slots) {
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor param = params[i];
    at::Tensor grad = h.maximize ? at::neg(grads[i]) : grads[i];
    const AdamSlot& s = *slots[i];
    s.step.add_(1);  // step_t += 1
    if (h.weight_decay != 0) {
      if (h.decoupled) {
        param.mul_(py_float(1 - h.lr * h.weight_decay));
      } else {
        grad = grad.add(param, h.weight_decay);
      }
    }
    s.exp_avg.lerp_(grad, 1 - h.beta1);
    s.exp_avg_sq.mul_(py_float(h.beta2)).addcmul_(grad, grad, 1 - h.beta2);
    const double step = s.step.item<double>();  // _get_value(step_t)
    const double bias_correction1 = one_minus_pow(h.beta1, step);
    const double bias_correction2 = one_minus_pow(h.beta2, step);
    const double step_size = h.lr / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    at::Tensor denom;
    if (h.amsgrad) {
      at::Tensor max_exp_avg_sq = s.max_exp_avg_sq;  // torch.maximum(max, exp_avg_sq, out=max)
      at::maximum_out(max_exp_avg_sq, max_exp_avg_sq, s.exp_avg_sq);
      denom = (max_exp_avg_sq.sqrt() / py_float(bias_correction2_sqrt)).add_(py_float(h.eps));
    } else {
      denom = (s.exp_avg_sq.sqrt() / py_float(bias_correction2_sqrt)).add_(py_float(h.eps));
    }
    param.addcdiv_(s.exp_avg, denom, -step_size);
  }
}

// Optimizer._group_tensors_by_device_and_dtype over the params: index lists, first-seen order.
std::vector<std::vector<size_t>> by_device_and_dtype(const std::vector<at::Tensor>& params) {
  std::vector<std::pair<std::pair<c10::Device, at::ScalarType>, std::vector<size_t>>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto key = std::make_pair(params[i].device(), params[i].scalar_type());
    auto it = groups.begin();
    while (it != groups.end() && it->first != key) ++it;
    if (it == groups.end()) {
      groups.emplace_back(key, std::vector<size_t>{});
      it = std::prev(groups.end());
    }
    it->second.push_back(i);
  }
  std::vector<std::vector<size_t>> out;
  out.reserve(groups.size());
  for (auto& g : groups) out.push_back(std::move(g.second));
  return out;
}

struct Lists {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

Lists gather(const std::vector<size_t>& idx, const AdamHyper& h, const std::vector<at::Tensor>& params,
             const std::vector<at::Tensor>& grads, const std::vector<const AdamSlot*>& slots) {
  Lists l;
  for (size_t i : idx) {
    l.params.push_back(params[i]);
    l.grads.push_back(grads[i]);
    l.exp_avgs.push_back(slots[i]->exp_avg);
    l.exp_avg_sqs.push_back(slots[i]->exp_avg_sq);
    if (h.amsgrad) l.max_exp_avg_sqs.push_back(slots[i]->max_exp_avg_sq);
    l.steps.push_back(slots[i]->step);
  }
  return l;
}

// _multi_tensor_adam, capturable=False, real dtypes, float lr and betas.
void multi_tensor_adam(const AdamHyper& h, Lists& l) {
  std::vector<at::Tensor> grads = h.maximize ? at::_foreach_neg(l.grads) : l.grads;
  if (l.steps.front().is_cpu()) {
    // torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    const at::Tensor one = at::scalar_tensor(1.0, at::TensorOptions().dtype(at::get_default_dtype()));
    at::_foreach_add_(l.steps, one, 1.0);
  } else {
    at::_foreach_add_(l.steps, 1);
  }
  if (h.weight_decay != 0) {
    if (h.decoupled) {
      at::_foreach_mul_(l.params, 1 - h.lr * h.weight_decay);
    } else if (h.maximize) {
      at::_foreach_add_(grads, l.params, h.weight_decay);
    } else {
      grads = at::_foreach_add(grads, l.params, h.weight_decay);
    }
  }
  at::_foreach_lerp_(l.exp_avgs, grads, 1 - h.beta1);
  at::_foreach_mul_(l.exp_avg_sqs, h.beta2);
  at::_foreach_addcmul_(l.exp_avg_sqs, grads, grads, 1 - h.beta2);
  grads.clear();
  std::vector<at::Scalar> step_size, bias_correction2_sqrt;
  for (const at::Tensor& step_t : l.steps) {
    const double step = step_t.item<double>();
    step_size.emplace_back((h.lr / one_minus_pow(h.beta1, step)) * -1);
    bias_correction2_sqrt.emplace_back(std::pow(one_minus_pow(h.beta2, step), 0.5));
  }
  std::vector<at::Tensor> exp_avg_sq_sqrt;
  if (h.amsgrad) {
    at::_foreach_maximum_(l.max_exp_avg_sqs, l.exp_avg_sqs);
    exp_avg_sq_sqrt = at::_foreach_sqrt(l.max_exp_avg_sqs);
  } else {
    exp_avg_sq_sqrt = at::_foreach_sqrt(l.exp_avg_sqs);
  }
  at::_foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt);
  at::_foreach_add_(exp_avg_sq_sqrt, h.eps);
  at::_foreach_addcdiv_(l.params, l.exp_avgs, exp_avg_sq_sqrt, step_size);
}

// _fused_adam, float lr, no grad scaler.
void fused_adam(const AdamHyper& h, Lists& l) {
  at::_foreach_add_(l.steps, 1);
  if (h.decoupled) {
    at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps, h.lr, h.beta1,
                      h.beta2, h.weight_decay, h.eps, h.amsgrad, h.maximize);
  } else {
    at::_fused_adam_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps, h.lr, h.beta1,
                     h.beta2, h.weight_decay, h.eps, h.amsgrad, h.maximize);
  }
}

}  // namespace

void adam_update(const AdamHyper& hyper, const std::vector<at::Tensor>& params,
                 const std::vector<at::Tensor>& grads, const std::vector<const AdamSlot*>& slots) {
  if (params.empty()) return;
  at::NoGradGuard no_grad;  // as Optimizer.step's _use_grad_for_differentiable does
  if (hyper.kernel == AdamKernel::kSingleTensor) {
    single_tensor_adam(hyper, params, grads, slots);
    return;
  }
  for (const std::vector<size_t>& idx : by_device_and_dtype(params)) {
    Lists l = gather(idx, hyper, params, grads, slots);
    if (hyper.kernel == AdamKernel::kFused) {
      fused_adam(hyper, l);
    } else {
      multi_tensor_adam(hyper, l);
    }
  }
}

}  // namespace memsched
