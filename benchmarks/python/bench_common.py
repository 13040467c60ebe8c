"""Shared by the benchmarks: the three model families at realistic sizes, profiled once per
process, and where results go (replay and planner benchmarks); interleaved step timing (the
host-overhead benchmarks)."""
import os
import statistics
import time

import pytest
import torch

import memsched
from memsched import models

# (family, batch) at the "realistic" sizes of memsched.models; batches chosen so activations, not
# weights, dominate the peak where the family allows it (the MLP's weights and gradients still set
# a high floor).
FAMILIES = [("transformer", 16), ("cnn", 128), ("mlp", 4096)]
OUT_DIR = os.environ.get("MEMSCHED_BENCH_OUT", "bench_out")

_TRACES = {}


def profiled_trace(family, batch):
    """memsched.profile of one training step of `family` at `batch`, cached."""
    key = (family, batch)
    if key not in _TRACES:
        model = models.build_model(family, "realistic")
        step = models.make_step_fn(model, family, batch=batch, size="realistic")
        _TRACES[key] = memsched.profile(step, model=model)
    return _TRACES[key]


def interleaved_medians(plain, other, rounds, warmup=3):
    """(plain median s, other median s): the two step functions run alternately, so machine load
    hits both alike; `warmup` rounds of each first."""
    for _ in range(warmup):
        plain()
        other()
    plain_t, other_t = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        other()
        t2 = time.perf_counter()
        plain_t.append(t1 - t0)
        other_t.append(t2 - t1)
    return statistics.median(plain_t), statistics.median(other_t)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a 2-core machine shared with builds, OpenMP spin-waits turn
    multi-threaded small ops into noise; host overhead is single-threaded Python either way.
    Autouse in the modules that import it by name (pytest collects fixtures per module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
