"""Profiler overhead: one profiled training step over one plain step of the
small transformer (memsched.models, "small": d_model 32, 2 layers, seq 16) on
CPU. Goal: under 3x (profiling is a one-off pass).

Run: python3 -m pytest -q -s benchmarks/python/bench_profiler.py
One intra-op thread. Plain and profiled steps are interleaved (so machine
load hits both alike);
the ratio of medians is printed and stored in the benchmark JSON as
extra_info["ratio_vs_plain"], with the per-op overhead in microseconds.
"""
import statistics
import time

import pytest
import torch

from bench_common import one_thread  # noqa: F401 (autouse fixture)
import memsched
from memsched import models

ROUNDS = 40


def _setup(batch):
    model = models.build_model("transformer", "small")
    step = models.make_step_fn(model, "transformer", batch)
    for _ in range(3):  # warm up kernels and allocator
        step()
    return model, step


@pytest.mark.parametrize("batch", [8, 64])
def test_plain_step(benchmark, batch):
    _, step = _setup(batch)
    benchmark.group = f"profiler overhead: small transformer, batch {batch}, CPU"
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.parametrize("batch", [8, 64])
def test_profiled_step(benchmark, batch):
    model, step = _setup(batch)
    benchmark.group = f"profiler overhead: small transformer, batch {batch}, CPU"

    def profiled():
        return memsched.profile(step, model=model)

    benchmark.pedantic(profiled, rounds=ROUNDS, warmup_rounds=2)
    plain_t, prof_t = [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        step()
        plain_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        profiled()
        prof_t.append(time.perf_counter() - t0)
    plain_s, prof_s = statistics.median(plain_t), statistics.median(prof_t)
    ratio = prof_s / plain_s
    n_ops = len(profiled().ops)
    per_op_us = (prof_s - plain_s) / n_ops * 1e6
    benchmark.extra_info.update(plain_median_ms=plain_s * 1e3, profiled_median_ms=prof_s * 1e3,
                                plain_min_ms=min(plain_t) * 1e3, profiled_min_ms=min(prof_t) * 1e3,
                                ratio_vs_plain=ratio, recorded_ops=n_ops, overhead_us_per_recorded_op=per_op_us,
                                threads=torch.get_num_threads(), torch=torch.__version__)
    print(f"\nsmall transformer, batch {batch}, CPU, {torch.get_num_threads()} threads: plain median "
          f"{plain_s * 1e3:.2f} ms (min {min(plain_t) * 1e3:.2f}), profiled median {prof_s * 1e3:.2f} ms "
          f"(min {min(prof_t) * 1e3:.2f}): ratio {ratio:.2f}x (goal < 3x); {n_ops} recorded ops, "
          f"{per_op_us:.1f} us of overhead per recorded op (all overhead, incl. pass-through view ops and setup)")
