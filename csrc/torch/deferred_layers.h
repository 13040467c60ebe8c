// deferred_layers.h -- the autograd Functions of out-of-order backward, in C++: forward is
// F.linear / F.convNd; backward returns dX at once and hands dW and db to a DwRuntime as one
// DwItem (See Note [dW runtime in C++] in dw_runtime.h; Note [Same kernels, same order] in
// python/memsched/ooo/functions.py for the kernels and which passes defer).
//
// Entry points: deferred_linear(), deferred_conv(), called by the forwards that
// OutOfOrderBackward patches onto eligible layers.
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
// iteration keeps alive (Note [A failed backward] in backward.py); may be None.
at::Tensor deferred_linear(const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, int32_t weight_idx, int32_t bias_idx,
                           pybind11::handle graph_token);

at::Tensor deferred_conv(const std::shared_ptr<DwRuntime>& rt, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, std::vector<int64_t> stride,
                         std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                         int32_t weight_idx, int32_t bias_idx, pybind11::handle graph_token);

}  // namespace memsched
