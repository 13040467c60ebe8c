"""memsched.optimize() in an accelerate loop: `accelerator.prepare` wraps the optimizer, and with
`accelerator.accumulate(model)` the loop calls optimizer.step() on every micro-batch while accelerate
steps the real optimizer only on the last. optimize() routes the real optimizer's step, so the memsched
step spans the accumulation; parameters are bitwise those of the same loop without memsched."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")

import memsched  # noqa: E402


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 5))


def _loop(model, accumulation, use_memsched, **optimize_kw):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = accelerator.prepare(model, opt)
    run = None

    def train():
        for i in range(3 * accumulation):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(32, 12, generator=g), torch.randint(0, 5, (32,), generator=g)
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()

    if use_memsched:
        with memsched.optimize(model, opt, **optimize_kw) as run:
            train()
    else:
        train()
    return run


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("fuse", [False, True], ids=["offload", "fused"])
def test_accelerate_loop_equals_plain(accumulation, fuse):
    model, ref = _net(), None
    ref = copy.deepcopy(model)
    kw = dict(budget=1.0, planner="offload_all_prefetch")
    if fuse:
        kw.update(fuse_optimizer=True, grad_accumulation_steps=accumulation)
    run = _loop(model, accumulation, True, **kw)
    _loop(ref, accumulation, False)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert run.steps_profiled == 1 and run.steps_planned == 2  # one memsched step per real optimizer step
    assert all(s.offloaded > 0 for s in run.step_stats)
    assert isinstance(run.optimizer, torch.optim.AdamW)  # the optimizer accelerate wraps


def _run_step_loop(model, accumulation, scaled, use_memsched, prepare_first=True):
    """The README's run.step() loop inside accelerate: run.step() where the loop would call opt.step() and
    opt.zero_grad(). `scaled`: accelerate's GradScaler path (what mixed_precision="fp16" sets up on a GPU;
    a CPU GradScaler here). Returns the number of real optimizer updates and the Run."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    if scaled:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    updates = []
    opt.register_step_post_hook(lambda *a: updates.append(1))
    run = memsched.optimize(model, opt, budget=1.0, planner="offload_all_prefetch") if use_memsched else None
    if run is not None and not prepare_first:
        run.__enter__()
    model, opt = accelerator.prepare(model, opt)
    if run is not None and prepare_first:
        run = memsched.optimize(model, opt, budget=1.0, planner="offload_all_prefetch").__enter__()
    try:
        for i in range(4 * accumulation):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(32, 12, generator=g), torch.randint(0, 5, (32,), generator=g)
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                if run is not None:
                    run.step()
                else:
                    opt.step()
                    opt.zero_grad()
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return len(updates), run


@pytest.mark.parametrize("prepare_first", [True, False], ids=["prepare-then-optimize", "optimize-then-prepare"])
@pytest.mark.parametrize("accumulation, scaled", [(2, False), (1, True)], ids=["accumulate2", "grad-scaler"])
def test_run_step_in_an_accelerate_loop_is_the_wrappers_step(accumulation, scaled, prepare_first):
    """run.step() stepped the torch optimizer inside accelerate's wrapper directly: an update at every
    micro-batch under accumulate(), and with a GradScaler updates with scaled gradients and no
    scaler.update() (9.84 off plain). It is now the wrapper's step() and zero_grad(), and a Run entered
    before the GradScaler's wrapper keeps its step boundary (it never planned)."""
    model = _net()
    ref = copy.deepcopy(model)
    plain_updates, _ = _run_step_loop(ref, accumulation, scaled, False)
    updates, run = _run_step_loop(model, accumulation, scaled, True, prepare_first)
    assert updates == plain_updates == 4
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert run.steps_profiled == 1 and run.steps_planned == 3 and run.steps_plain == 0


def test_a_short_last_accumulation_at_the_end_of_the_dataloader_is_named():
    """accelerate ends an accumulation at the end of its dataloader: with ooo/fuse_optimizer the refusal
    spoke of Lightning's training_step and the callbacks, not of the epoch's batch count (found by a helper)."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = _net()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(20, 12), torch.randint(0, 5, (20,))), batch_size=4)  # 5 batches
    model, opt, loader = accelerator.prepare(model, opt, loader)
    try:
        with pytest.raises(memsched.MemschedError, match=r"end of its dataloader.*number of batches per epoch a "
                                                         r"multiple of 2"):
            with memsched.optimize(model, opt, budget=1.0, fuse_optimizer=True, grad_accumulation_steps=2):
                for x, y in loader:
                    with accelerator.accumulate(model):
                        accelerator.backward(F.cross_entropy(model(x), y))
                        opt.step()
                        opt.zero_grad()
    finally:  # the interrupted epoch leaves accelerate's shared state inside its dataloader
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _scaled_accelerator(model, opt):
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    return accelerator, *accelerator.prepare(model, opt)


def _scaled_steps(model, accelerator, step, n=4):
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 12, generator=g), torch.randint(0, 5, (32,), generator=g)
        accelerator.backward(F.cross_entropy(model(x), y))
        step()


def test_the_optimizer_inside_a_wrapper_made_before_the_run_is_stepped_through_the_wrapper_or_refused():
    """The torch optimizer passed after accelerator.prepare() (fp16's GradScaler on the wrapper): the loop's own
    wrapper.step() keeps memsched's step boundary (it never planned), and run.step() -- which would step scaled
    gradients past the wrapper -- is refused before anything changes, naming the wrapper to pass. A wrapper
    left from an earlier training is treated the same (a stale fp16 wrapper unscaled a later loop's gradients)."""
    model, ref = _net(), _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    accelerator, model, wrapper = _scaled_accelerator(model, opt)
    ref_accelerator, ref, ref_wrapper = _scaled_accelerator(ref, torch.optim.SGD(ref.parameters(), lr=1e-2))

    def loop_step(w):
        return lambda: (w.step(), w.zero_grad())

    _scaled_steps(ref, ref_accelerator, loop_step(ref_wrapper))
    with memsched.optimize(model, opt, budget=1.0, planner="offload_all_prefetch") as run:
        _scaled_steps(model, accelerator, loop_step(wrapper))
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(memsched.MemschedError, match=r"inside an accelerate AcceleratedOptimizer that existed "
                                                         r"before.*still scaled.*Nothing was changed"):
            _scaled_steps(model, accelerator, run.step, n=1)
        assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
        model.zero_grad()
    assert run.steps_profiled == 1 and run.steps_planned == 3
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
