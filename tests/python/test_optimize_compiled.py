"""torch.compile under memsched.optimize (issue 9): a compiled model -- torch.compile(model) or
model.compile(), or one with a compiled submodule -- is found at optimize(), warned about once with the
reason, and runs plainly: no profile, no mismatch, no re-profiling; run.report() says so.
See Note [Compiled modules run plainly] in optimize.py."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

from memsched.optimize import compiled_module_reason, optimize


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def test_compiled_modules_are_detected_without_compiling():
    # torch.compile and Module.compile are lazy: nothing is compiled until the first call
    assert compiled_module_reason(make()) is None
    assert "torch.compile(module)" in compiled_module_reason(torch.compile(make()))
    m = make()
    m.compile()
    assert "module.compile()" in compiled_module_reason(m)
    outer = nn.Sequential(make(), nn.ReLU())
    outer[0].compile()
    assert "submodule '0'" in compiled_module_reason(outer)
    m = make()
    m[0].forward = torch.compile(m[0].forward)  # as Lightning's fit(torch.compile(module)) does to the module
    assert "submodule '0' is compiled (its forward is torch.compile(module.forward))" == compiled_module_reason(m)


@pytest.mark.parametrize("how", ["wrap", "method"])
def test_compiled_model_runs_plainly_with_one_clear_warning(how, capsys):
    # backend="eager": dynamo traces the model (as with inductor) but no C++ is compiled, so CI stays fast
    model = make()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    if how == "wrap":
        run_model = torch.compile(model, backend="eager")
    else:
        model.compile(backend="eager")
        run_model = model
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimize(run_model, opt, budget=0.5) as run:
            for _ in range(3):
                run_model(x).sum().backward()
                run.step()
    ours = [str(w.message) for w in caught if "memsched" in str(w.message)]
    assert len(ours) == 1, ours
    assert "compiled" in ours[0] and "run plainly" in ours[0] and "saves other tensors" in ours[0]
    assert run.mismatches == 0 and run.reprofiles == 0 and run.steps_profiled == 0 and run.plan is None
    for _ in range(3):
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    report = run.report()
    assert any("is compiled" in n and "ran plainly" in n for n in report.notes)
    # was: "0 profiled, 0 planned, 0 plain" after 3 steps, and a note on how "the profiled step" held its saves
    assert (report.steps_profiled, report.steps_planned, report.steps_plain) == (0, 0, 3)
    assert "0 profiled, 0 planned, 3 plain" in report.table
    assert not any(n.startswith("profiled step") for n in report.notes)
