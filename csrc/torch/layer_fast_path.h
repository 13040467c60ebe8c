// layer_fast_path.h -- the per-call fast path of a layer out-of-order backward patched, in C++.
//
// Note [Fast path of a patched layer call]
//   Rationale: a patched Linear's forward decided in Python, per call, whether the call may defer
//   its weight gradient: grad mode, the parameters' requires_grad and hooks, autocast, the input's
//   and weight's layout, the parameters' kind of use this iteration, the use count. About 17 us of
//   Python per call on CPU -- a 6-layer toy decoder's step (24 Linear calls) ran 1.13x plain with
//   ooo, and on a GPU that host time is the gap that out-of-order backward is meant to fill. The
//   autograd-kind modules' forward pre-hooks (LayerNorm, Embedding: a use count) cost a Python call
//   each too.
//   Approach: linear_fast_path() makes, per patched Linear, a C function (a METH_FASTCALL
//   PyCFunction over a capsule) that the Python forward calls first with (module, x). It takes the
//   call only in the common case, every condition the Python path checks, here in C++: grad mode
//   on, the owner's phase "forward" (the first call of an iteration goes to Python, which begins
//   it), the module's `weight`/`bias` still the registered parameters with their install-time
//   requires_grad, no caller's gradient hook on them, x, weight and bias plain Tensors or
//   Parameters (no __torch_function__ override, no torch function mode), none complex, no torch.func
//   transform and no forward-mode tangent on x (Note [Layer calls out-of-order backward leaves to
//   autograd]), no queueing executor (the owner's fast_calls), no autocast use of a deferred
//   parameter this iteration (cast_uses empty), both parameters' kind unset or deferred, a
//   row-major weight matrix, and x either a 2-D matrix that is not column-major or a contiguous
//   input of more than two dimensions whose rows and features are both above 1 (the shapes
//   _linear_rows hands over as they are). It then sets the kinds in the owner's own dict, counts
//   the use, takes the graph token and applies the deferred Linear Function, exactly what the
//   Python path does for that call. Under autocast on x's device it takes the call only where the Python path would defer it
//   in autocast's dtype (Note [Deferred calls under autocast] in backward.py): autocast's cache on, a
//   float16/bfloat16 autocast dtype, a float32 weight and bias, x in float32 or that dtype, every
//   trained parameter in the owner's eligible set with its kind unset or deferred-in-autocast; the
//   arguments cast as autocast's wrapper does (autocast_cast), the layout checks made on the casts,
//   and each parameter's region this iteration unset or this call's (the weight's cached cast, held
//   weakly in the owner's region dict). It then notes the regions, sets the kinds, counts the use and
//   applies the deferred Function to the casts. Anything else returns NotImplemented (having
//   changed nothing but autocast's cache, which the Python path's own cast then finds) and the
//   Python path decides, unchanged.
//   autograd_use_hook() is the forward pre-hook of a module owning parameters autograd handles:
//   in the forward phase with grad mode on it counts the use here; otherwise it calls the owner's
//   _note_autograd_use, as the Python hook did.
//   conv_fast_path() does the same for a patched Conv1d/2d/3d (a contiguous input of nd + 2
//   dimensions and a contiguous weight, Note [Conv weight gradients in the weight's layout]; the
//   module's padding_mode 'zeros', its stride, padding and dilation tuples and its groups are read
//   at each call, as the Python path does).
//   Limitations: the callables hold the runtime weakly: once it is gone they return
//   NotImplemented / do nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/python.h>

#include "torch/dw_runtime.h"

namespace memsched {

// fast(module, x): the deferred Linear's output for this call, or NotImplemented.
pybind11::object linear_fast_path(const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx);

// fast(module, x) for a patched Conv1d/2d/3d (nd spatial dimensions).
pybind11::object conv_fast_path(const std::shared_ptr<DwRuntime>& rt, int32_t weight_idx, int32_t bias_idx,
                                int64_t nd);

// What autocast's own wrapper of linear/conv does with each argument: the cached cast of a leaf weight
// (one per autocast region), a fresh cast of anything else eligible, the tensor itself otherwise; to the
// device type's autocast dtype (Note [Deferred calls under autocast] in backward.py).
at::Tensor autocast_cast(const at::Tensor& t, c10::DeviceType device_type);

// hook(module, args): a forward pre-hook counting one autograd use of `params` (returns None).
pybind11::object autograd_use_hook(const std::shared_ptr<DwRuntime>& rt, std::vector<int32_t> params);

}  // namespace memsched
