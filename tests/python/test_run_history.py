"""A long run keeps bounded state: the last `history` StepStats, no per-tensor samples unless timeline=True."""
import pytest
import torch
import torch.nn as nn

from memsched.optimize import optimize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _run(steps, **kw):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with optimize(model, opt, budget="1GiB", planner="offload_all_prefetch", **kw) as run:
        for _ in range(steps):
            model(x).sum().backward()
            run.step()
    return run


def test_step_stats_keep_the_last_history_steps_and_the_report_counts_them_all(capsys):
    run = _run(25, history=5)
    assert len(run.step_stats) == 5
    assert all(s.mode == "planned" and s.offloaded > 0 for s in run.step_stats)
    r = run.report()
    assert r.steps_planned == 24 and r.steps_plain == 0 and "24 planned" in capsys.readouterr().out


def test_without_timeline_no_sample_or_copy_is_kept_but_the_peak_is():
    run = _run(4)
    assert all(s.samples == [] and s.copies == [] for s in run.step_stats)
    assert all(s.peak_bytes > 0 for s in run.step_stats)
    with pytest.raises(RuntimeError, match="timeline=True"):
        run.save_timeline("never.png")


def test_the_peak_is_the_same_with_and_without_timeline():
    with_tl, without = _run(3, timeline=True), _run(3)
    assert [s.peak_bytes for s in with_tl.step_stats] == [s.peak_bytes for s in without.step_stats]
    assert all(s.samples and s.copies for s in with_tl.step_stats)


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_a_bad_history_is_refused(value):
    with pytest.raises(ValueError, match="history"):
        optimize(_model(), None, history=value)
