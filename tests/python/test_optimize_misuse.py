"""memsched.optimize misused the way a new user might: each gets a clear error, never a silent change."""
import copy

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.optimize import optimize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def test_a_refused_plan_caught_by_the_caller_is_refused_again_not_run_plainly():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    refusals = 0
    with optimize(model, opt, budget=1000, planner="dp") as run:
        for _ in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            model(x).sum().backward()
            try:
                run.step()
            except memsched.MemschedError as err:
                assert "least budget" in str(err)
                refusals += 1
            # refused: the optimizer did not step
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            opt.zero_grad()
    assert refusals == 3 and len(run.step_stats) == 0


def test_a_profiled_step_without_backward_says_so():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with optimize(model, opt, budget=0.5) as run:
        model(torch.randn(4, 8)).sum()
        with pytest.raises(memsched.MemschedError, match=r"no backward pass.*loss.backward\(\)"):
            run.step()


def test_a_model_on_the_meta_device_is_refused():
    with pytest.raises(ValueError, match="meta"):
        optimize(_model().to("meta"), None)


@pytest.mark.parametrize("kw", ["ooo", "fuse_optimizer"])
def test_flags_must_be_booleans(kw):
    with pytest.raises(ValueError, match=kw):
        optimize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), **{kw: "yes"})


def test_accumulation_steps_without_ooo_are_refused_rather_than_ignored():
    with pytest.raises(ValueError, match="grad_accumulation_steps.*ooo=True"):
        optimize(_model(), None, grad_accumulation_steps=2)


def test_timeline_must_be_a_boolean():
    with pytest.raises(ValueError, match="timeline"):
        optimize(_model(), None, timeline="no")


def test_out_of_order_backward_fuse_flag_must_be_a_boolean():
    model = _model()
    with pytest.raises(memsched.MemschedError, match="fuse_optimizer"):
        memsched.OutOfOrderBackward(model, torch.optim.SGD(model.parameters(), lr=0.1), fuse_optimizer="yes")


def test_an_optimizer_over_another_models_parameters_is_refused_before_any_work():
    # was: accepted; memsched profiled and planned `model` while every step updated the other module
    model, other = _model(), _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"optimizer: none of its 4 parameters belongs to `model`.*"
                                         r"model\.parameters\(\)"):
        optimize(model, torch.optim.SGD(other.parameters(), lr=0.1), budget=0.5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("budget", [0.5, None])
def test_a_learned_temperature_beside_the_models_parameters_trains_as_plain_pytorch(budget):
    # parameters outside the model that the loss uses are what plain PyTorch trains too: accepted
    def setup():
        model = _model()
        temperature = nn.Parameter(torch.tensor(1.5))
        return model, temperature, torch.optim.SGD(list(model.parameters()) + [temperature], lr=0.1)

    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model, temperature, opt = setup()
    for x in xs:
        (model(x) / temperature).logsumexp(-1).sum().backward()
        opt.step()
        opt.zero_grad()
    twin, twin_temperature, twin_opt = setup()
    with optimize(twin, twin_opt, budget=budget) as run:
        for x in xs:
            (twin(x) / twin_temperature).logsumexp(-1).sum().backward()
            run.step()
    assert torch.equal(temperature, twin_temperature) and temperature.item() != 1.5
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_an_optimizer_over_part_of_the_model_is_accepted():
    model = _model()
    optimize(model, torch.optim.SGD(model[2].parameters(), lr=0.1))  # fine-tuning the head only


def test_run_step_right_after_the_loops_optimizer_step_warns_of_a_second_update():
    """opt.step(); run.step(): run.step() steps the optimizer too (a second update with the same
    gradients, as `opt.step(); opt.step()` would in plain PyTorch): said once. A plain run.step() loop,
    an optimizer.step() loop, and a second run.step() after the gradients were zeroed say nothing."""
    import warnings

    def train(pattern):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        o = torch.optim.AdamW(m.parameters())
        x = torch.randn(4, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with memsched.optimize(m, o, budget=0.7) as run:
                for _ in range(3):
                    m(x).sum().backward()
                    pattern(o, run)
        return [w for w in caught if "second update" in str(w.message)]

    def both(o, run):
        o.step()
        run.step()

    def twice(o, run):
        run.step()
        run.step()

    def loop_steps(o, run):
        o.step()
        o.zero_grad()

    assert len(train(both)) == 1
    assert train(lambda o, run: run.step()) == [] and train(loop_steps) == [] and train(twice) == []


def test_a_loop_calling_the_models_layers_itself_is_told_memsched_saw_no_forward():
    """`for layer in model: x = layer(x)` never calls the wrapped module: nothing is profiled or planned, and
    the only word was that run.step() 'is a second update with the same gradients', which was false (one
    update per step, parameters equal plain's)."""
    import warnings

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(m, torch.optim.AdamW(m.parameters()), budget=0.5) as run:
            for _ in range(3):
                h = x
                for layer in m:
                    h = layer(h)
                h.sum().backward()
                run.step()
    said = [str(w.message) for w in caught if "memsched" in str(w.message)]
    assert not [w for w in said if "second update" in w], said
    assert len([w for w in said if "the wrapped model's forward did not run" in w and "Call the model itself" in w]) == 1


@pytest.mark.parametrize("budget", [None, 0.5, "1GiB"])
def test_an_error_of_the_model_in_the_profiled_step_says_it_is_the_models(budget):
    """A float64 batch into a float32 model in the first step, whose ops memsched's profiler passes on: torch's
    own error, with a note that the memsched frames in its traceback only passed the op on."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memsched.optimize(model, opt, budget=budget) as run:
        with pytest.raises(RuntimeError, match="must have the same dtype") as info:
            model(torch.randn(4, 8, dtype=torch.float64))
        assert "passing that op on to PyTorch unchanged" in "".join(getattr(info.value, "__notes__", []))
        model(torch.randn(4, 8)).sum().backward()  # the next step is profiled and trains
        run.step()
    assert run.steps_profiled == 1
    with pytest.raises(RuntimeError, match="must have the same dtype") as info:
        model(torch.randn(4, 8, dtype=torch.float64))  # no Run: no note
    assert not getattr(info.value, "__notes__", [])


def test_an_error_raised_in_memscheds_own_code_is_not_blamed_on_the_model():
    """The pass-through note (the op 'raises without memsched.optimize() too') is for errors of ops memsched
    passes on; one raised in memsched's own code (a call into _C: the innermost frame is memsched's) got it
    too, and the note claimed plain PyTorch raises it (a saved nested tensor, which plain PyTorch trains)."""
    import sys
    mod = sys.modules["memsched.optimize"]
    ours = compile("def ours():\n    raise RuntimeError('inside memsched')\n", mod.__file__, "exec")
    scope = {}
    exec(ours, scope)

    def model_op():  # a frame outside memsched, under one of memsched's, as torch's op call is
        raise RuntimeError("an op of the model")

    through = compile("def through(f):\n    f()\n", mod.__file__, "exec")
    exec(through, scope)
    for call, noted in ((lambda: scope["ours"](), False), (lambda: scope["through"](model_op), True)):
        try:
            call()
        except RuntimeError as e:
            mod._explain_pass_through(e)
            assert ("passing that op on" in "".join(getattr(e, "__notes__", []))) == noted, str(e)


def test_a_reentrant_checkpoint_around_the_whole_model_is_named_when_its_steps_do_not_match():
    """checkpoint(model, x, use_reentrant=True) recomputes the whole forward inside backward, where the step
    saves what memsched profiled in forward: every step mismatched with only 'the trace has [..], this step
    has [..]'. Gradients stay plain's; the warning now names the checkpoint and the ways on."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    with pytest.warns(RuntimeWarning, match=r"the model's forward ran inside a backward pass, as "
                                            r"torch.utils.checkpoint\(model, ..., use_reentrant=True\)"):
        with memsched.optimize(m, torch.optim.AdamW(m.parameters()), budget=1.0, planner="dp") as run:
            for _ in range(3):
                out = checkpoint(m, torch.randn(512, 32, requires_grad=True), use_reentrant=True)
                nn.functional.cross_entropy(out, torch.randint(0, 10, (512,))).backward()
                run.step()


def test_steps_that_keep_changing_shape_say_once_that_no_plan_runs_any_more():
    """Dynamically padded batches: every step has another sequence length, so after max_reprofiles
    re-profiles every step ran plainly, said only in run.report() (3 profiled, 0 planned)."""
    import warnings

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(m, torch.optim.AdamW(m.parameters()), budget=0.5, max_reprofiles=1) as run:
            for length in range(8, 8 + 16):  # a new length at every step: more than a plan per shape covers
                m(torch.randn(4, length, 16)).sum().backward()
                run.step()
    said = [str(w.message) for w in caught if "steps keep changing" in str(w.message)]
    assert len(said) == 1 and "pad_to_multiple_of" in said[0] and "max_reprofiles=1" in said[0], said
    assert run.steps_planned == 0


def test_shapes_made_from_input_values_are_named_when_the_inputs_keep_their_shapes():
    """An nn.LSTM over pack_padded_sequence with lengths that vary: the inputs keep their shapes, so a plan per
    input shape cannot help and the advice to pad to a few lengths did not apply (found by a helper)."""
    import warnings

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm, self.out = nn.Embedding(30, 16), nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 4)

        def forward(self, x, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
            return self.out(self.lstm(packed)[1][0][-1])

    torch.manual_seed(0)
    m = Packed()
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(m, torch.optim.AdamW(m.parameters()), budget=0.5, max_reprofiles=1) as run:
            for step in range(8):
                lengths = torch.randint(1, 11, (8,), generator=g)  # another total length at most steps,
                lengths[0] = 10                                   # one padded shape
                m(torch.randint(0, 30, (8, 10), generator=g), lengths).sum().backward()
                run.step()
    said = [str(w.message) for w in caught if "steps keep changing" in str(w.message)]
    assert len(said) == 1 and "inputs have the profiled step's shapes" in said[0] and "pack_padded_sequence" in said[0]
    assert "pad_to_multiple_of" not in said[0], said


def test_a_run_entered_again_after_its_with_block_routes_the_loops_optimizer_step_again():
    """The ooo refusals advise leaving the `with` block and entering it again: the same Run's second
    `with` raised "'NoneType' object is not callable" at the loop's first optimizer.step() (its step
    routing had let go of the Run at exit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for _ in range(3):
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    run = memsched.optimize(model, opt, budget=0.7)
    for steps in (2, 1):
        with run:
            for _ in range(steps):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        assert "step" not in opt.__dict__ and not model._forward_pre_hooks  # everything removed each time
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("fuse", [False, True])
def test_a_new_optimizer_over_the_runs_parameters_is_named(fuse):
    """A fine-tuning phase makes a new optimizer inside the Run: memsched saw no step boundary any more
    (nothing planned, a mismatch warning blaming an activation), and with the fused update the old optimizer
    kept updating the model inside backward (9e-3 off plain) while the new one found no gradients. An
    optimizer over other parameters (the head's own) is not named."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    head_opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(model, opt, budget=0.7, fuse_optimizer=fuse) as run:
            for _ in range(2):
                nn.functional.cross_entropy(model(x), y).backward()
                head_opt.step()  # another optimizer, other parameters: fine
                head_opt.zero_grad()
                run.step()
            assert not [w for w in caught if "another optimizer" in str(w.message)]
            opt = torch.optim.AdamW(model[0].parameters(), lr=1e-3)  # a new phase, a new optimizer
            nn.functional.cross_entropy(model(x), y).backward()
            if fuse:
                with pytest.raises(memsched.MemschedError, match=r"another optimizer \(AdamW\) steps parameters that "
                                                                 r"the optimizer given to memsched.optimize"):
                    opt.step()
            else:
                opt.step()
                opt.step()
    said = [str(w.message) for w in caught if "another optimizer" in str(w.message)]
    assert len(said) == (0 if fuse else 1) and all("Run of its own" in s for s in said)


def test_a_reprofile_refused_after_validation_forwards_with_gradients_names_them():
    """A validation forward in eval mode without torch.no_grad() after each step: its graph lives into the
    next step, whose saves then hold it; the re-profiled step cannot be planned within the accepted budget,
    and the refusal named only the mismatch, not the validation forward (found by a helper following the
    README)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 4))
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    with pytest.raises(memsched.MemschedError, match=r"changed after its budget was accepted.*validation forward "
                                                     r"whose saves count as the step's: run it under torch.no_grad"):
        with pytest.warns(RuntimeWarning):
            with memsched.optimize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), budget=0.5) as run:
                for x in xs:
                    m.train()
                    m(x).pow(2).mean().backward()
                    run.step()
                    m.eval()
                    val = m(x).sum()  # noqa: F841 (kept, as a loop keeps its metric tensor)


def test_an_optimizer_that_steps_an_inner_one_is_not_taken_for_another_optimizer():
    """A Lookahead-style wrapper given to optimize() steps its inner optimizer over the same parameters:
    that nested step was warned about as 'another optimizer', with a false 'plans nothing' (found by a
    helper reviewing the watch)."""
    import warnings

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, base):
            self._base_optimizer = base
            super().__init__(base.param_groups, {})

        def step(self, closure=None):
            return self._base_optimizer.step(closure)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    opt = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(model, opt, budget=0.7) as run:
            for _ in range(3):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()  # the loop's own, routed
                opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            run.step()  # run.step()'s own
    assert not [w for w in caught if "another optimizer" in str(w.message)]
