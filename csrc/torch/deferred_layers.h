// deferred_layers.h -- the autograd Functions of out-of-order backward, in C++: forward is
// F.linear / F.convNd; backward returns dX at once and hands dW and db to a DwRuntime as one
// DwItem (See Note [dW runtime in C++] in dw_runtime.h).
//
// Entry points: deferred_linear(), deferred_conv(), called by the forwards that
// OutOfOrderBackward patches onto eligible layers.
//
// Note [Same kernels, same order]
//   Rationale: a deferred gradient must equal plain autograd's bit for bit, or
//   the fused update drifts from a plain training loop.
//   Approach: forward calls the ops the functional PyTorch calls do (at::linear,
//   at::conv{1,2,3}d). Backward reproduces the kernels autograd runs:
//     Linear (addmm / mm after flattening leading dims):
//       dX = grad.matmul(W)                 (mm_mat1_backward: grad.mm(mat2.t()))
//       dW = grad2d.t().mm(x2d)             (mm_mat2_backward for a transposed mat2)
//       db = grad2d.sum(0)                  (sum_to(grad, bias.shape))
//     Conv: aten.convolution_backward, the op ConvolutionBackward0 calls, once with
//       output_mask [dX] now and once with [dW, db] later.
//   tests/python/test_ooo.py checks bitwise equality with plain autograd
//   on CPU for 2-D/3-D/4-D Linear inputs (contiguous or not, with and without
//   bias) and Conv1d/2d/3d (groups, stride, padding, dilation).
//   Which backward passes defer: only one that runs the parameter's
//   AccumulateGrad (loss.backward()) while the executor is installed. Inside
//   torch.autograd.grad() asking for the parameter, or after remove(), the
//   gradient is returned to autograd at once (plain); a pass that does not want
//   the parameter (backward(inputs=...), autograd.grad for other tensors) gets
//   None for it.
//   Limitations: on CUDA, cuBLAS/cuDNN may choose another algorithm for a
//   separate dW call than for the fused one (workspace, split-K): equal up to
//   floating-point rounding, not bitwise.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <torch/python.h>

#include "torch/dw_runtime.h"

namespace memsched {

// weight_idx / bias_idx: the runtime's parameter indices, -1 for a parameter it does not track
// (its gradient then goes to autograd at once). graph_token: a Python object every node of the
// iteration keeps alive (Note [A failed backward] in backward.py); may be None. flat (a contiguous x of more
// than two dimensions, with a bias): at::linear's flattening happens inside and the [rows, out] output is
// returned, for the caller to view back as at::linear does (autograd's view, as plain's).
at::Tensor deferred_linear(const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, int32_t weight_idx, int32_t bias_idx,
                           pybind11::handle graph_token, bool flat = false);

at::Tensor deferred_conv(const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, std::vector<int64_t> stride,
                         std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                         int32_t weight_idx, int32_t bias_idx, pybind11::handle graph_token);

// Note [A retained graph after a fused update]
//   Rationale: with fuse_optimizer=True the last backward pass of a step updates the parameters in
//   place. A backward pass that keeps its graph (retain_graph=True) leaves nodes that saved those
//   parameters; a second pass over that graph -- which plain PyTorch runs, accumulating -- is refused
//   by out-of-order backward (kSecondBackward), but only where it reaches a deferred node. A graph
//   whose layers ran through autograd (a tied embedding and head) got PyTorch's own error instead,
//   "one of the variables needed for gradient computation has been modified by an inplace
//   operation", about an in-place change the user never made (found by fuzzing).
//   Approach: at the end of such a pass (the owner's end-of-backward callback, in the graph task),
//   guard_retained_graph() adds a pre-hook raising the out-of-order refusal to the graph's first
//   nodes (those of the graph task with no parent in it: the roots' own, or the root itself's
//   children where the engine did not count the root), so a second pass names the cause before any
//   node unpacks a saved parameter.
//   Limitations: a pass that starts below those nodes (torch.autograd.grad of an inner tensor) still
//   meets PyTorch's error where it reads a stepped parameter.
// In the current graph task: when it keeps its graph, hooks its first nodes as described; returns
// whether it did.
bool guard_retained_graph();

}  // namespace memsched
