"""Queued D2H copies go out when the next op starts (Note [Copies issued at the next op] in
csrc/torch/saved_tensor_path.cpp), inside ATen's RecordFunction callback, which drops what it
throws: an error raised while issuing them there must still reach the caller. (That the storage
is released before the next op allocates is what test_plan_holds_cpu.py's cnn cases measure.)"""
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
