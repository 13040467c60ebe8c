"""Cost per backward pass of handing the C++ Adam update its plan (Note [Adam plan for the C++
update] in memsched/ooo/fused.py): building it (every parameter's state walked in Python, then
DwRuntime.set_adam) against the kept plan (install_native_plan when nothing changed), on the
6-layer toy decoder of bench_ooo_overhead.py (76 parameter tensors, AdamW, CPU).

Run: python3 -m pytest -q -s benchmarks/python/bench_ooo_plan_cache.py
"""
import pytest
import torch

from bench_common import interleaved_medians, one_thread  # noqa: F401 (autouse fixture)
from bench_ooo_overhead import _batch, _model
from memsched import models
from memsched.ooo import OutOfOrderBackward

ROUNDS = 2000


def test_native_plan_per_backward_pass(benchmark):
    """The plan built every pass against the kept plan, interleaved in one run; the ratio is printed."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x, y = _batch()
    with OutOfOrderBackward(m, opt, fuse_optimizer=True) as ooo:
        for _ in range(3):  # torch creates the state; the plan is built at the second pass
            models.loss_fn("transformer", m(x), y).backward()
            ooo.step()
        stepper, rt, params = ooo._stepper, ooo._rt, ooo._params

        def built():
            rt.set_adam(*stepper.native_plan(params))

        def kept():
            stepper.install_native_plan(rt, params)

        before = stepper.plans_built
        built_s, kept_s = interleaved_medians(built, kept, ROUNDS, warmup=20)
        benchmark.group = "C++ Adam plan per backward pass: 76 parameters, AdamW, CPU"
        benchmark.pedantic(kept, rounds=ROUNDS, warmup_rounds=20)
        assert stepper.plans_built == before  # nothing changed: the kept plan was never built again
    benchmark.extra_info.update(built_median_us=built_s * 1e6, kept_median_us=kept_s * 1e6,
                                ratio_built_vs_kept=built_s / kept_s, params=len(params))
    print(f"\nC++ Adam plan per backward pass ({len(params)} parameters): built each pass {built_s * 1e6:.1f} us, "
          f"kept {kept_s * 1e6:.1f} us ({built_s / kept_s:.1f}x less with the kept plan)")
