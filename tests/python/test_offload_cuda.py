"""The offload executor on a CUDA device: side streams, pinned pool, release after the copy.

Skipped without a GPU (the `requires_cuda` marker); the same code path is covered on CPU by
test_optimize_cpu.py.
"""
import copy

import pytest
import torch
import torch.nn as nn

from memsched.optimize import optimize
from offload_standins import install_standins

pytestmark = [pytest.mark.requires_cuda, pytest.mark.usefixtures("unchecked_budget")]


class Deep(nn.Module):
    def __init__(self, width=1024, layers=8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum(dim=1)


def _run(model, opt, xs, run=None):
    for x in xs:
        model(x).sum().backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)


def _forward_held_bytes(model, x, run=None):
    """(output, device bytes allocated once the forward's copies completed): what the forward leaves on
    the device for its backward. The hooks drop a completed copy's hold at their next pack or unpack;
    here, between forward and backward, the engine is polled directly."""
    out = model(x)
    torch.cuda.synchronize()
    if run is not None:
        run.executor.engine.poll()
    return out, torch.cuda.memory_allocated()


def _trained_reference(cls, steps):
    """(model, its optimizer, batches, its plain-trained copy): the copy trained on the batches."""
    torch.manual_seed(0)
    model = cls().cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = [torch.randn(512, 1024, device="cuda") for _ in range(steps)]
    _run(ref, torch.optim.SGD(ref.parameters(), lr=1e-3), xs)
    return model, opt, xs, ref


def test_cuda_offload_is_bitwise_and_lowers_forward_memory(monkeypatch):
    install_standins(monkeypatch)  # offload everything, prefetch one backward op ahead
    model, opt, xs, ref = _trained_reference(Deep, 3)
    # Not the step's peak: for this model it comes at the end of backward (8 x 4 MiB of weight
    # gradients against 8 x 2 MiB of activations), where offloading cannot help, and the fetched
    # copy of the input batch (the caller still holds the batch) put it 2 MiB above plain's on the H100.
    out, plain_held = _forward_held_bytes(ref, xs[0])
    out.sum().backward()
    ref.zero_grad(set_to_none=True)
    del out
    with optimize(model, opt, budget=1.0, min_offload_bytes=1 << 20, timeline=True) as run:
        _run(model, opt, xs[:2], run=run)
        out, held = _forward_held_bytes(model, xs[2], run)
        out.sum().backward()
        run.step()
        del out
    torch.manual_seed(0)
    check = Deep().cuda()  # the same initial weights, trained plainly on the same 3 batches
    check_opt = torch.optim.SGD(check.parameters(), lr=1e-3)
    _run(check, check_opt, xs)
    for p, q in zip(model.parameters(), check.parameters()):
        assert torch.equal(p, q)
    stats = run.step_stats[-1]
    assert stats.mode == "planned" and stats.offloaded >= 8
    assert stats.d2h_bytes == stats.offloaded_bytes and stats.h2d_bytes == stats.offloaded_bytes
    # the 8 tanh outputs (2 MiB each) left the device once copied; plain keeps them for backward
    assert held <= plain_held - 8 * (2 << 20) + (1 << 20), (held, plain_held)
    assert run.host.pinned
    kinds = {k for k, *_ in stats.copies}
    assert kinds == {"d2h", "h2d"}


@pytest.mark.parametrize("planner", ["offload_all_prefetch", "dp"])
def test_executed_steps_and_run_step_never_wait_for_the_gpu(planner):
    """Note [No host synchronisation in a step]: forward, backward and run.step() of a planned step
    issue no synchronising CUDA call; the step's timings are read afterwards, from events."""
    torch.manual_seed(0)
    model = Deep(width=512, layers=6).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # 1024 x 512 fp32: 2 MiB activations, above the executor's 1 MiB default floor on CUDA (Note [The
    # executor's size floor] in csrc/core/trace.h), and the step's peak where they are, so budget 0.5 needs
    # some off the device. At 256 rows (0.5 MiB) every save was below the floor: the plans kept all 7 and
    # the planned steps offloaded nothing (the H100 run), proving nothing about their copies; nor would
    # min_offload_bytes=0 have done for dp, as the peak then lay in backward's gradients, where 0.5
    # resolves to that peak and nothing needs to move (reproduced on CPU with the same floor).
    xs = [torch.randn(1024, 512, device="cuda") for _ in range(4)]
    with optimize(model, opt, budget=0.5, planner=planner) as run:
        _run(model, opt, xs[:2], run=run)  # profiled, then the first planned step
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _run(model, opt, xs[2:], run=run)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stats = run.step_stats[-1]
        assert stats.mode == "planned" and stats.offloaded > 0
        assert stats.duration_s > 0 and stats.stall_s >= 0   # resolved from events now


def test_a_reprofile_starts_with_no_copies_of_the_planned_steps_in_flight():
    """A re-profile (after a mismatch) measures what the allocator holds beyond the traced tensors
    (Note [Memory the trace does not model]); copies of the last planned step still in flight would be
    counted there and inflate every later plan. They are waited for when the profiled step begins."""
    torch.manual_seed(0)
    model = Deep(width=1024, layers=8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = [torch.randn(4096, 1024, device="cuda") for _ in range(5)]
    seen = []
    with optimize(model, opt, budget=0.5, planner="offload_all_prefetch") as run:
        _run(model, opt, xs[:2], run=run)  # profiled, planned
        reprofiles = run.reprofiles
        # A shorter forward saves fewer activations than the trace: its copies run as planned and the
        # mismatch is found at its end (run.step()); after two such steps in a row (Note [A lone
        # mismatching step]) the next step is profiled right after the second.
        layers = model.layers
        model.layers = layers[:-1]
        _run(model, opt, xs[2:3], run=run)
        # Keep the GPU ~0.1 s behind the host for the second such step (its copies wait for this
        # compute-stream work), so they are provably in flight when the host looks: on an H100 they
        # could all have finished by then, leaving nothing to wait for (the skip below).
        torch.cuda._sleep(200_000_000)
        _run(model, opt, xs[3:4], run=run)
        in_flight = run.executor.engine.pending_count()  # that step's copies, as the host last saw them
        model.layers = layers
        model.register_forward_pre_hook(lambda m, a: seen.append(run.executor.engine.pending_count()))
        _run(model, opt, xs[4:], run=run)  # re-profiled
        assert run.reprofiles == reprofiles + 1 and run.steps_profiled == 2
    if in_flight == 0:
        pytest.skip("the GPU had finished every copy before the host looked: nothing in flight to wait for")
    assert seen == [0], "the re-profiled step began with the last planned step's copies in flight"


class SideStreamDeep(Deep):
    """Every other layer runs on a side stream, as models that overlap work do: autograd runs those
    layers' backward nodes on that stream, so saves of one fetched copy are unpacked on two streams
    and prefetches fire on the other one (Note [A fetched copy read on other streams])."""

    def forward(self, x):
        side = self.side = getattr(self, "side", None) or torch.cuda.Stream()
        main = torch.cuda.current_stream()
        for i, layer in enumerate(self.layers):
            if i % 2:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    x = torch.tanh(layer(x))
                main.wait_stream(side)
                x.record_stream(main)
            else:
                x = torch.tanh(layer(x))
        return x.sum(dim=1)


@pytest.mark.parametrize("planner", ["offload_all_prefetch", "dp"])
def test_a_forward_on_two_streams_trains_bitwise_under_offload(planner):
    """A fetched copy is waited for, and recorded, on every stream that unpacks it: without that a
    read on the other stream could see the bytes before the H2D copy landed, or the block be reused
    under it. Heavy enough (8 x 512 x 1024 activations, several steps) for a race to show."""
    model, opt, xs, ref = _trained_reference(SideStreamDeep, 5)
    with optimize(model, opt, budget=0.5, planner=planner, min_offload_bytes=0) as run:
        _run(model, opt, xs, run)
        assert run.steps_planned >= 3 and run.mismatches == 0
        assert sum(s.offloaded for s in run.step_stats) > 0
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
