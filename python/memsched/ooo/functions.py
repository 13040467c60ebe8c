"""The deferred layers' kernels and which backward passes defer. The autograd Functions
themselves are C++ (csrc/torch/deferred_layers.h, ``memsched._C.deferred_linear`` /
``deferred_conv``; See Note [dW runtime in C++] in csrc/torch/dw_runtime.h): forward is F.linear /
F.convNd, backward returns dX at once and hands dW and db to the runtime as one item.

Entry point here: ``engine_runs`` (the AccumulateGrad hooks of backward.py use it).

Note [Same kernels, same order]
  Rationale: a deferred gradient must equal plain autograd's bit for bit, or
  the fused update drifts from a plain training loop.
  Approach: forward calls the very functional PyTorch calls (F.linear,
  F.conv{1,2,3}d). Backward reproduces the kernels autograd runs:
    Linear (addmm / mm after flattening leading dims):
      dX = grad.matmul(W)                 (mm_mat1_backward: grad.mm(mat2.t()))
      dW = grad2d.t().mm(x2d)             (mm_mat2_backward for a transposed mat2)
      db = grad2d.sum(0)                  (sum_to(grad, bias.shape))
    Conv: aten.convolution_backward, the op ConvolutionBackward0 calls, once with
      output_mask [dX] now and once with [dW, db] later.
  tests/python/test_ooo.py checks bitwise equality with plain autograd
  on CPU for 2-D/3-D/4-D Linear inputs (contiguous or not, with and without
  bias) and Conv1d/2d/3d (groups, stride, padding, dilation).
  Which backward passes defer: only one that runs the parameter's
  AccumulateGrad (loss.backward()) while the executor is installed. Inside
  torch.autograd.grad() asking for the parameter, or after remove(), the
  gradient is returned to autograd at once (plain); a pass that does not want
  the parameter (backward(inputs=...), autograd.grad for other tensors) gets
  None for it.
  Limitations: on CUDA, cuBLAS/cuDNN may choose another algorithm for a
  separate dW call than for the fused one (workspace, split-K): equal up to
  floating-point rounding, not bitwise.
"""
from __future__ import annotations

from typing import Optional

import torch


def engine_runs(node) -> Optional[bool]:
    """For a parameter's AccumulateGrad node, inside backward: True when this
    backward pass accumulates into .grad (loss.backward()), False when it
    skips the parameter (backward(inputs=...) without it, or autograd.grad not
    asking for it), None inside torch.autograd.grad asking for the parameter
    (its gradient must be returned, not deferred). The C++ Functions use the
    same rule (memsched::engine_runs in csrc/torch/dw_runtime.cpp)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf's node during autograd.grad(): captured there
        return None
