"""The memory guard (Note [Memory guard] in csrc/torch/saved_tensor_offload.cpp): its headroom table
from the trace, and on a GPU whose host runs ahead of the device, a step that stays within its budget
only because the guard releases copies in flight in stream order."""
import copy

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.offload.guard import guard_headroom
from memsched.optimize import optimize


def _trace(ops, tensors):
    """ops: [(name, phase)]; tensors: [(bytes, kind, producer, uses, label)]."""
    t = memsched.Trace()
    for name, phase in ops:
        t.add_op(name, phase=phase, duration_us=1.0)
    for nbytes, kind, producer, uses, label in tensors:
        t.add_tensor(nbytes, "float32", kind, producer, uses, max(uses), label)
    return t


def test_headroom_is_the_largest_op_output_until_the_next_activation():
    ops = [("a", "forward"), ("b", "forward"), ("c", "forward"), ("d", "forward"),
           ("db", "backward"), ("cb", "backward"), ("ab", "backward")]
    t = _trace(ops, [
        (1000, "activation", 0, [1, 6], "act:0::[250]:float32"),   # saved by op 0's consumer
        (100, "temporary", 1, [2], ""),                            # op 1 allocates 100 B
        (300, "activation", 2, [3, 5], "act:1::[75]:float32"),     # op 2: 300 B
        (50, "temporary", 3, [4], ""),                             # op 3: 50 B
    ])
    # After act:0's save the ops up to act:1's producer (ops 1 and 2) raise memory by 100 + 300 B (the
    # temporary is still alive during op 2); after act:1's, op 3 (the last forward op) frees the
    # temporary as it allocates 50 B: memory falls, but that op still needs 50 B of room. Backward ops
    # are not in any window.
    assert guard_headroom(t) == [400, 50]


def test_headroom_window_never_runs_backwards_for_a_late_save():
    # act:1 is an input made before the step but saved after act:0 (a batch saved by a later op):
    # its window starts where act:0's ended, not at the step's start: act:0's covers op 1 (+200 B),
    # act:1's ops 1 and 2 (+200 B, then +900 B while the 200 B are still alive).
    ops = [("a", "forward"), ("b", "forward"), ("c", "forward"), ("cb", "backward")]
    t = _trace(ops, [
        (4096, "activation", 0, [1, 3], "act:0::[1024]:float32"),
        (64, "activation", -1, [1, 3], "act:1::[16]:float32"),
        (200, "temporary", 1, [2], ""),
        (900, "temporary", 2, [3], ""),
    ])
    assert guard_headroom(t) == [200, 1100]


def test_headroom_of_a_profiled_model_covers_every_activation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    with optimize(model, opt, budget=0.5, planner="dp") as run:
        model(x).sum().backward()
        run.step()
        headroom = guard_headroom(run.trace)
        ordinals = [int(r.label.split(":")[1]) for r in run.trace.tensors if r.label.startswith("act:")]
        assert len(headroom) == max(ordinals) + 1
        # after the input's save, the first Linear's output and the ReLU's are both alive during the ReLU
        assert max(headroom) == 2 * 32 * 256 * 4
        # CPU: copies hold nothing, the guard is never set and never acts
        assert run.executor.path.guard_budget == 0
        model(x).sum().backward()
        run.step()
        assert run.step_stats[-1].guard_waits == 0


def test_guard_budget_follows_optimizer_state_measured_after_the_first_update(monkeypatch):
    """RMSprop's state is not predicted: it is measured after the first update, and a fraction budget's
    guard (an accelerator's; recorded here) is set again with it, not left at the budget without it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        armed = []
        monkeypatch.setattr(run.executor, "set_memory_guard", lambda budget, headroom=(): armed.append(budget))
        model(x).sum().backward()
        run.step()
        assert run.optimizer_state_extra_ > 0
        assert armed[-1] == run.budget_bytes + run.optimizer_state_extra_ == run._budget_with_state()


def test_memory_guard_refuses_a_cpu_path():
    path = memsched._C.SavedTensorPath("cpu", object)
    with pytest.raises(memsched.MemschedError, match="for accelerators"):
        path.set_memory_guard(1 << 20, [0])


class Deep(nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _host_ahead_step(model, x, run):
    """A step enqueued while the GPU sleeps: the host issues the whole forward before any D2H copy
    can complete, so the hooks' polls release nothing (Note [Releases in stream order])."""
    torch.cuda._sleep(int(5e8))  # ~0.25 s of GPU clock cycles ahead of the forward
    model(x).backward()
    run.step()
    torch.cuda.synchronize()
    return run.step_stats[-1]


@pytest.mark.requires_cuda
def test_guard_holds_the_budget_when_the_host_runs_ahead_of_the_gpu():
    torch.manual_seed(0)
    # each saved tanh output 64 MiB (512 MiB of activations) against 4 MiB of weights per layer: the step
    # peaks where the activations do, so half of them off the device lowers it (a CPU profile of the
    # same shapes scaled by 1/16 plans at the same budget; with 4096-wide weights the peak would be in
    # backward's gradients, where offloading cannot help)
    width, layers, batch = 1024, 8, 16384
    model = Deep(width, layers).cuda()
    plain = copy.deepcopy(model)
    x = torch.randn(batch, width, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    plain(x).backward()
    plain_peak = torch.cuda.max_memory_allocated()
    plain_opt.step()
    plain_opt.zero_grad(set_to_none=True)
    budget = plain_peak - 256 * 2**20  # half the activations must be off the device at the peak
    # profile="keep": the profiled step measures the memory the trace does not model (cuBLAS's
    # workspace, rounding) into the trace, so the plan counts it (Note [Memory the trace does not model])
    with optimize(model, opt, budget=budget, planner="offload_all_prefetch", profile="keep") as run:
        model(x).backward()
        run.step()  # profiled
        guarded = _host_ahead_step(model, x, run)
        assert run.executor.path.guard_budget == run.budget_bytes  # SGD without momentum: no state
        run.executor.set_memory_guard(None)
        unguarded = _host_ahead_step(model, x, run)
    for _ in range(2):  # the plain model's third step (its first measured the plain peak)
        plain(x).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert guarded.mode == "planned" and guarded.offloaded >= layers - 1
    # without the guard nothing is released during the forward: the plan does not hold
    assert unguarded.peak_bytes > budget * 1.02, (unguarded.peak_bytes, budget)
    assert unguarded.guard_waits == 0
    # with it the compute stream waited for the copies and the step stayed within the budget
    assert guarded.guard_waits > 0 and guarded.guard_releases > 0
    assert guarded.peak_bytes <= budget * 1.02, (guarded.peak_bytes, budget, guarded.guard_released_bytes)
