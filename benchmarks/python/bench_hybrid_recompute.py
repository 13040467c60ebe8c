"""Executed recompute on CPU: memsched hybrid against plain PyTorch and per-block checkpointing.

memsched.models' "realistic" transformer (d_model 256, 4 layers, seq 128), batch 4, CPU, one
intra-op thread. Rows, each stepped alternately with plain PyTorch (interleaved medians):
  - checkpoint per block: torch.utils.checkpoint (non-reentrant) around every block, what users
    pick instead;
  - memsched hybrid at 50% and 30% of the activation memory, planned for a device whose copies
    take seconds, so the plan recomputes wherever it can (on this CPU a "copy" is a host memcpy;
    recompute is what is measured here);
  - memsched dp at 50% (offload only), for contrast.
Each memsched row prints the measured saved-activation peak against the keep-all one, what it
recomputed, and the host time of the replays.

These are CPU figures: the forward of a recomputing step runs under a Python dispatch mode
(Note [Unpack-time recompute]) whose per-op cost a GPU step hides only partly; issue 12's GPU
targets (hybrid at 50% within 1.05x of plain eager) are measured by benchmarks/gpu/bench_offload.py.

test_recording_host_overhead: the host cost of that dispatch mode on a host-bound model (the
"small" transformer b8, many small ops), per forward op, against the same model under a keep-all
Run with its saved-tensor hooks on (the hooks both rows pay).

Run: python3 -m pytest -q -s benchmarks/python/bench_hybrid_recompute.py
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import memsched
from bench_common import interleaved_medians, one_thread  # noqa: F401 (autouse fixture)
from memsched import models
from memsched.optimize import optimize

ROUNDS = 15
BATCH = 4


def _slow_copies():
    d = memsched.DeviceModel()
    d.name = "slow-copies"
    d.d2h_bw_gbps = d.h2d_bw_gbps = 1e-3
    d.d2h_latency_us = d.h2d_latency_us = 1e6
    return d


def _setup():
    torch.manual_seed(0)
    model = models.build_model("transformer", "realistic")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = models.make_step_fn(model, "transformer", BATCH, "realistic")

    def train_step():
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step, train_step


ROWS = {
    "checkpoint per block": None,
    "memsched hybrid 50%": dict(budget=0.5, planner="hybrid", device_model="slow"),
    "memsched hybrid 30%": dict(budget=0.3, planner="hybrid", device_model="slow"),
    "memsched dp 50%": dict(budget=0.5, planner="dp"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_step_time_against_plain(benchmark, row):
    _, _, _, plain = _setup()
    model, opt, step, train_step = _setup()
    kwargs = ROWS[row]
    info = {}
    if kwargs is None:
        for block in model.blocks:
            block.forward = (lambda f: (lambda x: checkpoint(f, x, use_reentrant=False)))(block.forward)
        plain_s, row_s = interleaved_medians(plain, train_step, ROUNDS)
        measured = train_step
        run = None
    else:
        if kwargs.get("device_model") == "slow":
            kwargs = dict(kwargs, device_model=_slow_copies())
        run = optimize(model, opt, **kwargs).__enter__()

        def measured():
            step()
            run.step()

        measured()  # profiled
        plain_s, row_s = interleaved_medians(plain, measured, ROUNDS)
        s = run.step_stats[-1]
        info = dict(peak_saved_bytes=s.peak_bytes, activation_bytes=run.trace.activation_bytes(),
                    budget_bytes=run.budget_bytes, recomputed=s.recomputed, recomputed_bytes=s.recomputed_bytes,
                    recompute_kept=s.recompute_kept, replay_ms=s.replay_s * 1e3, offloaded=s.offloaded)
    try:
        benchmark.group = f"executed recompute: realistic transformer b{BATCH}, CPU, 1 thread"
        benchmark.pedantic(measured, rounds=3, warmup_rounds=0)
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    benchmark.extra_info.update(row=row, plain_median_ms=plain_s * 1e3, row_median_ms=row_s * 1e3,
                                ratio_vs_plain=row_s / plain_s, **info)
    extra = ""
    if info:
        extra = (f"; saved-activation peak {info['peak_saved_bytes'] / 2**20:.1f} MiB (budget "
                 f"{info['budget_bytes'] / 2**20:.1f} MiB), recomputed {info['recomputed']} "
                 f"({info['recomputed_bytes'] / 2**20:.1f} MiB, {info['recompute_kept']} kept instead), "
                 f"offloaded {info['offloaded']}, replay {info['replay_ms']:.2f} ms")
    print(f"\n{row}: plain median {plain_s * 1e3:.2f} ms, row median {row_s * 1e3:.2f} ms: "
          f"{row_s / plain_s:.2f}x{extra}")


def test_recording_host_overhead(benchmark):
    """Host time a recomputing step spends recording its forward (Note [Unpack-time recompute]), per
    forward op: hybrid at 50% (slow copies, so it recomputes) against a keep-all Run with its hooks
    on, stepped alternately; the replays' own host time is taken out.

    Measured on this machine (2 cores, idle, one thread, 60 interleaved rounds, two runs each; 62
    counted forward ops, ~165 dispatched with the views, 22 recorded, 7 activations recomputed):
      records flattened by torch's pytree:   1.83-1.84x keep-all, 39-44 us per forward op;
      records flattened by _flatten_call:    1.72-1.75x, 36.5-37 us per forward op.
    For scale: PyTorch's dispatch mode with an identity __torch_dispatch__ costs ~3.9 us per
    dispatched op here, a recorded op ~7.5 us more, and the recomputed saves' Python packs the rest:
    the recompute path is Python (Note [Unpack-time recompute], Limitations).
    """
    torch.manual_seed(0)
    keep_model = models.build_model("transformer", "small")
    keep_opt = torch.optim.AdamW(keep_model.parameters(), lr=1e-4)
    keep_step = models.make_step_fn(keep_model, "transformer", 8)
    torch.manual_seed(0)
    model = models.build_model("transformer", "small")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = models.make_step_fn(model, "transformer", 8)
    rounds = 60
    with optimize(keep_model, keep_opt, budget=None) as keep_run, \
            optimize(model, opt, budget=0.5, planner="hybrid", device_model=_slow_copies()) as run:
        def keep_step_fn():
            keep_step()
            keep_run.step()

        def hybrid_step_fn():
            step()
            run.step()

        keep_step_fn()
        keep_run.executor.hookless = False  # hooked keep-all: the saved-tensor hooks both rows pay
        hybrid_step_fn()  # profiled
        keep_s, hybrid_s = interleaved_medians(keep_step_fn, hybrid_step_fn, rounds)
        stats = run.step_stats[-1]
        forward_ops = sum(1 for op in run.trace.ops if op.phase == "forward")
        recorded = len(run.executor.schedule.recompute_ops)
        assert run.mismatches == 0 and stats.recomputed > 0
        benchmark.group = "executed recompute: small transformer b8, CPU, 1 thread, recording"
        benchmark.pedantic(hybrid_step_fn, rounds=rounds, warmup_rounds=2)
    per_op_us = (hybrid_s - keep_s - stats.replay_s) / forward_ops * 1e6
    benchmark.extra_info.update(keep_all_hooked_median_ms=keep_s * 1e3, hybrid_median_ms=hybrid_s * 1e3,
                                replay_ms=stats.replay_s * 1e3, forward_ops=forward_ops, recorded_ops=recorded,
                                recomputed=stats.recomputed, overhead_us_per_forward_op=per_op_us)
    print(f"\nsmall transformer b8, CPU, 1 thread, hybrid 50%: keep-all (hooked) {keep_s * 1e3:.3f} ms, hybrid "
          f"{hybrid_s * 1e3:.3f} ms ({hybrid_s / keep_s:.2f}x), replay {stats.replay_s * 1e3:.3f} ms; "
          f"{forward_ops} forward ops ({recorded} recorded), {stats.recomputed} recomputed: "
          f"{per_op_us:.2f} us of recording per forward op")
