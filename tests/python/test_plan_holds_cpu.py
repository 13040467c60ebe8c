"""Issue 11, CPU part: the plan's saved-activation peak is what the executor measures.

On CPU the executor's StepStats.peak_bytes is the most bytes of saved-activation storages alive
at once (memory_source "saved-activation storages alive (executor count)"); the like-for-like
planned figure is the peak of planned_activation_curve(trace, plan) -- the plan's saved
activations resident per op, which run.report() prints as "peak saved activations". For each
built-in model (memsched.models), planner and budget (1.0 and 0.7 of the activation memory, and
the least feasible budget, _C.least_budget_bytes) a few steps run under memsched.optimize() and
every planned step's measured peak must be within 1% of the planned one.

Known gaps are xfail(strict=True) with their cause (See _KNOWN_GAPS); a gap that closes makes
its case fail until the mark is removed.
"""
import pytest
import torch

import memsched
from memsched import _C, models
from memsched.offload.report import planned_activation_curve

BATCH = 4
STEPS = 3          # the first is profiled, the rest execute the plan
TOLERANCE = 0.01   # of the planned peak
BUDGETS = ("1.0", "0.7", "least")
PLANNERS = ("dp", "offload_all_prefetch")

# (model, planner, budget) -> why the measured peak differs from the plan today.
_UNSAMPLED_ALLOCATION = (
    "executor undercounts: a saved storage is tracked from its first pack, not from its producer "
    "op, and memory is sampled only at packs/unpacks, so an output allocated while its input is "
    "still alive (GELU's input and output during the GELU) is never seen together with it")
_HELD_BY_CALLER_FRAME = (
    "trace/model gap: an offloaded activation is released in the plan after max(offload_after_op, "
    "last forward use), but the nested nn.Sequential's frame still holds its input (`input = "
    "module(input)` in the outer Sequential) until the inner block returns, so the storage stays "
    "alive through the whole block (cnn: blocks.0's output during blocks.1, +8 KiB; mlp: layers.0's "
    "output during layers.1, +1 KiB); the profiler "
    "would have to record when only the graph still references a saved storage")
_KNOWN_GAPS = {}


def _steps(name, model, run, steps):
    x, y = models.example_batch(name, BATCH)
    for _ in range(steps):
        models.loss_fn(name, model(x), y).backward()
        run.step()


def _least_budget(name):
    model = models.build_model(name)
    x, y = models.example_batch(name, BATCH)
    trace = memsched.profile(lambda: models.loss_fn(name, model(x), y).backward(), model=model)
    return _C.least_budget_bytes(trace)


def _budget(name, which):
    return _least_budget(name) if which == "least" else float(which)


def _cases():
    for name in models.MODEL_NAMES:
        for planner in PLANNERS:
            for which in BUDGETS:
                marks = []
                why = _KNOWN_GAPS.get((name, planner, which))
                if why is not None:
                    marks.append(pytest.mark.xfail(reason=why, strict=True))
                yield pytest.param(name, planner, which, marks=marks, id=f"{name}-{planner}-{which}")


def run_case(name, planner, which, steps=STEPS):
    """(run, planned activation peak, measured peaks of the planned steps)."""
    model = models.build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsched.optimize(model, opt, budget=_budget(name, which), planner=planner, timeline=False) as run:
        _steps(name, model, run, steps)
    planned = max(planned_activation_curve(run.trace, run.plan))
    measured = [s.peak_bytes for s in run.step_stats if s.mode == "planned"]
    return run, planned, measured


@pytest.mark.parametrize("name,planner,which", list(_cases()))
def test_measured_activation_peak_is_planned(name, planner, which):
    if which == "0.7" and name == "lstm":
        pytest.skip("0.7 is below the least feasible budget for lstm; test_infeasible_fraction_names_least")
    run, planned, measured = run_case(name, planner, which)
    assert len(measured) == STEPS - 1, [s.mode for s in run.step_stats]
    assert all(s.memory_source.startswith("saved-activation storages alive") for s in run.step_stats)
    for step, m in enumerate(measured):
        assert abs(m - planned) <= TOLERANCE * planned, (
            f"{name} {planner} budget {which}: planned step {step + 1} measured {m} bytes of saved "
            f"activations, the plan says {planned} ({(m - planned) / planned:+.2%})")
    assert run.planned_figures()["activation_peak_bytes"] == planned


def test_infeasible_fraction_names_least():
    """lstm at 0.7: the least budget any plan reaches is above 0.7 of its activation memory, so
    optimize raises at the first run.step() naming the least fraction instead of running."""
    model = models.build_model("lstm")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(_C.MemschedError, match=r"use budget=0\.\d+ or more"):
        with memsched.optimize(model, opt, budget=0.7, planner="dp") as run:
            _steps("lstm", model, run, 1)


def _accumulation_steps(name, model, opt, run, steps, micro=2):
    """`steps` optimizer steps of `micro` micro-batches each (loss / micro per backward pass)."""
    batches = [models.example_batch(name, BATCH, seed=m) for m in range(micro)]
    for _ in range(steps):
        for x, y in batches:
            (models.loss_fn(name, model(x), y) / micro).backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_gradient_accumulation_offloads_every_micro_batch(name, budget=0.5):
    """Two backward passes per run.step(): the second micro-batch's activations are candidates
    too (each activation's own backward pass bounds it: Note [Micro-batches] in plan.h), the
    measured peak is the plan's at budget 0.5, and the parameters are bitwise plain PyTorch's.
    (The small mlp's peak is its gradients, not its activations, so no budget makes it offload;
    0.5 is below the lstm's least budget.)"""
    plain = models.build_model(name)
    _accumulation_steps(name, plain, torch.optim.SGD(plain.parameters(), lr=0.01), None, STEPS)

    model = models.build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsched.optimize(model, opt, budget=budget, planner="dp", timeline=False) as run:
        _accumulation_steps(name, model, opt, run, STEPS)

    trace = run.trace
    ops = trace.ops
    backward_starts = [o.id for o in ops if o.phase == "backward" and ops[o.id - 1].phase != "backward"]
    assert len(backward_starts) == 2, backward_starts
    second = {t.id for t in trace.tensors if t.kind == "activation" and t.producer_op > backward_starts[0]}
    candidates = set(_C.offloadable_tensor_ids(trace))
    assert candidates & second and candidates - second, "both micro-batches' activations are candidates"
    offloaded = {d.tensor_id for d in run.plan.decisions if d.offload or d.recompute}
    # the second micro-batch runs with the first one's gradients alive: it needs offloading most
    assert offloaded & second, "no activation of the second micro-batch leaves the device"

    planned = max(planned_activation_curve(trace, run.plan))
    measured = [s.peak_bytes for s in run.step_stats if s.mode == "planned"]
    assert len(measured) == STEPS - 1, [s.mode for s in run.step_stats]
    for m in measured:
        assert abs(m - planned) <= TOLERANCE * planned, (m, planned)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)


class _LayerNormMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.ln, self.dec = torch.nn.LayerNorm(32), torch.nn.Linear(32, 100)

    def forward(self, x):
        return self.dec(self.ln(torch.nn.functional.gelu(self.b(self.a(x).relu()))))


def _dropout_mlp():
    nn = torch.nn
    return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.GELU(), nn.Linear(64, 64), nn.Dropout(0.3), nn.SiLU(),
                         nn.Linear(64, 8))


@pytest.mark.parametrize("make,x,budget", [(_LayerNormMlp, (64, 32), 0.6), (_dropout_mlp, (4, 16, 32), 0.5)],
                         ids=["layernorm-mlp", "dropout-mlp"])
def test_a_recomputing_plan_releases_as_planned(make, x, budget):
    """planner="hybrid" with copies too slow to offload, so it recomputes: a recomputed activation was held
    one op past its last forward use (Note [A recipe built when its saving op has run] in
    offload/recompute.py), and the measured saved-activation peak was 19% (LayerNorm MLP) and 24% (the
    dropout masks) over the plan's."""
    device = memsched.DeviceModel()
    device.d2h_bw_gbps = device.h2d_bw_gbps = 1e-3
    device.d2h_latency_us = device.h2d_latency_us = 1e6
    torch.manual_seed(0)
    model = make()
    batch = torch.randn(*x)
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.01), budget=budget, planner="hybrid",
                           device_model=device) as run:
        for s in range(STEPS + 1):
            torch.manual_seed(s)
            model(batch).square().mean().backward()
            run.step()
    planned = max(planned_activation_curve(run.trace, run.plan))
    assert run.planned_figures()["recomputed"] > 0
    measured = [s.peak_bytes for s in run.step_stats if s.mode == "planned"]
    assert len(measured) == STEPS
    assert all(m <= (1 + TOLERANCE) * planned for m in measured), (measured, planned)


class _PoolCnn(torch.nn.Module):
    """Conv-ReLU-Conv-ReLU-MaxPool-Conv-ReLU (with BatchNorm after each conv where bn): max_pool2d_with_indices
    makes two outputs, and reads a ReLU output that its backward frees before the first block's activations
    come back."""

    def __init__(self, bn=False):
        super().__init__()
        nn = torch.nn

        def block(i, o):
            return [nn.Conv2d(i, o, 3, padding=1)] + ([nn.BatchNorm2d(o)] if bn else []) + [nn.ReLU()]

        self.f = nn.Sequential(*block(3, 16), *block(16, 16), nn.MaxPool2d(2), *block(16, 32))
        self.h = nn.Linear(32, 10)

    def forward(self, x):
        return self.h(self.f(x).mean((2, 3)))


@pytest.mark.parametrize("micro,budget,bn", [(1, 0.5, False), (2, 0.4, False), (1, 0.3, True)],
                         ids=["one-batch", "two-micro-batches", "batchnorm"])
def test_recomputing_max_pool_outputs_holds_the_plan(micro, budget, bn):
    """planner="hybrid" recomputing max_pool2d's outputs, measured within 1% of the plan's peak:
      - the log's lists of recorded readers held the recorded op's input (the second ReLU's output) to the
        step's end, past the op where plain PyTorch frees it, so it lived on beside the first block's
        offloaded activation when that came back: 13% (one batch) and 42% (two micro-batches) over (Note
        [What holds a replay's inputs] in offload/recompute.py);
      - the indices, an output save with no grad_fn, were held through the next convolution, beside its
        output: 11.5% over with BatchNorm (Note [A recipe built when its saving op has run]).
    Values and parameters stay plain PyTorch's."""
    device = memsched.DeviceModel()
    device.d2h_bw_gbps = device.h2d_bw_gbps = 1e-3
    device.d2h_latency_us = device.h2d_latency_us = 1e6
    batches = [torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(m)) for m in range(micro)]

    def train(model, run):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(STEPS):
            for x in batches:
                (model(x).square().mean() / micro).backward()
            if run is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                run.step()
        return opt

    torch.manual_seed(0)
    plain = _PoolCnn(bn)
    model = _PoolCnn(bn)
    model.load_state_dict(plain.state_dict())
    train(plain, None)
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.01), budget=budget, planner="hybrid",
                           device_model=device) as run:
        train(model, run)
    pool = {t.id for t in run.trace.tensors if t.producer_op >= 0
            and run.trace.ops[t.producer_op].name == "aten::max_pool2d_with_indices"}
    assert any(d.recompute and d.tensor_id in pool for d in run.plan.decisions), "the plan recomputes a pool output"
    planned = max(planned_activation_curve(run.trace, run.plan))
    measured = [s.peak_bytes for s in run.step_stats if s.mode == "planned"]
    assert len(measured) == STEPS - 1
    assert all(m <= (1 + TOLERANCE) * planned for m in measured), (measured, planned)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)


class _BasicBlock(torch.nn.Module):
    """torchvision's ResNet BasicBlock: BatchNorm's output is written in place (`out += identity`, then
    ReLU(inplace=True)) before anything saves it."""

    def __init__(self, i, o, stride=1):
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o)
        self.conv2, self.bn2 = nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o)
        self.relu = nn.ReLU(inplace=True)
        self.down = None if stride == 1 and i == o else nn.Sequential(nn.Conv2d(i, o, 1, stride, bias=False),
                                                                      nn.BatchNorm2d(o))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class _ResNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(_BasicBlock(16, 16), _BasicBlock(16, 16), _BasicBlock(16, 32, 2),
                                    _BasicBlock(32, 32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def test_a_storage_written_in_place_before_its_first_save_is_measured_from_its_producer():
    """The CPU executor dated a storage's birth from its grad_fn, which the in-place ops after BatchNorm move to
    the relu_ two ops later: on a ResNet stack under offload_all_prefetch the measured peak read 19% under the
    storages really alive (which the plan had right), so an overrun there could not be seen (Note [Measured
    from birth] in csrc/torch/saved_tensor_path.cpp). Measured within 1% of the plan, either way."""
    torch.manual_seed(0)
    model = _ResNet()
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.01), budget=0.7,
                           planner="offload_all_prefetch") as run:
        for s in range(STEPS):
            torch.manual_seed(s)
            model(torch.randn(8, 3, 16, 16)).square().mean().backward()
            run.step()
    planned = max(planned_activation_curve(run.trace, run.plan))
    measured = [s.peak_bytes for s in run.step_stats if s.mode == "planned"]
    assert len(measured) == STEPS - 1
    assert all(abs(m - planned) <= TOLERANCE * planned for m in measured), (measured, planned)


class _LstmCellLoop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.out = torch.nn.LSTMCell(32, 64), torch.nn.Linear(64, 4)

    def forward(self, x):
        h = c = torch.zeros(x.shape[1], 64)
        for step in x:
            h, c = self.cell(step, (h, c))
        return self.out(h)


@pytest.mark.parametrize("planner", ["dp", "greedy"])
def test_gate_storages_saved_through_several_version_counters_stay_on_the_device(planner):
    """ATen's CPU LSTM cell saves four unsafe_chunk pieces of each gate storage, each with a version counter
    of its own; each counter's host copy came back as a device storage of its own, so an offloaded gate
    storage was resident four times: measured 118% over the dp plan at 0.5, 86% over the budget. The
    profiler counts the counters (TensorRecord.save_counters) and no planner offloads such a storage
    (Note [Saves through several counters] in csrc/core/trace.h)."""
    torch.manual_seed(0)
    plain, model = _LstmCellLoop(), _LstmCellLoop()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(8, 64, 32)

    def train(m, run):
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(STEPS):
            m(x).square().mean().backward()
            if run is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                run.step()

    train(plain, None)
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.01), budget=0.5, planner=planner) as run:
        train(model, run)
    gates = [t for t in run.trace.tensors if t.kind == "activation" and t.save_counters > 1]
    assert len(gates) == 8, [t.save_counters for t in run.trace.tensors]  # one gate storage per time step
    assert not {t.id for t in gates} & set(_C.offloadable_tensor_ids(run.trace))
    planned = max(planned_activation_curve(run.trace, run.plan))
    measured = [s.peak_bytes for s in run.step_stats if s.mode == "planned"]
    assert len(measured) == STEPS - 1 and run.plan.num_offloaded() > 0
    assert all(abs(m - planned) <= TOLERANCE * planned for m in measured), (measured, planned)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)
