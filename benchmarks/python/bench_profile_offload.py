"""Cost of profiling with saved activations offloaded (profile="offload", Note [Profiling with saved
activations offloaded]) against the keep-all profile: one profiled training step of the realistic
transformer (memsched.models, d_model 256, 4 layers, seq 128) and CNN on CPU, and the saved
activations each holds on the device. No goal: the profiled step runs once per Run.

Run: python3 -m pytest -q -s benchmarks/python/bench_profile_offload.py
One intra-op thread; keep-all and offloaded profiles are interleaved (so machine load hits both
alike). The ratio of medians and the measured saved-activation peak against plain's are printed
and stored in the benchmark JSON's extra_info.
"""
import statistics
import time

import pytest
import torch

from bench_common import one_thread  # noqa: F401 (autouse fixture)
from memsched import models
from memsched.offload.host_buffers import HostBuffers
from memsched.offload.report import planned_activation_curve
from memsched.profiler import ProfilerSession
from memsched.profiler.offloaded_saves import OffloadedSaves

ROUNDS = 8


@pytest.mark.parametrize("family, batch", [("transformer", 8), ("cnn", 32)])
def test_offloaded_profile(benchmark, family, batch):
    model = models.build_model(family, "realistic")
    x, y = models.example_batch(family, batch, "realistic")
    saves = OffloadedSaves("cpu", HostBuffers(pinned=False), 0)

    def profiled(offload):
        session = ProfilerSession(model, None, "cpu", offload=saves if offload else None).start()
        models.loss_fn(family, model(x), y).backward()
        trace = session.stop()
        model.zero_grad(set_to_none=True)
        return trace

    for _ in range(2):  # warm up kernels, allocator, host pool
        profiled(False), profiled(True)
    benchmark.group = f"offloaded profile: realistic {family}, batch {batch}, CPU"
    benchmark.pedantic(profiled, args=(True,), rounds=ROUNDS, warmup_rounds=1)
    keep_t, off_t = [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        trace = profiled(False)
        keep_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        profiled(True)
        off_t.append(time.perf_counter() - t0)
    keep_s, off_s = statistics.median(keep_t), statistics.median(off_t)
    plain_act = max(planned_activation_curve(trace, None))
    measured = saves.stats.activation_peak_bytes
    benchmark.extra_info.update(keep_median_ms=keep_s * 1e3, offload_median_ms=off_s * 1e3,
                                ratio_vs_keep=off_s / keep_s, activation_peak_bytes=measured,
                                plain_activation_peak_bytes=plain_act, offloaded_bytes=saves.stats.offloaded_bytes,
                                threads=torch.get_num_threads(), torch=torch.__version__)
    print(f"\nrealistic {family}, batch {batch}, CPU, {torch.get_num_threads()} thread(s): keep-all profile median "
          f"{keep_s * 1e3:.1f} ms, offloaded {off_s * 1e3:.1f} ms ({off_s / keep_s:.2f}x); saved activations on "
          f"the device at most {measured / 2**20:.2f} MiB of plain's {plain_act / 2**20:.2f} MiB "
          f"({measured / plain_act:.0%}); {saves.stats.offloaded_bytes / 2**20:.2f} MiB to host and back")
