"""Memory the trace does not model (Note [Memory the trace does not model] in
python/memsched/profiler/unmodeled.py): what the device allocator held beyond the traced tensors
enters the trace, so keep_all's simulated peak is the measured one and plans count it."""
import pytest
import torch
import torch.nn as nn

import memsched
from memsched import _C
from memsched.profiler.unmodeled import UNMODELED_LABEL, DeviceCounters, add_unmodeled, kMinExtraBytes

MiB = 1 << 20


def _trace():
    """Three forward ops each making a 64 MiB activation used by the mirrored backward op."""
    t = memsched.Trace()
    for name, phase in (("f0", "forward"), ("f1", "forward"), ("f2", "forward"),
                        ("b2", "backward"), ("b1", "backward"), ("b0", "backward")):
        t.add_op(name, phase=phase, duration_us=100.0)
    for i in range(3):
        use = 5 - i
        t.add_tensor(64 * MiB, "float32", "activation", i, [i + 1 if i < 2 else 3, use], use,
                     f"act:{i}::[{16 * MiB}]:float32")
    return t


def _keep_all_curve(trace):
    return _C.modelled_memory(trace, memsched.plan(trace, planner="keep_all"))


def test_keep_all_simulated_peak_equals_the_measured_peak():
    trace = _trace()
    modelled = _keep_all_curve(trace)
    # a 40 MiB workspace from the first op on, and a 24 MiB transient buffer inside op 4
    measured = {i: b + 40 * MiB + (24 * MiB if i == 4 else 0) for i, b in enumerate(modelled)}
    at_peak = add_unmodeled(trace, measured)
    assert _keep_all_curve(trace) == [measured[i] for i in range(len(modelled))]
    sim = memsched.simulate(trace, memsched.plan(trace, planner="keep_all"))
    assert sim.peak_bytes == max(measured.values())
    peak_op = max(measured, key=measured.get)
    assert at_peak == measured[peak_op] - modelled[peak_op]
    added = [r for r in trace.tensors if r.label.startswith(UNMODELED_LABEL)]
    assert all(r.kind == "temporary" for r in added)  # never offloaded or recomputed
    assert sorted(r.bytes for r in added) == [24 * MiB, 40 * MiB]


def test_plans_count_the_unmodeled_memory():
    trace = _trace()
    budget = max(_keep_all_curve(trace)) - 64 * MiB
    memsched.plan(trace, budget=budget, planner="dp")  # fits before the correction
    add_unmodeled(trace, {i: b + 96 * MiB for i, b in enumerate(_keep_all_curve(trace))})
    with pytest.raises(memsched.MemschedError, match="least budget"):
        memsched.plan(trace, budget=budget, planner="dp")
    plan = memsched.plan(trace, budget=budget + 96 * MiB, planner="dp")
    assert memsched.simulate(trace, plan).peak_bytes <= budget + 96 * MiB


def test_small_or_negative_remainders_add_nothing():
    trace = _trace()
    modelled = _keep_all_curve(trace)
    n = len(trace.tensors)
    # below the modelled memory at one op (the least remainder is negative: no step-wide term), and
    # under kMinExtraBytes above it elsewhere: rounding noise, dropped
    measured = {i: b + (kMinExtraBytes - 1 if i else -MiB) for i, b in enumerate(modelled)}
    assert add_unmodeled(trace, measured) == 0
    assert len(trace.tensors) == n
    assert add_unmodeled(trace, {}) == 0


def test_offloaded_profiles_subtract_what_they_held_on_the_host():
    trace = _trace()
    modelled = _keep_all_curve(trace)
    # a profile with its saves offloaded: act:0 (64 MiB) was on the host during ops 2-4
    off = {i: (64 * MiB if 2 <= i <= 4 else 0) for i in range(len(modelled))}
    measured = {i: b - off[i] + 40 * MiB for i, b in enumerate(modelled)}
    add_unmodeled(trace, measured, off)
    # what the allocator held beyond the traced tensors is the 40 MiB alone: keep_all gains exactly that
    assert _keep_all_curve(trace) == [b + 40 * MiB for b in modelled]


def test_released_bytes_are_the_saves_an_offloaded_profile_holds_on_the_host():
    from memsched.offload.host_buffers import HostBuffers
    from memsched.profiler.offloaded_saves import OffloadedSaves
    from memsched.profiler.session import ProfilerSession
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    saves = OffloadedSaves("cpu", HostBuffers(pinned=False), 0)
    session = ProfilerSession(model, None, "cpu", offload=saves).start()
    loss = model(x).sum()
    loss = loss * 1.0  # one more recorded op: the release after the last forward save
    after_forward = saves.released_bytes()
    loss.backward()
    after_backward = saves.released_bytes()
    session.stop()
    # the two Tanh outputs (32 x 256 floats each) went to the host; backward grew both back
    assert saves.stats.offloaded == 2 and after_forward == saves.stats.offloaded_bytes == 2 * 32 * 256 * 4
    assert after_backward == 0


def test_an_allocator_without_statistics_leaves_the_trace_uncorrected(monkeypatch):
    """torch's CUDAPluggableAllocator (another allocator than memsched's) raises from getDeviceStats and
    resetPeakStats: profiling must not fail on every op for it."""
    import memsched.profiler.unmodeled as unmodeled

    def refuse(device):
        raise RuntimeError("CUDAPluggableAllocator does not yet support resetPeakStats")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(unmodeled.allocator, "is_installed", lambda: False)
    monkeypatch.setattr(unmodeled._C, "reset_device_peak", refuse)
    assert DeviceCounters.for_device("cuda:0") is None


def test_cpu_profiles_measure_nothing_from_an_allocator():
    assert DeviceCounters.for_device("cpu") is None
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model)
    assert not [r for r in trace.tensors if r.label.startswith(UNMODELED_LABEL)]


@pytest.mark.requires_cuda
def test_cuda_keep_all_simulated_peak_is_within_three_percent_of_max_memory_allocated():
    """Issue 11's keep_all figure in miniature: a decoder under bf16 autocast, where the autocast
    cache, cuBLAS workspaces and rounding are all in play."""
    from memsched import models
    torch.manual_seed(0)
    model = models.build_model("transformer", "realistic").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = models.make_step_fn(model, "transformer", 8, "realistic", device="cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step()
        opt.step()

    for _ in range(2):  # the optimizer state and cuBLAS's workspaces exist, as in any later step
        train_step()
    torch.cuda.synchronize()
    trace = memsched.profile(train_step, model=model, optimizer=opt)
    keep_all = memsched.simulate(trace, memsched.plan(trace, planner="keep_all"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    assert abs(keep_all.peak_bytes - measured) <= 0.03 * measured, (keep_all.peak_bytes, measured)
