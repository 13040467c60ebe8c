"""Queued D2H copies go out when the next op starts (Note [Copies issued at the next op] in
csrc/torch/saved_tensor_path.cpp), inside ATen's RecordFunction callback, which drops what it
throws: an error raised while issuing them there must still reach the caller. (That the storage
is released before the next op allocates is what test_plan_holds_cpu.py's cnn cases measure.)"""
import threading

import pytest
import torch
from torch import nn

import memsched


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 4))


def test_an_error_issuing_copies_at_the_next_op_reaches_the_caller():
    """The failing issue runs from the callback (the BatchNorm's queued copy goes out when the ReLU
    starts); the error is raised by the step's next save."""
    model, x = _model(), torch.randn(2, 3, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="host copy failed"):
        with memsched.optimize(model, opt, budget=1.0, planner="offload_all_prefetch") as run:
            model(x).sum().backward()
            run.step()
            run.executor.path.fail_next_issue = "host copy failed"
            model(x).sum().backward()
            run.step()


class _PackFromAnotherThread(nn.Module):
    """exp saves its output (offloaded: its copy is queued), add saves nothing (the copy goes out as it
    starts, the callback stays until the next save) and then a save is packed on another thread, as the
    autograd engine's device thread does on a GPU (a save made during backward: a reentrant checkpoint's
    recompute, create_graph)."""

    def __init__(self, run_box):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.run_box = run_box

    def forward(self, x):
        a = torch.exp(self.lin(x))
        b = a + 1
        run = self.run_box[0]
        if run is not None and run.steps_planned >= 1 and not self.run_box[1]:
            self.run_box[1] = True  # once: the foreign save does not match the trace, so the step runs plainly on
            assert run.executor.path.next_op_armed and not run.executor.path.has_queued  # a's copy went out as add started
            t = threading.Thread(target=run.executor.pack_fn_, args=(torch.ones(4),))
            t.start()
            t.join()
        return (b * b).sum()


def test_a_save_packed_on_another_thread_leaves_the_next_op_callback_of_the_step_thread_alone(capfd):
    """Note [Copies issued at the next op]: the per-op callback is thread-local, so only the thread that
    armed it may remove it (removing it from another thread warned "Requested callback is not found"
    and leaked it on the step's thread, one more per step), and a save on another thread arms none
    there (a callback left on a thread the step does not end would outlive the executor)."""
    box = [None, False]
    model = _PackFromAnotherThread(box)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 16)
    with pytest.warns(RuntimeWarning, match="does not match the profiled trace"), \
            memsched.optimize(model, opt, budget=1.0, planner="offload_all_prefetch", min_offload_bytes=0) as run:
        box[0] = run
        for _ in range(3):
            model(x).backward()
            run.step()
    assert box[1]
    assert "callback is not found" not in capfd.readouterr().err  # torch's warning, printed by c10
