"""Cost per backward pass of handing the C++ Adam update its plan (Note [Adam plan for the C++
update] in memsched/ooo/fused.py): building it (every parameter's state walked in Python, then
DwRuntime.set_adam) against the kept plan (install_native_plan when nothing changed), on the
6-layer toy decoder of bench_ooo_overhead.py (76 parameter tensors, AdamW, CPU).

Run: python3 -m pytest -q -s benchmarks/python/bench_ooo_plan_cache.py
"""
import pytest
import torch

from bench_common import one_thread  # noqa: F401 (autouse fixture)
from bench_ooo_overhead import _batch, _model
from memsched import models
from memsched.ooo import OutOfOrderBackward

ROUNDS = 2000


@pytest.mark.parametrize("kind", ["built_each_pass", "kept"])
def test_native_plan_per_backward_pass(benchmark, kind):
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

        fn = built if kind == "built_each_pass" else kept
        before = stepper.plans_built
        benchmark.group = "C++ Adam plan per backward pass: 76 parameters, AdamW, CPU"
        benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=20)
        assert kind != "kept" or stepper.plans_built == before  # nothing changed: never built again
    median_us = benchmark.stats.stats.median * 1e6
    benchmark.extra_info.update(kind=kind, median_us=median_us, params=len(params))
    print(f"\n{kind}: median {median_us:.1f} us per backward pass ({len(params)} parameters)")
