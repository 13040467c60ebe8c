"""A step that raises (out of memory, or any error) frees every tensor of the step.

Batch-size finders (Hugging Face's auto_find_batch_size, Lightning's
BatchSizeFinder) catch torch.OutOfMemoryError, drop the exception, and retry
with a smaller batch -- inside the same training loop, or by running the loop
again. After such an error nothing of memsched's may hold a tensor of the
failed step: not the Run, the profiler session, the offload executor (host
copies, fetched device copies, copies in flight), the out-of-order backward
(deferred work, partial gradient sums) or a hook left pushed.

On CPU the error is a Boom raised inside the forward, in a custom Function's
backward, or in the loss, after the step made its activations. What the step
made is watched with weak references to the storages of every tensor the
model's forward creates, and with a scan of every live torch.Tensor object
(gc.get_objects()) against a snapshot taken before the step: after the
exception is dropped and gc.collect() has run, every such storage is dead and
the only new tensors are the user's (gradients, optimizer state). The GPU test
triggers a real torch.OutOfMemoryError under a memory cap.
See Note [A step that raises] in optimize.py.
"""
import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memsched.optimize import optimize

pytest.importorskip("memsched.ooo")


class Boom(Exception):
    """Stands for torch.OutOfMemoryError on CPU."""


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises Boom while `model.fail == 'backward'`."""

    @staticmethod
    def forward(ctx, x, model):
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.model.fail == "backward":
            raise Boom("inside backward")
        return grad, None


class Failing(nn.Module):
    """Linear layers (one used twice: a partial gradient sum under ooo) with tensors of unique widths.

    `fail`: None, "forward" (raise after the activations are made), "backward" (raise in backward
    between the two uses of `b`, so part of backward has run and fetched offloaded activations).
    `made`: weak references to the storage of every tensor this forward created.
    """

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(24, 96), nn.Linear(96, 96), nn.Linear(96, 10)
        self.fail = None
        self.made = []

    def _note(self, t):
        self.made.append(weakref.ref(t.untyped_storage()))
        return t

    def forward(self, x):
        n = self._note
        h = n(torch.tanh(n(self.a(x))))
        g = n(torch.sigmoid(n(self.b(h))))
        if self.fail == "forward":
            raise Boom("inside forward")
        g = n(RaiseInBackward.apply(g, self))
        g = n(torch.tanh(n(self.b(g))))
        return n(self.c(g))


def _data(step, batch):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 24, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


def _step(model, x, y, fail_in_loss=False):
    out = model(x)
    loss = F.cross_entropy(out, y)
    if fail_in_loss:
        raise Boom("inside the loss")
    loss.backward()


def _attempt(fn, *args, **kw):
    """Run one step the way a batch-size finder does: catch the error and drop it (and its traceback,
    whose frames hold the step's tensors). True when it raised."""
    try:
        fn(*args, **kw)
    except Boom:
        return True
    return False


def _live_tensors():
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]  # type(): no weakproxy lookups


def _users_tensors(model, opt):
    """What the user owns after a step: parameters, gradients, optimizer state."""
    keep = []
    for p in model.parameters():
        keep.append(p)
        if p.grad is not None:
            keep.append(p.grad)
    for state in opt.state.values():
        keep += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {id(t) for t in keep}


def _assert_step_freed(model, opt, before, *held):
    """Every storage the failed step's forward made is freed; no tensor object made since `before`
    (a list of the tensors alive before the step) lives except the user's (and `held`)."""
    gc.collect()
    alive = [i for i, r in enumerate(model.made) if r() is not None]
    assert not alive, f"storages of the failed step still alive: tensors #{alive} of its forward"
    old = {id(t) for t in before} | _users_tensors(model, opt) | {id(t) for t in held}
    new = [t for t in _live_tensors() if id(t) not in old]
    assert not new, ("tensors of the failed step still held: "
                     + ", ".join(f"{tuple(t.shape)} {t.dtype} {t.device}" for t in new[:8]))
    model.made.clear()


def _no_hooks_pushed():
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks left pushed"
    assert torch._C._len_torch_dispatch_stack() == 0, "dispatch mode left active"


CONFIGS = {
    "offload_all_sync": dict(planner="offload_all_sync", budget=1.0),
    "offload_all_prefetch": dict(planner="offload_all_prefetch", budget=1.0),
    "dp": dict(planner="dp", budget=0.5),
    "ooo": dict(planner="offload_all_prefetch", budget=1.0, ooo=True),
    "fused": dict(planner="offload_all_prefetch", budget=1.0, fuse_optimizer=True),
    # the profiled step's saved activations in host memory (Note [Profiling a step that does not fit])
    "offloaded_profile": dict(planner="offload_all_prefetch", budget=1.0, profile="offload"),
}
WHERE = ["forward", "backward", "loss"]


def _make(kind):
    torch.manual_seed(0)
    model = Failing()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def _fail_once(model, opt, where, step, batch=16):
    """One failing attempt (at batch 16: a batch-size finder's first try); returns the tensors alive before it."""
    model.made.clear()
    before = _live_tensors()
    model.fail = where if where != "loss" else None
    x, y = _data(step, batch)
    assert _attempt(_step, model, x, y, fail_in_loss=where == "loss")
    del x, y
    model.fail = None
    return before


# -- caught inside the with block: the loop goes on with a smaller batch ---------------------------------
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("phase", ["profiled", "planned"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_step_caught_inside_the_run_frees_its_tensors_and_the_next_steps_are_correct(
        config, phase, where):
    model, opt = _make(config)
    ref, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    fused = CONFIGS[config].get("fuse_optimizer", False)
    grads = []
    with optimize(model, opt, **CONFIGS[config]) as run:
        done = 0
        if phase == "planned":
            for step in range(2):  # profiled, then planned
                _step(model, *_data(step, 8))
                run.step()
            done = 2
            assert run.step_stats and run.step_stats[-1].mode == "planned"
            if config != "dp":
                # (this small model's step peaks at its parameters, gradients and momentum: dp rightly
                # keeps every activation there; the offload_all configs cover offloaded steps)
                assert run.step_stats[-1].offloaded > 0 and run.step_stats[-1].h2d_bytes > 0
        # planned: a step of the plan's own shapes fails (one of other shapes would be profiled for them,
        # Note [One plan per input shape])
        before = _fail_once(model, opt, where, done, batch=8 if phase == "planned" else 16)
        if where == "forward" and phase == "planned":
            _no_hooks_pushed()  # (a profiled forward's session leaves at the next forward)
        _assert_step_freed(model, opt, before)
        if where == "loss" and phase == "profiled" and config == "dp":
            # Freed, as checked above; but nothing tells a loss that raised from a second forward of
            # the same step (model(a), model(b), loss(a, b)), so the retry is recorded into the
            # same trace, and a fractional budget of that trace is refused.
            pytest.xfail("a loss that raised in the profiled step: the retry is profiled with it")
        # The retry: a smaller batch, the user zeroes what a failed backward may have accumulated.
        opt.zero_grad(set_to_none=True)
        for step in range(done, done + 3):
            _step(model, *_data(step, 8))
            grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
            run.step()
    _no_hooks_pushed()
    if fused and where == "backward":
        return  # the fused update stepped `c` during the failed backward, as documented; no reference
    for step in range(done + 3):
        _step(ref, *_data(step, 8))
        if step >= done:
            ref_grads = [p.grad.clone() for p in ref.parameters()]
            if not fused:
                for g, r in zip(grads[step - done], ref_grads):
                    assert torch.equal(g, r), f"step {step}: gradient differs after the failed step"
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs after the failed step"


# -- the error leaves the with block (the finder reruns the whole loop) ---------------------------------
def _train_until_failure(model, opt, config, where, planned):
    with optimize(model, opt, **CONFIGS[config]) as run:
        step = 0
        if planned:
            for step in range(2):
                _step(model, *_data(step, 8))
                run.step()
            assert run.step_stats[-1].mode == "planned"
        model.fail = where if where != "loss" else None
        _step(model, *_data(step, 16), fail_in_loss=where == "loss")
        run.step()  # not reached


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("phase", ["profiled", "planned"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_step_leaving_the_run_frees_its_tensors_and_the_run(config, phase, where):
    model, opt = _make(config)
    hooks_before = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
    before = _live_tensors()
    assert _attempt(_train_until_failure, model, opt, config, where, phase == "planned")
    model.fail = None
    _no_hooks_pushed()
    gc.collect()
    _assert_step_freed(model, opt, before)
    hooks_after = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert hooks_after == hooks_before, "hooks left on the model"
    assert all("forward" not in m.__dict__ for m in model.modules()), "a patched forward left on the model"
    # a new Run on the same model trains
    opt.zero_grad(set_to_none=True)
    with optimize(model, opt, **CONFIGS[config]) as run:
        for step in range(3):
            _step(model, *_data(step, 8))
            run.step()
    assert [s.mode for s in run.step_stats] == ["planned", "planned"]


def test_the_run_itself_is_freed_once_the_failed_loop_is_gone():
    """Nothing the model or torch keeps (hooks, saved-tensor hooks, dispatch modes) refers to a Run whose
    block the error left: it dies with its last user reference."""
    model, opt = _make("ooo")
    refs = []

    def loop():
        with optimize(model, opt, **CONFIGS["ooo"]) as run:
            refs.append(weakref.ref(run))
            for step in range(2):
                _step(model, *_data(step, 8))
                run.step()
            model.fail = "backward"
            _step(model, *_data(2, 16))

    assert _attempt(loop)
    model.fail = None
    gc.collect()
    assert refs[0]() is None, "the Run outlives its block: something still refers to it"


# -- a real out-of-memory error on CUDA ------------------------------------------------------------------
class Wide(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.layers(x))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("planner", ["offload_all_prefetch", "dp"])
@pytest.mark.parametrize("ooo", [False, True])
def test_cuda_out_of_memory_inside_a_step_returns_the_memory_and_a_smaller_batch_trains(planner, ooo, unchecked_budget):
    # An index: set_per_process_memory_fraction raises ValueError for torch.device("cuda") (no index).
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    cap_bytes = 2 << 30  # 2 GiB for this process
    torch.manual_seed(0)
    width = 2048
    model = Wide(width).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, dev)
    try:
        def step(run, batch, seed):
            gen = torch.Generator(device=dev).manual_seed(seed)
            x = torch.randn(batch, width, device=dev, generator=gen)
            y = torch.randint(0, 10, (batch,), device=dev, generator=gen)
            F.cross_entropy(model(x), y).backward()
            run.step()

        def attempt(run, batch, seed):
            try:
                step(run, batch, seed)
            except torch.OutOfMemoryError:
                return True
            return False

        with optimize(model, opt, planner=planner, budget=0.5, ooo=ooo, min_offload_bytes=0) as run:
            for seed in range(3):  # profiled, then planned
                step(run, 256, seed)
            torch.cuda.synchronize()
            gc.collect()
            baseline = torch.cuda.memory_allocated(dev)
            # 6 layers x batch x 2048 x 4 bytes x ~2 saved tensors: far above 2 GiB at this batch
            assert attempt(run, 1 << 16, 10), "the big batch was expected to run out of memory"
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated(dev) <= baseline, (
                f"{torch.cuda.memory_allocated(dev) - baseline} bytes still allocated after the failed step")
            for seed in range(20, 23):
                step(run, 256, seed)
            assert all(torch.isfinite(p).all() for p in model.parameters())
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(dev) <= baseline
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
