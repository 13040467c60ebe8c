"""Throughput of pipeline schedules and of data parallelism, predicted for
hardware we do not have, from a profiled Trace and a device model.

Entry points:
  ``stage_costs(trace, stage_units, device, ...) -> list[_C.PipelineStageCost]``
  ``simulate(costs, link, schedule, microbatches=8, split_backward=True) -> _C.PipelineSimResult``
  ``simulate_data_parallel(...) -> _C.DataParallelResult``
The discrete-event model is C++ (csrc/core/pipeline_sim.h, Note [Pipeline
schedule model]); this file only turns a Trace into per-stage op times.

Note [Per-stage op times from a profile]
  Each op of the trace belongs to the stage whose unit (a module path
  prefix) matches its module path longest; ops outside every unit (the
  loss) belong to the last stage. Its time is the device model's
  (measured, or the roofline max(FLOPs / peak, bytes / HBM bandwidth) when
  the trace was profiled on another device). Forward ops are F. Backward ops
  are I (dX) except in a Linear layer (``linear_paths``), where half of each
  matrix product is W (dX = dY W and dW = dY^T X cost the same FLOPs) and
  the bias gradient (a sum) is W: the profiler records both products under
  the same op name, so the split is by FLOPs, not by op.
  Update and policy costs are memory-bound passes over the stage's
  parameters: AdamW reads p, g, m, v and writes p, m, v (7 x 4 B per fp32
  parameter); predict reads W, m, v and writes W_hat (4 x 4 B); stash copies W
  (2 x 4 B); none costs nothing.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

from memsched import _C

SIM_SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "async_1f1b")
# bytes moved per parameter byte (fp32) by one pass
UPDATE_PASSES = {"adamw": 7, "adam": 7, "sgd": 5}  # SGD with momentum: reads p, g, buf; writes p, buf
POLICY_PASSES = {"predict": 4, "stash": 2, "none": 0}
_W_SPLIT_OPS = ("mm", "addmm", "matmul", "bmm", "linear")


def link(bandwidth_gbps: float, latency_us: float) -> "_C.PipelineLink":
    lk = _C.PipelineLink()
    lk.bandwidth_gbps = float(bandwidth_gbps)
    lk.latency_us = float(latency_us)
    return lk


def _unit_of(path: str, units: Sequence[str]) -> Optional[int]:
    best, best_len = None, -1
    for i, u in enumerate(units):
        if (path == u or path.startswith(u + ".") or u == "") and len(u) > best_len:
            best, best_len = i, len(u)
    return best


def stage_costs(trace, stage_units: Sequence[Sequence[str]], device, linear_paths: Iterable[str],
                param_bytes: Sequence[int], send_bytes: Sequence[int], optimizer: str = "adamw",
                policy: str = "none", scale: float = 1.0) -> List["_C.PipelineStageCost"]:
    """Per-stage costs (See Note [Per-stage op times from a profile]).

    stage_units: for each stage, the module-path prefixes it holds. device: a memsched.DeviceModel.
    param_bytes / send_bytes: per stage. scale: multiplies every op time (e.g. micro-batch size over the
    profiled batch when the trace was taken at a smaller batch; an approximation for memory-bound ops).
    """
    if optimizer not in UPDATE_PASSES:
        raise ValueError(f"optimizer: expected one of {tuple(UPDATE_PASSES)}, got {optimizer!r}")
    if policy not in POLICY_PASSES:
        raise ValueError(f"policy: expected one of {tuple(POLICY_PASSES)}, got {policy!r}")
    K = len(stage_units)
    if len(param_bytes) != K or len(send_bytes) != K:
        raise ValueError(f"param_bytes and send_bytes need one entry per stage ({K})")
    flat = [u for us in stage_units for u in us]
    owner = [k for k, us in enumerate(stage_units) for _ in us]
    linear = set(linear_paths)
    f = [0.0] * K
    bi = [0.0] * K
    bw = [0.0] * K
    for op in trace.ops:
        if op.phase == "optimizer":
            continue
        u = _unit_of(op.module_path, flat)
        k = owner[u] if u is not None else K - 1
        t = device.op_time_us(op) * scale
        if op.phase == "forward":
            f[k] += t
        elif op.module_path in linear and (op.name.split(".")[-1] in _W_SPLIT_OPS or "mm" in op.name):
            bi[k] += t / 2
            bw[k] += t / 2
        elif op.module_path in linear and "sum" in op.name:
            bw[k] += t
        else:
            bi[k] += t
    out = []
    hbm_b_per_us = device.hbm_bw_gbps * 1e3
    for k in range(K):
        c = _C.PipelineStageCost()
        c.forward_us, c.backward_input_us, c.backward_weight_us = f[k], bi[k], bw[k]
        c.update_us = UPDATE_PASSES[optimizer] * param_bytes[k] / hbm_b_per_us
        c.policy_us = POLICY_PASSES[policy] * param_bytes[k] / hbm_b_per_us
        c.send_bytes = int(send_bytes[k]) if k < K - 1 else 0
        out.append(c)
    return out


def simulate(costs, link, schedule: str, microbatches: int = 8, split_backward: bool = True, steps: int = 0):
    """One schedule's steady-state throughput (_C.PipelineSimResult)."""
    return _C.simulate_pipeline(list(costs), link, schedule, microbatches, steps, split_backward)


def simulate_data_parallel(compute_us_per_microbatch: float, overlap_us: float, update_us: float,
                           grad_bytes: int, devices: int, microbatches: int, link):
    """Data parallelism on the same global batch (_C.DataParallelResult); See simulate_data_parallel in
    csrc/core/pipeline_sim.h."""
    return _C.simulate_data_parallel(compute_us_per_microbatch, overlap_us, update_us, int(grad_bytes), devices,
                                     microbatches, link)


def totals(costs) -> Dict[str, float]:
    """Whole-model sums of per-stage costs (for the data-parallel row)."""
    return {"forward_us": sum(c.forward_us for c in costs),
            "backward_us": sum(c.backward_input_us + c.backward_weight_us for c in costs),
            "update_us": sum(c.update_us for c in costs)}
