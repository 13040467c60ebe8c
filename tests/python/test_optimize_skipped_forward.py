"""A forward in the profiled step that no backward read -- a batch the loop skipped after its forward (a
non-finite loss) -- is not planned for: the next step is profiled instead (Note [A profiled forward that
no backward read] in optimize.py)."""
import pytest
import torch

import memsched
from memsched import models


def _train(m, opt, run, skip, steps=5):
    for s in range(steps):
        x, y = models.example_batch("transformer", 8, seed=s)
        loss = models.loss_fn("transformer", m(x), y)
        if s in skip:
            continue  # the loop skips this batch: no backward, no step
        loss.backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("planner", ["dp", "hybrid"])
def test_a_batch_skipped_in_the_profiled_step_is_not_planned_for(planner):
    """Was: the skipped forward's activations joined the next one's in the profile, and budget 0.5 (which the
    same loop without the skip meets) was refused at the step boundary, that step's update dropped."""
    torch.manual_seed(0)
    plain = models.build_model("transformer")
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), None, skip={0})
    torch.manual_seed(0)
    m = models.build_model("transformer")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with memsched.optimize(m, optimizer=opt, budget=0.5, planner=planner) as run:
        _train(m, opt, run, skip={0})
    assert run.steps_profiled == 2 and run.steps_planned == 2, run.report()  # 4 steps: 1 dropped, 1 adopted
    assert all(s.offloaded + s.recomputed > 0 for s in run.step_stats)  # the plan ran, not plain steps
    assert "1 profile dropped: its step had a forward no backward read" in str(run.report())
    for (n, a), b in zip(m.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n


def test_a_loop_that_drops_a_forward_every_step_is_planned_after_two_tries():
    torch.manual_seed(0)
    m = models.build_model("transformer")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with memsched.optimize(m, optimizer=opt, budget=0.9, planner="dp") as run:
        for s in range(5):
            x, y = models.example_batch("transformer", 8, seed=s)
            models.loss_fn("transformer", m(x), y)  # a forward with grad whose graph the loop drops
            models.loss_fn("transformer", m(x), y).backward()
            run.step()
    assert run.steps_profiled == 3 and run.steps_planned == 2, run.report()
