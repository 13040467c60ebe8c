"""memsched.optimize() when the training loop calls optimizer.step() / zero_grad() itself (Trainer,
accelerate, Lightning): the step is profiled, planned and executed as with run.step(), and parameters,
gradients and optimizer state are bitwise those of plain PyTorch. See Note [optimizer.step() without
run.step()] in step_hook.py."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(12, 48)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(48, 48), nn.GELU(), nn.LayerNorm(48)) for _ in range(3)])
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _pair():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    return model, make(model), ref, make(ref)


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(64, 12, generator=g), torch.randint(0, 5, (64,), generator=g)


def _framework_loop(model, opt, steps=3, accumulation=1, closure=False, scheduler=None):
    """What Trainer / Lightning do: K forward+backward passes, optimizer.step(), zero_grad().
    Returns the gradients seen right before each optimizer step."""
    grads = []
    for s in range(steps):
        def micro(k):
            x, y = _batch(s * accumulation + k)
            loss = F.cross_entropy(model(x), y) / accumulation
            loss.backward()
            return loss
        for k in range(accumulation - 1):
            micro(k)
        if closure:  # Lightning: the last micro-batch's forward and backward run inside optimizer.step(closure)
            def run_closure():
                loss = micro(accumulation - 1)
                grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
                return loss
            loss = opt.step(closure=run_closure)
            assert torch.is_tensor(loss)  # the closure's loss comes back, as from torch's step
        else:
            micro(accumulation - 1)
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _assert_same(model, opt, ref, ref_opt, grads=None, ref_grads=None):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    if grads is not None:
        for step, (gs, rs) in enumerate(zip(grads, ref_grads)):
            for i, (g, r) in enumerate(zip(gs, rs)):
                assert (g is None) == (r is None) and (g is None or torch.equal(g, r)), f"step {step} grad {i}"


# With two micro-batches this model's peak is where no offload lowers it (dp refuses any budget
# below it), so accumulation is planned with offload_all_sync, which offloads every activation.
PLANS = [("dp", 0.7, 1), ("offload_all_sync", 1.0, 1), ("offload_all_sync", 1.0, 2)]


@pytest.mark.parametrize("planner,budget,accumulation", PLANS)
@pytest.mark.parametrize("closure", [False, True], ids=["step", "step_closure"])
def test_framework_step_is_planned_and_bitwise_plain(planner, budget, accumulation, closure):
    model, opt, ref, ref_opt = _pair()
    with memsched.optimize(model, opt, budget=budget, planner=planner) as run:
        grads = _framework_loop(model, opt, accumulation=accumulation, closure=closure)
    ref_grads = _framework_loop(ref, ref_opt, accumulation=accumulation, closure=closure)
    _assert_same(model, opt, ref, ref_opt, grads, ref_grads)
    # step 1 profiled and planned at its optimizer.step(); steps 2 and 3 executed the plan
    assert run.steps_profiled == 1 and run.steps_planned == 2 and run.steps_plain == 0
    assert all(s.offloaded > 0 for s in run.step_stats)
    assert "step" not in opt.__dict__  # optimizer.step is torch's again


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "ooo"])
@pytest.mark.parametrize("planner,budget,accumulation", [PLANS[0], PLANS[2]])
def test_framework_step_with_out_of_order_backward(fuse, planner, budget, accumulation):
    model, opt, ref, ref_opt = _pair()
    with memsched.optimize(model, opt, budget=budget, planner=planner, ooo=not fuse, fuse_optimizer=fuse,
                           grad_accumulation_steps=accumulation) as run:
        _framework_loop(model, opt, accumulation=accumulation)
    _framework_loop(ref, ref_opt, accumulation=accumulation)
    _assert_same(model, opt, ref, ref_opt)
    assert run.steps_profiled == 1 and run.steps_planned == 2
    if fuse:  # the profiled step updates at its optimizer.step() (Note [The profiled step updates after backward])
        assert run.ooo_.report()["fused_updates"] == 2 * len(list(model.parameters()))


def test_fused_update_with_a_step_hook_of_the_caller():
    """A user step hook sends the fused update through optimizer.step() on a view of the group
    (fused.py); those calls happen inside backward and must pass straight through."""
    model, opt, ref, ref_opt = _pair()
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(1))
    with memsched.optimize(model, opt, budget=0.7, planner="dp", fuse_optimizer=True):
        _framework_loop(model, opt)
    _framework_loop(ref, ref_opt)
    _assert_same(model, opt, ref, ref_opt)
    assert calls  # the hook ran for the fused updates


def test_accumulation_unlike_the_loops_is_refused_before_any_update():
    model, opt, _, _ = _pair()
    with memsched.optimize(model, opt, fuse_optimizer=True, grad_accumulation_steps=2):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0)
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(memsched.MemschedError, match=r"after 1 backward pass.*grad_accumulation_steps=2"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_budget_refused_at_the_framework_step_leaves_the_parameters_alone():
    model, opt, _, _ = _pair()
    with memsched.optimize(model, opt, budget=1000, planner="dp") as run:
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0)
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(memsched.MemschedError, match="least budget"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert run.profile_armed_  # the next step is profiled (and refused) again
    assert "step" not in opt.__dict__


@pytest.mark.parametrize("made", ["before", "inside"])
def test_lr_scheduler_made_before_or_inside_the_run(made):
    model, opt, ref, ref_opt = _pair()
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if made == "before" else None
        wrapped = opt.__dict__.get("step")
        with memsched.optimize(model, opt, budget=0.7, planner="dp"):
            if sched is None:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            _framework_loop(model, opt, scheduler=sched)
        _framework_loop(ref, ref_opt, scheduler=ref_sched)
    _assert_same(model, opt, ref, ref_opt)
    if made == "before":
        assert opt.__dict__["step"] is wrapped  # the scheduler's wrapper is back
    opt.step()  # after the Run: plain torch (inside: our layer, inert, passes through)


def test_run_step_loop_still_steps_once():
    model, opt, ref, ref_opt = _pair()
    with memsched.optimize(model, opt, budget=0.7, planner="dp") as run:
        for s in range(3):
            x, y = _batch(s)
            F.cross_entropy(model(x), y).backward()
            run.step()
    _framework_loop(ref, ref_opt)
    _assert_same(model, opt, ref, ref_opt)
    assert run.steps_profiled == 1 and run.steps_planned == 2


def test_lbfgs_closure_is_refused_and_one_run_per_optimizer():
    model = Net()
    opt = torch.optim.LBFGS(model.parameters())
    x, y = _batch(0)
    with memsched.optimize(model, opt):
        with pytest.raises(memsched.MemschedError, match="LBFGS evaluates its closure several times"):
            opt.step(lambda: F.cross_entropy(model(x), y))
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    with memsched.optimize(model, opt2):
        with pytest.raises(memsched.MemschedError, match="already routed through another"):
            memsched.optimize(model, opt2).__enter__()  # (Net() here is now refused: another model)
    assert "step" not in opt2.__dict__


def test_a_layer_left_under_a_later_lr_scheduler_keeps_no_run_alive():
    import gc
    import weakref
    model, opt, _, _ = _pair()
    with memsched.optimize(model, opt, budget=0.7, planner="dp") as run:
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps our layer
    ref = weakref.ref(run)
    del run
    gc.collect()
    assert ref() is None


def _scaled_model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(device)


def _scaled_loop(model, overflow_at, run_kwargs=None, device="cpu", make_opt=None):
    """fp16 autocast with a GradScaler; an overflow (an inf loss) at the given steps makes scaler.step() skip
    optimizer.step()."""
    import contextlib
    opt = (make_opt or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(model.parameters())
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 64, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device))
            for _ in range(6)]
    ctx = memsched.optimize(model, opt, **run_kwargs) if run_kwargs is not None else contextlib.nullcontext()
    with ctx as run:
        for step, (x, y) in enumerate(data):
            with torch.autocast(device, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            if step in overflow_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return run, scaler


@pytest.mark.parametrize("overflow_at", [(0,), (0, 1), (3,)])
def test_a_step_the_grad_scaler_skips_is_a_step_boundary(overflow_at):
    """GradScaler skips optimizer.step() on inf/NaN gradients (often in fp16's first steps): the memsched step
    ran on into the next iteration, so a profile spanned two of them -- a byte budget the loop meets was then
    refused mid-training -- and executed steps mismatched (Note [A step GradScaler skipped])."""
    plain, m = _scaled_model(), _scaled_model()
    _, plain_scaler = _scaled_loop(plain, overflow_at)
    run, scaler = _scaled_loop(m, overflow_at, dict(budget=_least_activation_budget(), planner="dp"))
    assert run.steps_profiled == 1 and run.steps_planned == 5 and run.steps_plain == 0
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert scaler.get_scale() == plain_scaler.get_scale()


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("unchecked_budget")
def test_a_step_the_grad_scaler_skips_is_a_step_boundary_on_cuda():
    """The same with CUDA's fp16 autocast and GradScaler, which is where fp16 training runs."""
    plain, m = _scaled_model("cuda"), _scaled_model("cuda")
    _, plain_scaler = _scaled_loop(plain, (0,), device="cuda")
    run, scaler = _scaled_loop(m, (0,), dict(budget=0.5, planner="dp", min_offload_bytes=0), device="cuda")
    assert run.steps_profiled == 1 and run.steps_planned == 5 and run.steps_plain == 0
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert scaler.get_scale() == plain_scaler.get_scale()


def _least_activation_budget(make_opt=None):
    """The least byte budget for _scaled_model's loop as a 1000-byte budget's refusal names it."""
    with pytest.raises(memsched.MemschedError, match=r"at least (\d+) bytes") as info:
        _scaled_loop(_scaled_model(), (), dict(budget=1000, planner="dp"), make_opt=make_opt)
    return int(re.search(r"at least (\d+) bytes", str(info.value)).group(1))


@pytest.mark.parametrize("overflow_at", [(), (0,)], ids=["no-skip", "skipped-first-step"])
def test_a_skipped_first_step_leaves_the_optimizer_state_to_the_first_update(overflow_at):
    """An optimizer whose state memsched measures after the first update (not a stock torch.optim class): a
    first step the scaler skipped spent that check on no update, so a byte budget that cannot hold the state
    was accepted (found by a helper). It is refused at the first real update, as without the skip."""
    class MyAdamW(torch.optim.AdamW):
        pass

    least = _least_activation_budget(lambda ps: torch.optim.SGD(ps, lr=1e-3))  # (no state: activations alone)
    model = _scaled_model()
    opt = MyAdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(memsched.MemschedError, match=r"of optimizer state that the first optimizer.step\(\) creates"):
        with memsched.optimize(model, opt, budget=least, planner="dp"):
            for i in range(4):
                x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss * (float("inf") if i in overflow_at else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()


def test_a_refusal_inside_scaler_step_lets_a_retry_with_the_same_scaler_train_as_plain():
    """A budget refused at the step boundary inside scaler.step(): the scaler kept this optimizer 'unscaled',
    so the retry the message names updated with gradients still scaled (14.8 off plain; found by a helper)."""
    least = _least_activation_budget()
    plain, m = _scaled_model(), _scaled_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]

    def train(model, opt, scaler, budget=None):
        import contextlib
        with memsched.optimize(model, opt, budget=budget, planner="dp") if budget else contextlib.nullcontext():
            for x, y in batches:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()

    with pytest.raises(memsched.MemschedError, match=r"raise the budget to at least"):
        train(m, opt, scaler, budget=1000)
    train(m, opt, scaler, budget=least)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-2)
    train(plain, plain_opt, torch.amp.GradScaler("cpu", init_scale=1024.0))
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_a_grad_scaler_step_wrapped_after_the_run_keeps_that_wrapper_when_the_run_ends():
    """Leaving the last Run put torch's GradScaler.step back over a wrapper someone set after ours (found by
    a helper); the step routing and the zero_grad watch already left such a layer in place."""
    original = torch.amp.GradScaler.step
    model = _scaled_model()
    try:
        with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1)):
            ours = torch.amp.GradScaler.step
            assert ours is not original

            def theirs(self, optimizer, *args, **kwargs):
                return ours(self, optimizer, *args, **kwargs)

            torch.amp.GradScaler.step = theirs
        assert torch.amp.GradScaler.step is theirs
    finally:
        torch.amp.GradScaler.step = original
