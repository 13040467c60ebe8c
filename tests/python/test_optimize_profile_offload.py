"""memsched.optimize(..., profile=): how the first, profiled step holds its saved activations
(Note [Profiling a step that does not fit] in optimize.py).

profile="auto" (the default) offloads them to host memory when the budget is in bytes and keeps
them otherwise; "offload" / "keep" force it. After an offloaded profile the plan and every later
step are those of a keep-all profile, and the model trains exactly as plain PyTorch.
"""
import io

import pytest
import torch

import memsched
from memsched import _C, models
from trace_helpers import assert_same_trace_structure

BATCH = 4


def _least_budget(name):
    """The least byte budget of the steps after the first: the profiled step's, plus the AdamW state the
    first update creates (Note [Optimizer state the profiled step did not see] in optimize.py)."""
    model = models.build_model(name)
    x, y = models.example_batch(name, BATCH)
    trace = memsched.profile(lambda: models.loss_fn(name, model(x), y).backward(), model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    state = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return _C.least_budget_bytes(trace) + state


def _train(name, steps, options=None, size="small", batch=BATCH, device="cpu", lr=1e-2, hooked=False):
    """Parameters after `steps` AdamW steps -- plain PyTorch when options is None, else under
    memsched.optimize(**options) -- and the Run. hooked: a keep-all plan's steps run through the
    executor's hooks, which measure them (Note [A plan with nothing to do])."""
    model = models.build_model(name, size, device=device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = models.example_batch(name, batch, size, device=device)
    run = None
    if options is None:
        for _ in range(steps):
            models.loss_fn(name, model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        with memsched.optimize(model, opt, **options) as run:
            for _ in range(steps):
                models.loss_fn(name, model(x), y).backward()
                run.step()
                if hooked:
                    run.executor.hookless = False
    return [p.detach().clone() for p in model.parameters()], run


@pytest.mark.parametrize("bad", ["Offload", "", "save_on_cpu", 1, None, True])
def test_profile_is_checked_before_any_step(bad):
    model = models.build_model("mlp")
    with pytest.raises(ValueError, match=r"profile: expected one of 'auto', 'offload', 'keep' .* got "):
        memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1MiB", profile=bad)


@pytest.mark.parametrize("budget, profile, offload", [
    (800_000, "auto", True), ("800KiB", "auto", True), (0.7, "auto", False), ("80%", "auto", False),
    (None, "auto", False), ("800KiB", "keep", False), (0.7, "offload", True), (None, "offload", True)])
def test_auto_offloads_only_for_a_budget_in_bytes_and_the_report_says_how(budget, profile, offload):
    _, run = _train("transformer", 2, dict(budget=budget, profile=profile))
    assert run.profile_offload is offload
    st = run.profile_stats
    assert st.mode == ("offload" if offload else "keep")
    report = run.report(file=io.StringIO())
    assert report.profile == st.mode
    if offload:
        assert "profiled step: saved activations offloaded to host memory" in report.table
        assert st.offloaded > 0 and 0 < st.activation_peak_bytes
    else:
        assert "profiled step: every saved activation kept on the device" in report.table
        assert "pass the budget in bytes (or profile='offload')" in report.table
        assert st.offloaded == 0 and st.activation_peak_bytes is None


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_training_after_an_offloaded_profile_is_plain_pytorch(name):
    budget = _least_budget(name)
    plain, _ = _train(name, 4)
    params, run = _train(name, 4, dict(budget=budget, planner="dp"))
    st = run.profile_stats
    assert st.mode == "offload" and st.offloaded > 0 and st.fetched > 0
    assert run.mismatches == 0 and run.steps_planned == 3 and run.plan is not None
    assert st.activation_peak_bytes < budget  # the profiled step's saved activations fit the budget
    assert all(torch.equal(a, b) for a, b in zip(plain, params))


@pytest.mark.parametrize("name, most", [("transformer", 0.35), ("cnn", 0.5), ("mlp", 1.0), ("lstm", 1.0)])
def test_the_profiled_step_holds_less_than_a_plain_step_as_the_executor_measures_it(name, most):
    """profile="offload" without a budget: the first step is profiled offloaded, the next run plainly
    and are measured by the executor (CPU: saved-activation storages alive). See
    test_profiler_offloaded_saves.py for why mlp and lstm cannot go far below plain's."""
    _, run = _train(name, 3, dict(budget=None, profile="offload"), hooked=True)
    plain = list(run.step_stats)  # no plan: every executed step keeps what plain PyTorch keeps
    assert len(plain) == 2 and run.plan is None
    measured_plain = plain[-1].peak_bytes
    profiled = run.profile_stats.activation_peak_bytes
    assert 0 < profiled < measured_plain and profiled <= most * measured_plain


@pytest.mark.parametrize("budget", [0.5, "80%"])
def test_a_fractional_budget_resolves_and_plans_the_same_from_either_profile(budget):
    _, keep = _train("cnn", 2, dict(budget=budget, planner="dp", profile="keep"))
    _, off = _train("cnn", 2, dict(budget=budget, planner="dp", profile="offload"))
    assert off.profile_stats.mode == "offload" and keep.profile_stats.mode == "keep"
    assert off.budget_bytes == keep.budget_bytes
    assert off.schedule.offload == keep.schedule.offload and off.schedule.prefetch_at == keep.schedule.prefetch_at
    assert off.mismatches == keep.mismatches == 0


class _RunsOutOfMemory(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a stand-in)")


@pytest.mark.parametrize("budget, profile, noted", [
    (0.5, "auto", True), ("50%", "auto", True), ("1GiB", "keep", True), ("1GiB", "auto", False),
    (0.5, "offload", False)])
def test_out_of_memory_in_a_kept_profiled_forward_says_how_to_profile_a_step_that_does_not_fit(
        budget, profile, noted):
    model = _RunsOutOfMemory()
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=budget, profile=profile):
        with pytest.raises(torch.OutOfMemoryError) as info:
            model(torch.randn(2, 4))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert ("Pass the budget in bytes (budget='6GiB') or profile='offload'" in notes) is noted


@pytest.mark.parametrize("name", ["transformer", "cnn", "lstm"])
@pytest.mark.parametrize("options", [dict(ooo=True), dict(ooo=True, fuse_optimizer=True), dict(planner="hybrid")],
                         ids=["ooo", "fused", "hybrid"])
def test_with_ooo_and_recompute_the_run_records_the_keep_all_trace_and_trains_as_plain(name, options):
    """The Run's trace of an offloaded profile equals its keep-all profile's, with out-of-order
    backward (dW items hold unpacked inputs), the fused update and hybrid's recompute, at the least
    budget of that trace; and four AdamW steps give plain PyTorch's parameters."""
    _, keep = _train(name, 1, dict(budget=None, profile="keep", **options))
    budget = _C.least_budget_bytes(keep.trace) + keep.optimizer_state_extra_  # the AdamW state, unless fused
    plain, _ = _train(name, 4)
    params, run = _train(name, 4, dict(budget=budget, **options))
    assert run.profile_stats.mode == "offload" and run.profile_stats.offloaded > 0
    assert_same_trace_structure(keep.trace, run.trace)
    assert run.mismatches == 0 and run.steps_planned == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, params))


@pytest.mark.parametrize("profile", ["offload", "keep"])
def test_the_report_says_when_the_profiled_step_went_over_the_budget(profile):
    """CUDA reports the profiled step's max_memory_allocated; above the budget the line says what to do
    (the figure is set by hand here: the CPU measures no device total)."""
    _, run = _train("transformer", 2, dict(budget=_least_budget("transformer") * 2, profile=profile))
    budget = run.budget_bytes + run.optimizer_state_extra_  # the budget asked for
    run.profile_stats.peak_bytes = budget + 1
    table = run.report(file=io.StringIO()).table
    assert "above the budget" in table
    assert ("later steps follow the plan" in table) is (profile == "offload")
    assert ("pass the budget in bytes (or profile='offload') to keep" in table) is (profile == "keep")
    run.profile_stats.peak_bytes = budget
    assert "above the budget" not in run.report(file=io.StringIO()).table


@pytest.mark.requires_cuda
def test_cuda_a_byte_budget_profiles_with_less_device_memory_and_trains_as_plain(unchecked_budget):
    """On CUDA: the profiled step's max_memory_allocated under profile="auto" with a byte budget is
    below the keep-all profiled step's, and training stays plain PyTorch's bit for bit."""
    def train(options, steps=3):
        torch.manual_seed(0)
        out = _train("transformer", steps, options, size="realistic", batch=8, device="cuda", lr=1e-3)
        torch.cuda.synchronize()
        return out

    _, keep = train(dict(budget=None, profile="keep"), steps=1)
    plain, _ = train(None)
    params, run = train(dict(budget=int(keep.trace.peak_bytes() * 0.8), planner="dp"))
    assert run.profile_stats.mode == "offload" and run.profile_stats.offloaded > 0
    assert run.profile_stats.peak_bytes < keep.profile_stats.peak_bytes
    assert run.mismatches == 0 and all(torch.equal(a, b) for a, b in zip(plain, params))
