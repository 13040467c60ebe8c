"""Issue 11, GPU part in miniature: every planned step's max_memory_allocated stays within its budget
plus 2%, for the built-in models at their realistic size under bf16 autocast (the LSTM in fp32) with AdamW -- where the
allocator's workspaces and rounding, the autocast cache, optimizer state and copies in flight all
take memory the tensor-sized model of the step does not see. What makes it hold: the unmodeled
device memory in the trace (Note [Memory the trace does not model]), releases in stream order and
the memory guard (Note [Releases in stream order], Note [Memory guard]); a first planned step over
the budget would raise (Note [A budget the guard cannot meet]).

Skipped without a GPU (`requires_cuda`); test_plan_holds_cpu.py is the CPU counterpart.
"""
import warnings

import pytest
import torch

import memsched
from memsched import models

pytestmark = pytest.mark.requires_cuda

BATCH = 8
STEPS = 4  # the first is profiled, the rest execute the plan


@pytest.mark.parametrize("budget", [0.7, 0.5])
@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_planned_steps_stay_within_the_budget_on_cuda(name, budget):
    torch.manual_seed(0)
    model = models.build_model(name, "realistic", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = models.example_batch(name, BATCH, "realistic", device="cuda")
    try:
        with warnings.catch_warnings(record=True) as warned, memsched.optimize(model, opt, budget=budget,
                                                                               planner="dp") as run:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                # bf16 autocast (its weight cache is memory too), except the LSTM: cuDNN's RNN kernels
                # are not this test's subject
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=name != "lstm"):
                    loss = models.loss_fn(name, model(x), y)
                loss.backward()
                run.step()
    except memsched.MemschedError as err:
        if "least fraction that works" in str(err):
            pytest.skip(f"{name} at {budget}: below what the planner reaches ({err})")
        raise
    limit = run._budget_with_state() * 1.02
    update = run.profiled_update_peak_
    if update > limit:
        # A fraction budget is of the saved activations' memory; the optimizer update (AdamW's foreach
        # temporaries: the MLP at 0.7 on an H100, 18% over) is not, and no plan moves it, so memsched
        # warns at the profiled step (Note [A budget the guard cannot meet]) and every step peaks there.
        # The plan holds when forward and backward stay within the budget and the update where it was.
        assert any("the optimizer update (optimizer.step())" in str(w.message) for w in warned), \
            f"{name} at {budget}: the update peaked over the budget and memsched said nothing"
        for s in run.step_stats[1:]:
            # phase peaks never restart (Note [Where the peak went]): backward's is the step's before its update
            assert s.phase_peaks.backward <= limit, (f"{name} at {budget}: forward/backward peaked at "
                                                     f"{s.phase_peaks.backward} B over the budget {limit} B")
        limit = update * 1.02
    planned = [s for s in run.step_stats if s.mode == "planned"]
    assert len(planned) == STEPS - 1 and run.mismatches == 0
    for s in planned:
        assert s.peak_bytes <= limit, (f"{name} at {budget}: measured {s.peak_bytes} B over the budget "
                                       f"{run._budget_with_state()} B (+2%); guard waits {s.guard_waits}; "
                                       f"{run._peak_gap()}")
    assert torch.isfinite(loss).all()


def test_a_planned_steps_peak_is_the_allocators_over_the_whole_step():
    """Note [Where the peak went]: the phase readings never restart the peak, so a planned step's peak
    (its update included) is what torch.cuda.max_memory_allocated() says after run.step()."""
    torch.manual_seed(0)
    model = models.build_model("transformer", "realistic", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = models.example_batch("transformer", BATCH, "realistic", device="cuda")
    with memsched.optimize(model, opt, budget=0.5, planner="dp") as run:
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = models.loss_fn("transformer", model(x), y)
            loss.backward()
            run.step()
            run.executor.engine.check_invariants()  # held_source_bytes is the sum of what copies in flight hold
        s = run.step_stats[-1]
        assert s.mode == "planned" and s.phase_peaks is not None
        assert s.peak_bytes == max(vars(s.phase_peaks).values())
        # run.step() allocates nothing after its last reading (1 MiB: room for a stray small block)
        assert s.peak_bytes <= torch.cuda.max_memory_allocated() <= s.peak_bytes + (1 << 20)
        assert s.phase_peaks.forward <= s.phase_peaks.backward <= s.phase_peaks.update
        assert s.reserved_peak_bytes >= s.peak_bytes
        assert run.planned_figures()["update_peak_bytes"] > 0
