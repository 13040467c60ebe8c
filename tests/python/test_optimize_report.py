"""run.report()'s notes read as English for every count: "1 step did not match", never "1 step(s)" or
"1 storages" (optimize.py, with memsched/wording.py)."""
import warnings

import torch
import torch.nn as nn

import memsched


def test_counts_of_one_in_the_report_are_singular():
    def report(batches):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the mismatch warning: the point of this run
            with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1GiB", max_shape_plans=1,
                                   profile="offload", max_reprofiles=1) as run:
                for batch in batches:
                    model(torch.randn(batch, 8)).sum().backward()
                    run.step()
        return run, run.report().table

    # a lone step of other shapes: one mismatch, and the plan runs on (Note [A lone mismatching step])
    _, table = report((4, 4, 6, 4))
    assert "1 step did not match the profiled trace" in table and "; 0 re-profiles\n" in table + "\n"
    # two in a row: one re-profile
    run, table = report((4, 4, 6, 6, 6))
    assert "2 steps did not match the profiled trace" in table and "; 1 re-profile\n" in table + "\n"
    assert "(s)" not in table and "1 storages" not in table
    assert f"{run.profile_stats.offloaded} storages" in table  # several: plural


def test_after_a_reprofile_the_report_measures_the_current_plans_steps_only(capsys):
    """A lasting smaller batch re-profiles; the report and the timeline set the new plan beside its own steps
    (they took medians over both plans' steps: 407.63 KiB measured against 220.13 KiB planned, with a note of
    a gap that was not there)."""
    import memsched
    from memsched import models
    torch.manual_seed(0)
    model = models.build_model("transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memsched.optimize(model, opt, budget=0.5, planner="dp") as run:
        for batch in (8, 8, 4, 4, 4, 4):
            x, y = models.example_batch("transformer", batch)
            models.loss_fn("transformer", model(x), y).backward()
            run.step()
    assert run.steps_profiled == 2
    r = run.report()
    assert r.measured["activation_peak_bytes"] == r.planned["activation_peak_bytes"]
    # on CPU the allocator's peak is not measured: not the saved-activation count under the whole-step key
    assert r.measured["peak_bytes"] is None and "measured_activation_peak_bytes=225412" in repr(r)
    assert any("run against the current plan (profile 2" in n for n in r.notes), r.notes
    assert not any("above the plan" in n for n in r.notes), r.notes


def test_a_step_that_saved_fewer_activations_says_why_in_its_stats():
    """The reason of a count mismatch was only in the once-per-Run warning; StepStats.mismatch was ''."""
    import memsched
    from memsched import models
    torch.manual_seed(0)
    model = models.build_model("transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = models.example_batch("transformer", 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memsched.optimize(model, opt, budget=0.5) as run:
            for i in range(3):
                out = model(x)
                if i != 2:  # the last step's forward has no backward: its saves are fewer than the trace's
                    models.loss_fn("transformer", out, y).backward()
                del out
                run.step()
    last = run.step_stats[-1]
    assert last.mode == "diverged" and last.mismatch.startswith("the step saved"), (last.mode, last.mismatch)
