"""memsched.integrations.lightning.MemschedCallback: a small LightningModule trained 3 steps by
lightning.pytorch.Trainer with the callback ends with parameters bitwise equal to the same Trainer run
without memsched; unsupported settings are refused at the start."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

import memsched  # noqa: E402
from memsched.integrations.lightning import MemschedCallback  # noqa: E402


def decode(net, tokens):
    h = net["emb"](tokens)
    for b in net["blocks"]:
        h = h + b(h)
    return h @ net["emb"].weight.t()


class Decoder(pl.LightningModule):
    """Embedding, two pre-norm MLP blocks with dropout, tied head; AdamW."""

    def __init__(self):
        super().__init__()
        self.net = nn.ModuleDict(dict(
            emb=nn.Embedding(64, 32),
            blocks=nn.ModuleList([nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 96), nn.GELU(), nn.Dropout(0.1),
                                                nn.Linear(96, 32)) for _ in range(2)]),
        ))
        self.automatic_optimization = True

    def forward(self, tokens):
        return decode(self.net, tokens)

    def training_step(self, batch, batch_idx):
        tokens, = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


_BASE = None


def _module(**kw):
    global _BASE
    if _BASE is None:
        torch.manual_seed(0)
        _BASE = Decoder()
    m = copy.deepcopy(_BASE)
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (48, 17), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


class WithValidation(Decoder):
    def validation_step(self, batch, batch_idx):
        tokens, = batch
        self.log("val_loss", F.cross_entropy(self(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1)))


def _fit(callback=None, module=None, callbacks_extra=(), ckpt_path=None, **kw):
    module = module if module is not None else _module()
    args = dict(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kw)
    pl.seed_everything(0, verbose=False)
    callbacks = ([callback] if callback is not None else []) + list(callbacks_extra)
    trainer = pl.Trainer(callbacks=callbacks or None, **args)
    trainer.fit(module, _loader(), _loader() if isinstance(module, WithValidation) else None, ckpt_path=ckpt_path)
    return module, trainer


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"


# With two micro-batches per step no plan lowers this module's peak below its keep-all activation
# memory (memsched refuses dp at 0.7 or 0.8 saying "use budget=1"), so accumulation runs
# offload_all_prefetch, which offloads every activation.
ACCUMULATE = dict(budget=1.0, planner="offload_all_prefetch")
CASES = {
    "dp": (dict(budget=0.7, planner="dp"), {}),
    "dp_clip": (dict(budget=0.7, planner="dp"), dict(gradient_clip_val=0.5)),
    "accumulate2_clip": (ACCUMULATE, dict(accumulate_grad_batches=2, gradient_clip_val=0.5)),
    "dp_bf16": (dict(budget=0.7, planner="dp"), dict(precision="bf16-mixed")),
    "fused": (dict(budget=0.7, planner="dp", fuse_optimizer=True), {}),
    "fused_accumulate2": (dict(ACCUMULATE, fuse_optimizer=True), dict(accumulate_grad_batches=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_with_callback_equals_plain_lightning(case):
    cb_kw, trainer_kw = CASES[case]
    cb = MemschedCallback(**cb_kw)
    module, trainer = _fit(cb, **trainer_kw)
    ref, _ = _fit(None, **trainer_kw)
    _assert_same(module, ref)
    run = cb.run
    assert run.steps_profiled == 1 and run.steps_planned == 2, run.report()
    assert all(s.offloaded > 0 for s in run.step_stats)
    assert not run.entered_ and "step" not in run.optimizer.__dict__
    assert trainer.callback_metrics["memsched/planned_step"] == 1.0


def test_validation_after_every_step_leaves_the_plan_matching():
    """Validation forwards (inference mode) between the steps save nothing: the plan keeps matching."""
    torch.manual_seed(0)
    module = WithValidation()
    ref = copy.deepcopy(module)
    cb = MemschedCallback(budget=0.7, planner="dp")
    kw = dict(num_sanity_val_steps=1, val_check_interval=1, max_steps=4)
    _fit(cb, module=module, **kw)
    _fit(None, module=ref, **kw)
    _assert_same(module, ref)
    assert cb.run.steps_profiled == 1 and cb.run.steps_planned == 3 and cb.run.mismatches == 0


@pytest.mark.parametrize("trainer_kw,cb_kw,match", [
    (dict(gradient_clip_val=1.0), dict(fuse_optimizer=True), r"gradient_clip_val=1.0.*fuse_optimizer=False"),
    # 48 samples in batches of 8: 6 batches an epoch, its second step accumulates 2 (was refused at that step)
    (dict(accumulate_grad_batches=4), dict(ooo=True),
     r"accumulate_grad_batches=4: an epoch has 6 batches, not a multiple of 4.*max_steps < 2.*ooo=False"),
])
def test_unsupported_settings_are_refused_before_the_first_step(trainer_kw, cb_kw, match):
    module = _module()
    before = [p.detach().clone() for p in module.parameters()]
    cb = MemschedCallback(budget=0.7, **cb_kw)
    with pytest.raises(memsched.MemschedError, match=match):
        _fit(cb, module=module, **trainer_kw)
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    assert cb.run is None and not module._forward_pre_hooks


def test_a_grad_scaler_is_refused():
    class Plugin:
        scaler = object()

    class FakeTrainer:
        precision_plugin = Plugin()
        precision = "16-mixed"

    with pytest.raises(memsched.MemschedError, match=r"precision='16-mixed'.*bf16-mixed"):
        MemschedCallback(budget=0.7)._refuse_unsupported(FakeTrainer(), _module())


class Body(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, tokens):
        return decode(self.net, tokens)


class CallsASubmodule(Decoder):
    """training_step calls self.inner(...), never self(...)."""

    def __init__(self):
        super().__init__()
        self.inner = Body(self.net)  # shares the layers (a deepcopy keeps the sharing)

    def training_step(self, batch, batch_idx):
        tokens, = batch
        return F.cross_entropy(self.inner(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))


def test_a_training_step_that_never_calls_the_module_is_named():
    torch.manual_seed(0)
    cb = MemschedCallback(budget=0.7)
    module = CallsASubmodule()
    with pytest.raises(memsched.MemschedError, match=r"forward was never called.*module='model'"):
        _fit(cb, module=module)
    assert not cb.run.entered_ and "step" not in cb.run.optimizer.__dict__  # on_exception left the Run


def test_module_argument_names_the_submodule():
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        _fit(MemschedCallback(budget=0.7, module="nope"))
    torch.manual_seed(0)
    module = CallsASubmodule()
    ref = copy.deepcopy(module)
    cb = MemschedCallback(budget=0.7, planner="dp", module="inner")
    _fit(cb, module=module)
    _fit(None, module=ref)
    _assert_same(module, ref)
    assert cb.run.steps_profiled == 1 and cb.run.steps_planned == 2


def test_a_compiled_module_runs_plainly_with_a_warning():
    """Lightning's fit(torch.compile(module)) compiles the module's forward and training_step in place (no
    OptimizedModule reaches the callback): memsched's hooks ran inside the compiled graph, 3e-2 off both
    plain runs with no word. Now memsched stands aside, as for any compiled module, and says so."""
    def fit(callback):
        module = _module()
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(callbacks=[callback] if callback is not None else None, accelerator="cpu", devices=1,
                             max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(torch.compile(module, backend="aot_eager"), _loader())
        return module

    ref = fit(None)
    cb = MemschedCallback(budget=0.7, planner="dp")
    with pytest.warns(RuntimeWarning, match=r"its forward is torch.compile\(module.forward\).*run plainly"):
        module = fit(cb)
    _assert_same(module, ref)
    assert cb.run.steps_profiled == 0 and cb.run.steps_planned == 0


def test_resuming_from_a_checkpoint_with_accumulation_trains_as_plain_lightning(tmp_path):
    """fit(ckpt_path=...) starts at global_step 2: its first micro-batch (no step ended yet) was refused with
    "forward was never called", though the module calls self(...)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(accumulate_grad_batches=2, max_steps=3)
    _fit(None, enable_checkpointing=True, default_root_dir=str(tmp_path),
         callbacks_extra=[ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)], **kw)
    ckpt = str(tmp_path / "epoch=0-step=2.ckpt")
    cb = MemschedCallback(**ACCUMULATE)
    module, _ = _fit(cb, ckpt_path=ckpt, **kw)
    ref, _ = _fit(None, ckpt_path=ckpt, **kw)
    _assert_same(module, ref)
    assert cb.run.steps_profiled == 1, cb.run.report()


class SkipsTheFirstBatch(Decoder):
    def training_step(self, batch, batch_idx):
        if batch_idx == 0:  # Lightning's way to skip a batch
            return None
        return super().training_step(batch, batch_idx)


def test_a_skipped_first_batch_trains_as_plain_lightning():
    """A training_step returning None for batch 0 still bumps global_step: that was refused as a module whose
    forward memsched never saw."""
    torch.manual_seed(0)
    module = SkipsTheFirstBatch()
    ref = copy.deepcopy(module)
    cb = MemschedCallback(budget=0.7, planner="dp")
    _fit(cb, module=module, max_steps=4)
    _fit(None, module=ref, max_steps=4)
    _assert_same(module, ref)
    assert cb.run.steps_profiled == 1 and cb.run.steps_planned == 2, cb.run.report()


def test_an_accumulation_scheduler_with_ooo_is_refused_before_the_first_step():
    """GradientAccumulationScheduler({0: 1, 1: 2}) with ooo: epoch 0 trained, then the first step of epoch 1 was
    refused by a message naming memsched's grad_accumulation_steps, not the scheduler."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    module = _module()
    before = [p.detach().clone() for p in module.parameters()]
    cb = MemschedCallback(budget=0.7, ooo=True)
    with pytest.raises(memsched.MemschedError, match=r"GradientAccumulationScheduler\(scheduling=\{0: 1, 1: 2\}\).*"
                                                     r"epoch 1: accumulate_grad_batches=2.*ooo=False"):
        _fit(cb, module=module, max_steps=-1, max_epochs=2,
             callbacks_extra=[GradientAccumulationScheduler({0: 1, 1: 2})])
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    # a schedule that changes only after the fit's last epoch is no change
    _fit(MemschedCallback(budget=0.7, ooo=True), max_steps=-1, max_epochs=1,
         callbacks_extra=[GradientAccumulationScheduler({0: 1, 1: 2})])
    # one value for the whole fit, set at the first epoch's start: said so, not called a change
    with pytest.raises(memsched.MemschedError, match=r"sets accumulate_grad_batches=4 for the whole fit.*"
                                                     r"Use Trainer\(accumulate_grad_batches=4\)"):
        _fit(MemschedCallback(budget=0.7, ooo=True), max_steps=-1, max_epochs=2,
             callbacks_extra=[GradientAccumulationScheduler({0: 4})])


@pytest.mark.parametrize("option,match", [
    (dict(log_figures="no"), "log_figures: expected True .* or False, got 'no'"),  # was taken as True
    (dict(history=0), "history: expected an int >= 1"), (dict(profile="nope"), "profile: expected one of"),
])
def test_a_bad_option_value_is_refused_when_the_callback_is_built(option, match):
    with pytest.raises(ValueError, match=match):
        MemschedCallback(**option)


class FailsBeforeTheFirstUpdate(Decoder):
    def on_before_optimizer_step(self, optimizer):
        raise RuntimeError("a hook of the user's failed")


def test_a_failed_fit_gives_no_run_step_advice():
    """on_exception left the Run of a fit that raised inside its first step with "call run.step() where the
    optimizer steps ... or pass the optimizer": a Lightning user has no run.step() and Lightning passed it."""
    torch.manual_seed(0)
    cb = MemschedCallback(budget=0.7, planner="dp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="a hook of the user's failed"):
            _fit(cb, module=FailsBeforeTheFirstUpdate())
    assert not cb.run.entered_
    assert not [w for w in caught if "run.step()" in str(w.message)], [str(w.message) for w in caught]
