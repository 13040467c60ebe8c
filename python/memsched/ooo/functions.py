"""Autograd Functions for eligible layers: the input gradient now, the weight
and bias gradients later.

Entry points: ``DeferredLinear.apply`` and ``DeferredConv.apply``; the
``DeferredWork`` they hand to the executor's ``defer()``.

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
  tests/python/test_ooo_functions.py checks bitwise equality with plain autograd
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

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

_CONV_FUNCTIONAL = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class DeferredWork:
    """One queued weight-gradient computation: holds the layer input and the
    output gradient until it runs. ``compute()`` returns one gradient per entry
    of ``param_indices`` (same order)."""

    __slots__ = ("param_indices", "held_bytes", "device", "_fn", "_tensors")

    def __init__(self, param_indices: List[int], tensors: Sequence[torch.Tensor],
                 fn: Callable[..., List[torch.Tensor]]):
        self.param_indices = param_indices
        self._tensors = tuple(tensors)
        self._fn = fn
        self.held_bytes = int(sum(t.numel() * t.element_size() for t in self._tensors))
        self.device = self._tensors[0].device

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return self._tensors

    def compute(self) -> List[torch.Tensor]:
        with torch.no_grad():
            out = self._fn(*self._tensors)
        self._tensors = ()  # release the input and output gradient
        return out


def _sink_live(sink) -> bool:
    """False once the OutOfOrderBackward that recorded this node was removed
    (or collected): a graph recorded inside the context and run backward after
    it then gets plain autograd gradients, no deferral, no fused update."""
    try:
        return bool(sink._installed)
    except ReferenceError:
        return False


def engine_runs(node) -> Optional[bool]:
    """For a parameter's AccumulateGrad node, inside backward: True when this
    backward pass accumulates into .grad (loss.backward()), False when it
    skips the parameter (backward(inputs=...) without it, or autograd.grad not
    asking for it), None inside torch.autograd.grad asking for the parameter
    (its gradient must be returned, not deferred)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf's node during autograd.grad(): captured there
        return None


def _plain_or_defer(ctx, x, grad, fn_for) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], List[int]]:
    """Decides per parameter (weight, bias) of a Deferred* node: defer (the
    pass accumulates into .grad and the executor is live), return the gradient
    now (autograd.grad asks for it, or the executor was removed), or nothing
    (the pass does not want it). Returns (dw, db, indices to defer)."""
    live = _sink_live(ctx.sink)
    defer, now = [], [False, False]
    for k, idx in enumerate(ctx.idx):
        if not ctx.needs_input_grad[1 + k]:
            continue
        runs = engine_runs(ctx.next_functions[1 + k][0])
        if live and runs and idx is not None:
            defer.append(idx)
        elif runs is None or (runs and (not live or idx is None)):
            now[k] = True
    dw = db = None
    if now[0] or now[1]:
        dw, db = _split(fn_for(now[0], now[1])(x, grad), now[0], now[1])
    return dw, db, defer


def _split(grads: List[torch.Tensor], want_w: bool, want_b: bool):
    it = iter(grads)
    return (next(it) if want_w else None), (next(it) if want_b else None)


def _linear_dw(weight_idx: Optional[int], bias_idx: Optional[int]):
    def fn(x: torch.Tensor, grad: torch.Tensor) -> List[torch.Tensor]:
        rows = math.prod(grad.shape[:-1])  # not -1: a layer with 0 features (or rows) has 0 elements
        grad2d = grad.reshape(rows, grad.shape[-1])
        out = []
        if weight_idx is not None:
            out.append(grad2d.t().mm(x.reshape(rows, x.shape[-1])))
        if bias_idx is not None:
            out.append(grad2d.sum(0))
        return out

    return fn


class DeferredLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias); backward returns dX and defers dW, db.

    ``sink`` is the executor (OutOfOrderBackward); ``weight_idx``/``bias_idx``
    are its parameter indices (None: that parameter needs no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink, weight_idx, bias_idx):
        ctx.save_for_backward(x, weight)
        ctx.sink = sink
        ctx.graph = sink.graph_token()  # See Note [A failed backward] in backward.py
        ctx.idx = (weight_idx, bias_idx)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight_idx, bias_idx = ctx.idx
        dx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        dw, db, indices = _plain_or_defer(
            ctx, x, grad, lambda w, b: _linear_dw(0 if w else None, 0 if b else None))
        if indices:
            w_i = weight_idx if weight_idx in indices else None
            b_i = bias_idx if bias_idx in indices else None
            ctx.sink.defer(DeferredWork(indices, (x, grad), _linear_dw(w_i, b_i)))
        return dx, dw, db, None, None, None


def _conv_dw(weight: torch.Tensor, has_bias: bool, want_weight: bool, stride, padding, dilation,
             groups: int):
    # The weight rides in the closure, not in the held tensors: it is a
    # parameter (alive anyway), and it is not updated before this item ran
    # because the parameter is not final until then.
    def fn(x: torch.Tensor, grad: torch.Tensor) -> List[torch.Tensor]:
        nd = weight.dim() - 2
        _, dw, db = torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if has_bias else None, stride, padding, dilation, False,
            [0] * nd, groups, [False, want_weight, has_bias])
        out = []
        if want_weight:
            out.append(dw)
        if has_bias:
            out.append(db)
        return out

    return fn


class DeferredConv(torch.autograd.Function):
    """y = F.convNd(x, weight, bias, ...) with zero padding given as numbers;
    backward returns dX and defers dW, db."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, sink, weight_idx, bias_idx):
        ctx.save_for_backward(x, weight)
        ctx.conf = (tuple(stride), tuple(padding), tuple(dilation), groups, bias is not None)
        ctx.sink = sink
        ctx.graph = sink.graph_token()  # See Note [A failed backward] in backward.py
        ctx.idx = (weight_idx, bias_idx)
        nd = weight.dim() - 2
        return _CONV_FUNCTIONAL[nd](x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias = ctx.conf
        weight_idx, bias_idx = ctx.idx
        nd = weight.dim() - 2
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten.convolution_backward(
                grad, x, weight, [weight.shape[0]] if has_bias else None, list(stride), list(padding),
                list(dilation), False, [0] * nd, groups, [True, False, False])[0]
        conf = (list(stride), list(padding), list(dilation), groups)
        dw, db, indices = _plain_or_defer(ctx, x, grad, lambda w, b: _conv_dw(weight, b, w, *conf))
        if indices:
            fn = _conv_dw(weight, bias_idx is not None and bias_idx in indices,
                          weight_idx is not None and weight_idx in indices, *conf)
            ctx.sink.defer(DeferredWork(indices, (x, grad), fn))
        return (dx, dw, db) + (None,) * 7
