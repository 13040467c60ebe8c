"""A parameter that a backward node reads after the parameter's gradient is final (Note [A parameter
read after its gradient is final] in ooo/backward.py): early in the forward the model reads a
weight through an alias that sends it no gradient (`weight.detach()`, `weight.data`, a row of
`weight.detach()`); later the weight's own layer uses it with gradient. The fused update used to
step the weight at its final gradient, before the early read's backward node ran: with `.data` that
node silently read the stepped weights (parameters 4.5e-3 off plain after 4 steps), with `.detach()`
the version check raised mid-backward. Under memsched.optimize such a parameter's update waits for
the end of backward: parameters equal plain PyTorch's bit for bit."""
import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import memsched

STEPS = 4


class EarlyRead(nn.Module):
    """`b.weight` read at the start through `alias` (no gradient to it), then used by `b`."""

    def __init__(self, alias):
        super().__init__()
        self.alias = alias
        self.c, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.c(x)
        if hasattr(self, "probe"):
            x = self.probe(x)
        w = self.b.weight
        if self.alias == "detach":
            x = x @ w.detach().t()
        elif self.alias == "data":
            x = x @ w.data.t()
        elif self.alias == "detach_row":
            x = x * w.detach()[0]  # mul saves the row: a view on b.weight's storage
        return self.b(torch.tanh(self.a(x)))


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _optimizer(kind, params):
    if kind == "adamw":  # the C++ Adam update (Note [Adam plan for the C++ update] in fused.py)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # the grouped Python update


def _plain(model, opt, accumulation):
    for k, x in enumerate(_batches()):
        model(x).square().sum().backward()
        if (k + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()


def _assert_bitwise(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"


def _fused_trains_as_plain(ref, model, optimizer="adamw", standalone=False, **options):
    """`ref` trained plainly, `model` (the same weights) with the fused update and `options`, under
    memsched.optimize or (standalone) OutOfOrderBackward alone, whose first iteration is watched instead of
    profiled (Note [The first fused iteration watches its parameter reads] in ooo/backward.py): a hold was
    seen, and the parameters are bitwise equal."""
    _plain(ref, _optimizer(optimizer, ref.parameters()), options.get("grad_accumulation_steps", 1))
    opt = _optimizer(optimizer, model.parameters())
    if standalone:
        with memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True, **options) as ooo:
            for x in _batches():
                model(x).square().sum().backward()
                if ooo.step():
                    opt.step()
                    opt.zero_grad()
            assert ooo.holds_seen
    else:
        with memsched.optimize(model, opt, ooo=True, fuse_optimizer=True, **options) as run:
            for x in _batches():
                model(x).square().sum().backward()
                run.step()
            assert run.ooo_.holds_seen
    _assert_bitwise(ref, model)


ENTRIES = ["optimize", "standalone"]


@pytest.mark.parametrize("alias", ["data", "detach", "detach_row"])
@pytest.mark.parametrize("options", [dict(), dict(timeline=True), dict(grad_accumulation_steps=2),
                                     dict(standalone=True), dict(standalone=True, grad_accumulation_steps=2)],
                         ids=["no-hooks-after-profile", "hooks-every-step", "accumulate2", "standalone",
                              "standalone-accumulate2"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_weight_read_early_through_an_alias_trains_as_plain(alias, options, optimizer):
    """Standalone, `.data` read the stepped weights (1.2e-3 off plain after 4 AdamW steps) and `.detach()`
    raised PyTorch's in-place error mid-backward before the first iteration was watched."""
    torch.manual_seed(0)
    base = EarlyRead(alias)
    _fused_trains_as_plain(copy.deepcopy(base), copy.deepcopy(base), optimizer, **options)


class EarlyReadWrapped(EarlyRead):
    """The early read inside the caller's own saved-tensor hooks: save_on_cpu, or a non-reentrant
    checkpoint whose recompute in backward reads b.weight again. Those hooks get the saves, not
    memsched's; the profiler's dispatch mode sees the read."""

    def __init__(self, alias, wrapper):
        super().__init__(alias)
        self.wrapper = wrapper

    def forward(self, x):
        x = self.c(x)
        w = self.b.weight
        read = (lambda t: t @ w.detach().t()) if self.alias == "detach" else (lambda t: t @ w.data.t())
        if self.wrapper == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                x = read(x)
        else:
            x = torch.utils.checkpoint.checkpoint(lambda t: read(torch.tanh(t)), x, use_reentrant=False)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("alias", ["data", "detach"])
@pytest.mark.parametrize("wrapper", ["save_on_cpu", "checkpoint"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_weight_read_early_under_the_callers_own_hooks_trains_as_plain(alias, wrapper, entry):
    torch.manual_seed(0)
    base = EarlyReadWrapped(alias, wrapper)
    _fused_trains_as_plain(copy.deepcopy(base), copy.deepcopy(base), standalone=entry == "standalone")


class _CtxRead(torch.autograd.Function):
    """Keeps a module on ctx and reads its weight in backward only (not saved, no gradient to it)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.module.weight.sum(), None


class LateRead(nn.Module):
    """c, then a backward-time read of b.weight -- by a tensor hook, a custom Function's ctx, or a post-
    accumulate-grad hook of c.weight -- after b's gradient is final; then a and b."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.c, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        if how == "post_accumulate_hook":
            def scale(p):
                p.grad.mul_(self.b.weight.detach().abs().mean())
            self.c.bias.register_post_accumulate_grad_hook(scale)

    def forward(self, x):
        h = self.c(x)
        if self.how == "tensor_hook" and h.requires_grad:
            h.register_hook(lambda g: g * self.b.weight.sum())
        elif self.how == "ctx":
            h = _CtxRead.apply(h, self.b)
        return self.b(torch.tanh(self.a(h)))


@pytest.mark.parametrize("how", ["tensor_hook", "ctx", "post_accumulate_hook"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_weight_read_in_backward_after_its_final_gradient_trains_as_plain(how, entry):
    """No save shows these reads; the profiled step, which updates after backward (Note [The profiled step
    updates after backward] in optimize.py), sees them in its backward ops and holds b.weight from then
    on; standalone, the watched first iteration does. The fused update used to step b.weight first:
    2.2e-4 (tensor hook), 2.8e-4 (ctx) and 1.5e-3 (another parameter's post-accumulate-grad hook) off
    plain under optimize, 4.5e-3, 9.5e-3 and 2.2e-2 standalone."""
    torch.manual_seed(0)
    ref, model = LateRead(how), LateRead(how)  # (not deepcopy: each hook reads its own model's b.weight)
    model.load_state_dict(ref.state_dict())
    _fused_trains_as_plain(ref, model, standalone=entry == "standalone")


@pytest.mark.parametrize("name", ["early-read-none", "mlp", "cnn", "transformer", "lstm"])
def test_a_model_without_such_reads_holds_nothing(name):
    """Holds keep gradients to the end of backward and hooks on in steps with nothing to do: models
    that read no weight outside its gradient have none."""
    from memsched import models

    torch.manual_seed(0)
    model = EarlyRead("none") if name == "early-read-none" else models.build_model(name, seed=0)
    data = ([(x, None) for x in _batches()] if name == "early-read-none"
            else [models.example_batch(name, 4, seed=s) for s in range(3)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with memsched.optimize(model, opt, ooo=True, fuse_optimizer=True) as run:
        for x, y in data:
            out = model(x)
            (out.square().sum() if y is None else models.loss_fn(name, out, y)).backward()
            run.step()
        assert not run.ooo_.holds_seen
        assert run.executor.hookless


def test_only_the_held_weight_waits():
    """At the early read's backward node, b.weight (held) still has its forward-time values, while
    a.weight, whose gradient was final before, was already stepped and its gradient freed."""
    torch.manual_seed(0)
    model = EarlyRead("data")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    # the weights as the step's forward saw them, compared without an aten op (which the profiled step's
    # dispatch mode would take for a read of a.weight after its final gradient, and hold it)
    before = {}
    values = lambda: (model.b.weight.detach().numpy().copy(), model.a.weight.detach().numpy().copy())  # noqa: E731

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # after the nodes of b, a and the early read; before c's
            b, a = values()
            seen.append(((b == before["b"]).all(), (a == before["a"]).all(), model.a.weight.grad is None))
            return g

    model.probe = Probe.apply
    with memsched.optimize(model, opt, ooo=True, fuse_optimizer=True) as run:
        for x in _batches():
            before["b"], before["a"] = values()
            model(x).square().sum().backward()
            run.step()
    assert len(seen) == STEPS
    assert all(b_unchanged for b_unchanged, _, _ in seen), seen
    # the profiled step (the first) updates after backward; later steps fused a.weight already
    assert all(not a_unchanged and a_freed for _, a_unchanged, a_freed in seen[1:]), seen


class _Pause(torch.autograd.Function):
    """Identity whose backward sleeps: time for gloo to finish the buckets launched before it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.2)
        return g


class EarlyReadDDP(nn.Module):
    """Backward: b (registered last: DDP's first bucket, launched at once), a, a pause, then d, whose
    deferred item polls the buckets (b's has finished: a stepped b would be read next), then the early
    read of b.weight.data, then c."""

    def __init__(self):
        super().__init__()
        self.d, self.c, self.a, self.b = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        x = self.c(x) @ self.b.weight.data.t()
        x = _Pause.apply(self.d(x))
        return self.b(torch.tanh(self.a(x)))


def _ddp_worker(rank, port, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spawn_helpers import init_gloo

    init_gloo(rank, port, 2)
    try:
        results = {}
        for mode in ("plain", "fused"):
            torch.manual_seed(0)
            model = EarlyReadDDP()
            ddp = DDP(model, bucket_cap_mb=0.0001)  # a bucket per few parameters
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * k + rank)) for k in range(3)]
            if mode == "plain":
                for x in data:
                    ddp(x).square().sum().backward()
                    opt.step()
                    opt.zero_grad()
            else:
                with memsched.optimize(ddp, opt, ooo=True, fuse_optimizer=True) as run:
                    for x in data:
                        ddp(x).square().sum().backward()
                        run.step()
                    results["held"] = run.ooo_.holds_seen
            results[mode] = [p.detach().clone() for p in model.parameters()]
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_under_ddp_a_held_weight_leaves_its_bucket_and_trains_as_plain_ddp(tmp_path):
    from spawn_helpers import free_port, spawn_and_wait

    out = str(tmp_path / "params.pt")
    spawn_and_wait(_ddp_worker, (free_port(), out), 2)
    for rank in range(2):
        r = torch.load(f"{out}.{rank}", weights_only=False)
        assert r["held"]
        for i, (p, q) in enumerate(zip(r["plain"], r["fused"])):
            assert torch.equal(p, q), f"rank {rank} parameter {i}: max |diff| {(p - q).abs().max().item():.3g}"


class FlatMLP(nn.Module):
    """Parameters that are views of one flat buffer (a "contiguous parameters" layout): they share its
    storage and version counter."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        slots = [(m, n) for m in (self.l0, self.l1, self.l2) for n in ("weight", "bias")]
        flat = torch.cat([getattr(m, n).detach().reshape(-1) for m, n in slots])
        offset = 0
        for m, n in slots:
            shape = getattr(m, n).shape
            setattr(m, n, nn.Parameter(flat[offset:offset + shape.numel()].view(shape)))
            offset += shape.numel()

    def forward(self, x):
        return self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))


def test_parameters_viewing_one_buffer_train_as_plain():
    """Stepping l2 in place mid-backward bumped the shared counter, and l1's saved weight then failed
    the version check (a message saying plain PyTorch raises too), with l2 already stepped."""
    torch.manual_seed(0)
    ref = FlatMLP()
    torch.manual_seed(0)
    _fused_trains_as_plain(ref, FlatMLP())


# ---- OutOfOrderBackward without memsched.optimize (Note [The first fused iteration watches its parameter
# reads] in ooo/backward.py)

class Addmm(nn.Module):
    """A layer as Hugging Face GPT-2's Conv1D computes it: torch.addmm(bias, x, weight)."""

    def __init__(self, nin, nout):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(nin, nout) * 0.3), nn.Parameter(torch.randn(nout) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


class AddmmMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = Addmm(8, 16), Addmm(16, 16), Addmm(16, 8)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


@pytest.mark.parametrize("name", ["early-read-none", "addmm", "mlp", "cnn", "transformer", "lstm"])
def test_standalone_a_model_without_such_reads_fuses_from_its_second_iteration(name):
    """The watched first iteration keeps every gradient to the end of backward; later ones free each at its
    update: their peak of gradient bytes is below the gradients' size, and nothing is held. (An op's own
    kernel reading an alias -- addmm's CPU kernel expands the bias below autograd -- is no read of the
    caller's: AddmmMLP, like Hugging Face GPT-2's Conv1D, held every bias when it counted.)"""
    from memsched import models

    torch.manual_seed(0)
    own = {"early-read-none": lambda: EarlyRead("none"), "addmm": AddmmMLP}
    model = own[name]() if name in own else models.build_model(name, seed=0)
    data = [(x, None) for x in _batches()] if name in own else [models.example_batch(name, 4, seed=s) for s in range(3)]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    peaks = []
    with memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        for x, y in data:
            out = model(x)
            (out.square().sum() if y is None else models.loss_fn(name, out, y)).backward()
            ooo.step()
            peaks.append(ooo.report()["peak_grad_bytes"])
        assert not ooo.holds_seen
    assert peaks[0] == grad_bytes
    assert all(p < grad_bytes for p in peaks[1:]), (peaks, grad_bytes)



class LearnedQueries(nn.Module):
    """A parameter fed straight into a Linear (DETR/Perceiver-style queries): the Linear's deferred weight-
    gradient item keeps the parameter itself as its input; in bf16 under autocast too, where the call is
    deferred from the second iteration on (Note [Deferred calls under autocast] in ooo/backward.py)."""

    def __init__(self, autocast=False):
        super().__init__()
        self.autocast = autocast
        self.q = nn.Parameter((torch.randn(4, 8) * 0.3).to(torch.bfloat16 if autocast else torch.float32))
        self.proj, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return self.b(torch.tanh(self.a(torch.tanh(self.proj(self.q)) + x))).float()


@pytest.mark.parametrize("case", ["thread", "inline-queued", "inline-queued-autocast"])
def test_a_parameter_a_queued_weight_gradient_reads_trains_as_plain(case):
    """The queued item reads q when it runs, after q's own gradient was final: q was stepped first, and
    proj.weight's gradient came from the stepped q (4.4e-2 off plain with the thread executor, where the
    first-iteration watch sees the worker's ops as outside backward; 3.7e-2 under autocast, deferred only
    after the watched iteration). An item whose input is on a parameter's storage holds that parameter."""
    executor = dict(executor="thread") if case == "thread" else dict(executor="inline", max_deferred_bytes=1 << 30)
    torch.manual_seed(0)
    base = LearnedQueries(autocast=case.endswith("autocast"))
    _fused_trains_as_plain(copy.deepcopy(base), copy.deepcopy(base), standalone=True, **executor)


@pytest.mark.parametrize("work", ["deepcopy", "state_dict", "log_norm", "embedding_max_norm"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_reads_outside_backward_hold_nothing(work, entry):
    """A teacher copied, a state_dict cloned or the norm of each `p.detach()` logged between a forward and its
    backward, or nn.Embedding(max_norm=...) renormalising `weight.detach()` in its forward: reads through
    aliases that no backward node reads after the gradient is final. When forward reads through an alias
    counted too (the watch's first rule, and the profiler's dispatch mode), each held every parameter it
    touched for good: the gradients' whole size at every iteration, and under memsched.optimize no step
    without hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8, max_norm=1.0 if work == "embedding_max_norm" else None),
                          nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    ids = [torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x in ids:
        ref(x).square().sum().backward()
        ropt.step()
        ropt.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kept = []  # what the work made (kept alive through the loop)
    with (memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) if entry == "standalone" else
          memsched.optimize(model, opt, ooo=True, fuse_optimizer=True)) as handle:
        for x in ids:
            loss = model(x).square().sum()
            if work == "deepcopy":
                kept.append(copy.deepcopy(model))
            elif work == "state_dict":
                kept.append({k: v.clone() for k, v in model.state_dict().items()})
            elif work == "log_norm":
                kept.append(sum(p.detach().norm() for p in model.parameters()))
            loss.backward()
            handle.step()
        ooo = handle if entry == "standalone" else handle.ooo_
        assert not ooo.holds_seen
        if entry == "optimize":
            assert handle.executor.hookless
    _assert_bitwise(ref, model)
