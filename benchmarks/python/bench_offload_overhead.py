"""Host overhead of memsched's saved-tensor path: optimize(budget=None) against plain PyTorch.

A small decoder with many small ops (memsched.models' "small" transformer: d_model 32, 2 layers,
seq 16), batch 8, on CPU with one intra-op thread, where a step is host-bound and every
microsecond of hook time shows. Under budget=None on CPU the plan keeps everything, so the
difference to plain is the cost of memsched's hooks alone: the executor's pack/unpack per saved
tensor, its module hooks, and run.step()'s bookkeeping. Issue 10's goals: at most 3 us of
overhead per saved tensor and at most 1.10x plain's step.

Run: python3 -m pytest -q -s benchmarks/python/bench_offload_overhead.py
Plain and memsched steps are interleaved (so machine load hits both alike); medians, the ratio and
the per-saved-tensor overhead are printed and stored in extra_info.
"""

import torch

from bench_common import interleaved_medians, one_thread  # noqa: F401 (autouse fixture)
from memsched import models
from memsched.optimize import optimize

ROUNDS = 60


def _saved_tensors_per_step(step):
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return count[0]


def _setup():
    torch.manual_seed(0)
    model = models.build_model("transformer", "small")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = models.make_step_fn(model, "transformer", 8)

    def train_step():
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step, train_step


def test_optimize_keep_all_overhead_per_saved_tensor(benchmark):
    """Two copies of the model, one plain and one under optimize(budget=None), stepped alternately."""
    _, _, plain_fwd_bwd, plain = _setup()
    model, opt, step, _ = _setup()
    for _ in range(3):
        plain()
    saved = _saved_tensors_per_step(plain_fwd_bwd)
    with optimize(model, opt, budget=None) as run:
        def memsched_step():
            step()
            run.step()

        memsched_step()  # profiled
        plain_s, ms_s = interleaved_medians(plain, memsched_step, ROUNDS)
        benchmark.group = "offload hooks: small transformer b8, CPU, keep everything"
        benchmark.pedantic(memsched_step, rounds=ROUNDS, warmup_rounds=2)
    per_saved_us = (ms_s - plain_s) / saved * 1e6
    benchmark.extra_info.update(plain_median_ms=plain_s * 1e3, memsched_median_ms=ms_s * 1e3,
                                ratio_vs_plain=ms_s / plain_s, saved_tensors_per_step=saved,
                                overhead_us_per_saved_tensor=per_saved_us, threads=torch.get_num_threads())
    print(f"\nsmall transformer b8, CPU, 1 thread: plain median {plain_s * 1e3:.3f} ms, optimize(budget=None) "
          f"median {ms_s * 1e3:.3f} ms: {ms_s / plain_s:.2f}x (goal <= 1.10x); {saved} saved tensors per step, "
          f"{per_saved_us:.2f} us of overhead per saved tensor (goal <= 3 us)")
