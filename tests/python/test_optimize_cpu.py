"""memsched.optimize() on CPU: gradients and parameters bitwise equal to plain PyTorch, storage release,
exceptions, hook removal.

The executor runs the same code path as on CUDA, with host copies done in order.
Where the profiler or planners of other issues are missing from this build the
stand-ins of offload_standins.py take their place (offload everything, prefetch
one backward op ahead), which is also the plan that exercises the executor most.
"""
import copy
import io

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memsched
from memsched.optimize import optimize
from offload_standins import install_standins


# -- models -----------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(32, 50)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.mid = nn.Linear(24, 24)

    def forward(self, tokens):
        h = torch.tanh(self.mid(self.emb(tokens)))
        return h @ self.emb.weight.t()   # output projection tied to the embedding


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.fc1(x))
        g = self.fc2(h)
        g.mul_(0.5).add_(1.0)          # in-place on a tensor nobody saved
        g = torch.sigmoid(g)
        g = g * h                       # saves h (the in-place ReLU's output) and g
        return self.fc3(F.relu_(g + 0))


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
                                     for _ in range(2)])
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        x = x + checkpoint(self.blocks[0], x, use_reentrant=self.use_reentrant)
        x = x + self.blocks[1](x)
        return self.out(x)


class BF16Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.net(x).float()


def _data(kind, step):
    g = torch.Generator().manual_seed(1000 + step)
    if kind in ("mlp", "inplace", "ckpt", "ckpt_reentrant", "bf16"):
        return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    if kind == "cnn":
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    if kind == "transformer":
        return torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    if kind == "lstm":
        return torch.randn(4, 7, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    if kind == "tied":
        return torch.randint(0, 40, (3, 9), generator=g), torch.randint(0, 40, (3, 9), generator=g)
    raise ValueError(kind)


MODELS = {
    "mlp": MLP, "cnn": CNN, "transformer": Transformer, "lstm": LSTMModel, "tied": Tied, "inplace": InPlace,
    "ckpt": lambda: Checkpointed(False), "ckpt_reentrant": lambda: Checkpointed(True), "bf16": BF16Autocast,
}


def _loss(kind, out, y):
    if kind in ("transformer", "tied"):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def _train(kind, model, opt, steps, run=None, after_forward=None):
    """Train `steps` steps; returns the gradients of every step (cloned before the optimizer step)."""
    grads = []
    for step in range(steps):
        x, y = _data(kind, step)
        out = model(x)
        if after_forward is not None:
            after_forward(step, x, out)
        _loss(kind, out, y).backward()
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return grads


def _pair(kind):
    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = copy.deepcopy(model)
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)
    return model, make_opt(model), ref, make_opt(ref)


def _assert_bitwise(grads, ref_grads, model, ref):
    for step, (gs, rs) in enumerate(zip(grads, ref_grads)):
        for i, (g, r) in enumerate(zip(gs, rs)):
            assert (g is None) == (r is None), f"step {step} param {i}: grad presence differs"
            if g is not None:
                assert torch.equal(g, r), f"step {step} param {i}: gradient differs"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs after training"
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), f"buffer {name} differs after training"


@pytest.fixture
def standins(monkeypatch):
    install_standins(monkeypatch)


@pytest.mark.parametrize("kind", list(MODELS))
def test_bitwise_equal_to_plain_pytorch_and_storage_released(kind, standins):
    model, opt, ref, ref_opt = _pair(kind)
    released = []

    def check_released(step, x, out):
        # Every offloaded storage must be gone from "device" memory by the end of forward, except
        # the ones the caller still holds: the input batch and the output.
        run.executor.check_invariants()
        sources = run.executor.path.offloaded_sources()  # [(ordinal, storage key while alive, else 0)]
        if step == 0:
            assert not sources, "the profiled first step offloads nothing"
            return
        held = {x.untyped_storage()._cdata, out.untyped_storage()._cdata}
        alive = [k for k, key in sources if key != 0 and key not in held]
        assert not alive, f"storages of offloaded activations {alive} still alive after forward"
        released.append(sum(1 for _, key in sources if key not in held))

    with optimize(model, opt, budget=1, planner="dp") as run:
        grads = _train(kind, model, opt, 3, run=run, after_forward=check_released)
    ref_grads = _train(kind, ref, ref_opt, 3)
    _assert_bitwise(grads, ref_grads, model, ref)
    stats = [s for s in run.step_stats if s.mode == "planned"]
    assert len(stats) == 2, [s.mode for s in run.step_stats]
    assert all(s.offloaded > 0 and s.d2h_bytes == s.offloaded_bytes for s in stats)
    assert all(s.h2d_bytes >= s.offloaded_bytes for s in stats)
    assert released and all(n > 0 for n in released)


def test_hooks_removed_and_modules_restored(standins):
    model, opt, _, _ = _pair("cnn")
    before = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    with optimize(model, opt, budget=1) as run:
        _train("cnn", model, opt, 2, run=run)
        assert model._forward_pre_hooks  # installed while active
    after = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    assert after == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class Boom(Exception):
    pass


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)
        self.explode = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.explode:
            raise Boom("inside forward")
        return self.b(h)


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_exception_inside_forward_leaves_nothing_and_next_step_works(exc, standins):
    torch.manual_seed(0)
    model = Exploding()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    with optimize(model, opt, budget=1) as run:
        _train("mlp", model, opt, 2, run=run)
        model.explode = True
        if exc is KeyboardInterrupt:
            model.a.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(KeyboardInterrupt()))
            hook = list(model.a._forward_hooks)[-1]
        with pytest.raises(exc):
            model(_data("mlp", 2)[0])
        if exc is KeyboardInterrupt:
            del model.a._forward_hooks[hook]
        model.explode = False
        grads = _train("mlp", model, opt, 2, run=run)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    _train("mlp", ref, ref_opt, 2)
    ref_grads = _train("mlp", ref, ref_opt, 2)
    _assert_bitwise(grads, ref_grads, model, ref)
    assert [s.mode for s in run.step_stats][-2:] == ["planned", "planned"]


def test_keyboard_interrupt_in_body_removes_everything(standins):
    model, opt, _, _ = _pair("mlp")
    with pytest.raises(KeyboardInterrupt):
        with optimize(model, opt, budget=1) as run:
            _train("mlp", model, opt, 2, run=run)
            model.net[0].register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(KeyboardInterrupt()))
            model(_data("mlp", 0)[0])
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_changed_shape_warns_once_runs_plainly_and_reprofiles(standins):
    model, opt, ref, ref_opt = _pair("mlp")
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, 32, generator=g) for n in (8, 8, 6, 6, 6)]
    targets = [torch.randint(0, 10, (b.shape[0],), generator=g) for b in batches]

    def train(m, o, run=None):
        grads = []
        for x, y in zip(batches, targets):
            F.cross_entropy(m(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            if run:
                run.step()
            else:
                o.step(); o.zero_grad(set_to_none=True)
        return grads

    with pytest.warns(RuntimeWarning, match="does not match the profiled trace") as rec:
        with optimize(model, opt, budget=1, max_shape_plans=1) as run:
            grads = train(model, opt, run)
    assert len([w for w in rec if "profiled trace" in str(w.message)]) == 1
    ref_grads = train(ref, ref_opt)
    _assert_bitwise(grads, ref_grads, model, ref)
    # steps: profile(8), planned(8), diverged(6), diverged(6: the second in a row) -> re-profile(6)
    assert [s.mode for s in run.step_stats] == ["planned", "diverged", "diverged"]
    assert run.steps_profiled == 2 and run.reprofiles == 1


def test_report_says_when_reprofiles_are_used_up(standins):
    model, opt, _, _ = _pair("mlp")
    g = torch.Generator().manual_seed(5)
    # (the warning said "profiled again (at most 0 times)")
    with pytest.warns(RuntimeWarning, match=r"does not match the profiled trace.*the plan is never profiled again "
                                            r"\(max_reprofiles=0\)"):
        with optimize(model, opt, budget=1, max_reprofiles=0, max_shape_plans=1) as run:
            for n in (8, 8, 6, 6):
                F.cross_entropy(model(torch.randn(n, 32, generator=g)), torch.randint(0, 10, (n,), generator=g)).backward()
                run.step()
    table = run.report(file=io.StringIO()).table
    assert run.mismatches == 2 and run.reprofiles == 0
    assert "max_reprofiles (0) is reached" in table and "max_reprofiles=" in table


def test_report_and_timeline(standins, tmp_path, capsys):
    model, opt, _, _ = _pair("mlp")
    with optimize(model, opt, budget=1, timeline=True) as run:
        _train("mlp", model, opt, 3, run=run)
    r = run.report()
    out = capsys.readouterr().out
    assert "planned (simulated)" in out and "bytes moved" in out and "stall time" in out
    s = run.step_stats[-1]
    assert r.measured["bytes_moved"] == s.d2h_bytes + s.h2d_bytes > 0
    assert r.planned["bytes_moved"] == 2 * s.offloaded_bytes
    png = run.save_timeline(tmp_path / "step.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class Deep(nn.Module):
    """Eight wide tanh layers: saved activations dominate, the input is small."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 256)
        self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(8)])
        self.out = nn.Linear(256, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h)


def test_offload_lowers_measured_activation_peak(standins):
    def peak(budget):
        torch.manual_seed(0)
        model = Deep()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 8)
        with optimize(model, opt, budget=budget) as run:
            for _ in range(3):
                model(x).sum().backward()
                run.step()
                run.executor.hookless = False  # the hooks count saved storages (CPU)
        assert [s.mode for s in run.step_stats] == ["planned", "planned"]
        return max(s.peak_bytes for s in run.step_stats), run
    # budget=None's keep-all plan, its steps run through the hooks (by default they run without:
    # Note [A plan with nothing to do])
    keep, keep_run = peak(None)
    off, off_run = peak(1)               # stand-in plan: offload everything, prefetch one op ahead
    assert keep_run.step_stats[-1].offloaded == 0 and keep_run.step_stats[-1].hooked
    # Kept: all 18 saved [64, 256] activations (tanh outputs double as Linear inputs) are alive
    # together at the end of forward.
    act = 64 * 256 * 4
    assert keep >= 9 * act
    # Offloaded: each original is released in forward; during backward at most the tensors in use
    # plus the ones prefetched one op ahead are resident.
    assert off <= 4 * act, (off, keep)


def test_bad_arguments_are_named():
    model = MLP()
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        optimize(object())
    with pytest.raises(ValueError, match="budget"):
        optimize(model, budget="six gigs")
    with pytest.raises(ValueError, match=r"budget: a float is a fraction"):
        optimize(model, budget=1.5)
    with pytest.raises(RuntimeError, match="run.step"):
        optimize(model).step()


@pytest.mark.parametrize("fuse", [False, True])
def test_out_of_order_backward_composes_with_offload(fuse, standins):
    """ooo=True defers weight gradients (memsched.ooo); the offload executor runs underneath."""
    pytest.importorskip("memsched.ooo")
    model, _, ref, _ = _pair("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    with optimize(model, opt, budget=1, ooo=True, fuse_optimizer=fuse) as run:
        for step in range(3):
            x, y = _data("mlp", step)
            _loss("mlp", model(x), y).backward()
            run.step()
    _train("mlp", ref, ref_opt, 3)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    assert [s.mode for s in run.step_stats] == ["planned", "planned"]
    assert all(s.offloaded > 0 for s in run.step_stats)
    assert all(not m._forward_pre_hooks and "forward" not in m.__dict__ for m in model.modules())


def test_exception_in_the_profiled_forward_restarts_profiling(standins):
    torch.manual_seed(0)
    model = Exploding()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    with optimize(model, opt, budget=1) as run:
        model.explode = True
        with pytest.raises(Boom):
            model(_data("mlp", 0)[0])
        model.explode = False
        grads = _train("mlp", model, opt, 3, run=run)
    assert run.steps_profiled == 1 and [s.mode for s in run.step_stats] == ["planned", "planned"]
    _assert_bitwise(grads, _train("mlp", ref, ref_opt, 3), model, ref)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class Modifies(nn.Module):
    """Modifies a saved tensor in place when told to: plain PyTorch raises at backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.where = None

    def forward(self, x):
        y = torch.sigmoid(self.fc(x))      # sigmoid saves its output y
        if self.where == "activation":
            y.mul_(2)
        if self.where == "weight":
            with torch.no_grad():
                self.fc.weight.mul_(1.0)   # the weight saved by fc's matmul
        return y


@pytest.mark.parametrize("budget", [None, 1])  # keep everything / offload everything
@pytest.mark.parametrize("where", ["activation", "weight"])
def test_in_place_change_of_a_saved_tensor_raises_like_pytorch(where, budget, standins):
    torch.manual_seed(0)
    model = Modifies()
    x = torch.randn(4, 32, requires_grad=True)
    model.where = where
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()   # plain PyTorch
    model.where = None
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with optimize(model, opt, budget=budget) as run:
        for _ in range(2):
            model(x).sum().backward()
            run.step()
        model.where = where
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(x).sum().backward()
        model.where = None
        # The failed backward never reached run.step(): the next forward abandons that step and starts
        # a fresh one, which runs the plan (Note [A step whose backward raised] in offload/executor.py;
        # it used to continue the failed step, mismatch the trace and run plainly). budget=None's
        # keep-all steps run without hooks (Note [A plan with nothing to do]): as plain PyTorch.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                model(x).sum().backward()
                run.step()
    mismatched = [w for w in caught if "does not match the profiled trace" in str(w.message)]
    assert not mismatched
    assert run.executor.hookless == (budget is None)
    assert [s.mode for s in run.step_stats][-3:] == ["planned", "planned", "planned"]
    assert run.steps_profiled == 1


@pytest.mark.parametrize("pattern", ["accumulate", "retain_graph"])
def test_two_backwards_per_step_are_bitwise(pattern, standins):
    """Gradient accumulation (two forward/backward per run.step()) and a graph backpropagated twice
    (retain_graph): every saved tensor is fetched again for the second use."""
    model, opt, ref, ref_opt = _pair("cnn")

    def step(m, s):
        x, y = _data("cnn", s)
        if pattern == "accumulate":
            for half in (x[:2], x[2:]):
                F.cross_entropy(m(half), y[:2] if half is x[:2] else y[2:]).backward()
        else:
            loss = F.cross_entropy(m(x), y)
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()

    with optimize(model, opt, budget=1) as run:
        for s in range(3):
            step(model, s)
            run.step()
    for s in range(3):
        step(ref, s)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    _assert_bitwise([], [], model, ref)
    stats = run.step_stats
    assert [st.mode for st in stats] == ["planned", "planned"]
    if pattern == "retain_graph":
        assert all(st.h2d_bytes == 2 * st.offloaded_bytes for st in stats)   # fetched for each backward
    else:
        # The batch x and the targets y are one storage each for both micro-batches (x[:2], x[2:]):
        # saved again after the first micro-batch's graph (which owns the host copies, Note [A step
        # that raises]) died, so they are copied out and fetched twice; the rest once.
        x, y = _data("cnn", 0)
        twice = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
        assert all(st.h2d_bytes == st.d2h_bytes == st.offloaded_bytes for st in stats)
        assert all(st.offloaded_bytes > twice for st in stats)


def test_a_mismatch_after_an_eval_forward_with_gradients_says_so(standins):
    """model.eval() then a forward without torch.no_grad(): its saves join the next training step,
    which then does not match the trace; the warning names the cause and the fix."""
    model, opt, _, _ = _pair("cnn")
    x, y = _data("cnn", 0)
    with pytest.warns(RuntimeWarning, match=r"eval mode \(model\.eval\(\)\) with gradients enabled.*torch\.no_grad.*"
                                            r"a step that trains in eval mode"):
        with optimize(model, opt, budget=0.7) as run:
            for _ in range(2):
                F.cross_entropy(model(x), y).backward()
                run.step()
            model.eval()
            model(x)  # evaluation, gradients on
            model.train()
            F.cross_entropy(model(x), y).backward()
            run.step()
    assert run.mismatches == 1


def test_a_mismatch_after_an_eval_forward_in_the_profiled_step_says_so(standins):
    """An eval-mode forward with gradients in the first, profiled step (a validation pass before
    training): the trace holds its saves, so the training steps mismatch although none of them runs
    in eval mode; the warning named no cause (only 'the trace has [..], this step has [..]')."""
    model, opt, ref, ref_opt = _pair("cnn")
    x, y = _data("cnn", 0)
    with pytest.warns(RuntimeWarning, match=r"the profiled step ran the model in eval mode \(model\.eval\(\)\) "
                                            r"with gradients enabled.*torch\.no_grad"):
        with optimize(model, opt, budget=0.7, max_shape_plans=1) as run:
            for m, o, r in ((model, opt, run), (ref, ref_opt, None)):
                m.eval()
                m(x[:2])  # a validation pass, gradients on, before the first training step
                m.train()
                for _ in range(5):  # profiled, two mismatches, profiled again, planned
                    F.cross_entropy(m(x), y).backward()
                    if r is not None:
                        r.step()
                    else:
                        o.step(); o.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert run.mismatches == 2 and run.reprofiles == 1 and run.step_stats[-1].mode == "planned"


def test_a_lone_smaller_batch_keeps_the_plan(standins):
    """Note [A lone mismatching step]: an epoch's last, smaller batch runs plainly once; the plan runs
    again at the next epoch's first batch, with no re-profile spent on it; gradients stay plain's."""
    model, opt, ref, ref_opt = _pair("mlp")
    g = torch.Generator().manual_seed(5)
    sizes = (8, 8, 8, 5) * 3  # three epochs of 8 + 8 + 8 + 5 samples
    batches = [torch.randn(n, 32, generator=g) for n in sizes]
    targets = [torch.randint(0, 10, (b.shape[0],), generator=g) for b in batches]

    def train(m, o, run=None):
        for x, y in zip(batches, targets):
            F.cross_entropy(m(x), y).backward()
            if run:
                run.step()
            else:
                o.step(); o.zero_grad(set_to_none=True)

    with pytest.warns(RuntimeWarning, match="does not match the profiled trace"):
        with optimize(model, opt, budget=1, max_reprofiles=1, max_shape_plans=1) as run:
            train(model, opt, run)
    train(ref, ref_opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    modes = [s.mode for s in run.step_stats]
    assert run.steps_profiled == 1 and run.reprofiles == 0 and run.mismatches == 3
    assert modes == ["planned", "planned", "diverged"] + ["planned"] * 3 + ["diverged"] + ["planned"] * 3 + ["diverged"]
    table = run.report(file=io.StringIO()).table
    assert "max_reprofiles" not in table, "no re-profile was due"
