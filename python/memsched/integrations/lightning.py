"""memsched for PyTorch Lightning (the `lightning` package: lightning.pytorch).

Entry point:

    from memsched.integrations.lightning import MemschedCallback
    trainer = lightning.pytorch.Trainer(callbacks=[MemschedCallback(budget=0.7, planner="dp")], ...)
    trainer.fit(module, loader)

Note [memsched inside Lightning]
  Rationale: Lightning owns the loop; with automatic optimization it even runs training_step and
  backward inside optimizer.step(closure) (its precision plugin passes the closure on).
  Approach: on_train_start (after the strategy set up the optimizers; after the sanity check)
  enters memsched.optimize(pl_module (or the submodule named by `module=`), the torch optimizer
  behind the LightningOptimizer, ...); Lightning's optimizer.step(closure) is the step boundary:
  memsched runs the closure (forward, backward, on_before_optimizer_step, gradient clipping),
  ends the step, then updates (Note [optimizer.step() without run.step()] in step_hook.py).
  grad_accumulation_steps is trainer.accumulate_grad_batches. on_train_batch_end logs memsched/*
  figures with pl_module.log_dict (the trainer's loggers); on_train_end, on_exception and
  teardown leave the Run; `callback.run` stays readable.
  memsched hooks the forward of the module it is given: a training_step that calls a submodule
  (self.model(x)) and never self(x) gives memsched nothing to profile -- refused after the first
  step (whose update was plain PyTorch's), naming `module=`. That first step is the first
  optimizer step of this fit that a training_step with a loss fed (Note [The first step with a loss]).
  Refused at on_train_start, before the first step: a precision plugin with a GradScaler
  ("16-mixed" on a GPU: not yet run there), more than one
  process, manual optimization, more than one optimizer, with fuse_optimizer gradient_clip_val
  (global clipping needs every gradient before the first fused update), and with ooo/fuse_optimizer
  an epoch whose batch count is not a multiple of accumulate_grad_batches, when training reaches its
  end (its last step accumulates fewer backward passes; short_accumulation_refusal in _common.py), and
  a GradientAccumulationScheduler that changes the accumulation during the fit.
"""
import lightning.pytorch as pl

from memsched._C import MemschedError
from memsched.integrations._common import (check_callback_args, enter_run, leave_run, leave_stale_runs,
                                          short_accumulation_refusal, step_figures, torch_optimizer)
from memsched.optimize import optimize

__all__ = ["MemschedCallback"]


class MemschedCallback(pl.Callback):
    """Train under memsched.optimize(...) inside Trainer.fit().

    budget, planner, ooo, fuse_optimizer and options (min_offload_bytes, max_reprofiles,
    device_model, timeline, history) mean what they mean to memsched.optimize();
    grad_accumulation_steps is the trainer's accumulate_grad_batches. module: None for the
    LightningModule itself, or the name of the submodule its training_step calls
    (pl_module.get_submodule(module)). See Note [memsched inside Lightning]."""

    def __init__(self, budget=None, planner="dp", ooo=False, fuse_optimizer=False, module=None, log_figures=True,
                 **options):
        check_callback_args(budget, planner, ooo, fuse_optimizer, options)
        if module is not None and not isinstance(module, str):
            raise TypeError(f"module: expected None (the LightningModule) or the name of a submodule (a str, as "
                            f"for pl_module.get_submodule), got {type(module).__name__}")
        if not isinstance(log_figures, bool):
            raise ValueError(f"log_figures: expected True (log memsched/* figures with pl_module.log_dict) or False, "
                             f"got {log_figures!r}")
        self.budget = budget
        self.planner = planner
        self.ooo = ooo
        self.fuse_optimizer = fuse_optimizer
        self.module = module
        self.log_figures = log_figures
        self.options = options
        self.run = None
        self.logged_steps_ = 0
        self.batch_start_step_ = 0  # trainer.global_step when the current batch began
        self.loss_step_ = None      # trainer.global_step before the first batch of this fit with a loss

    # -- Lightning's events ----------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module):
        self.close()
        leave_stale_runs()  # See Note [A Run a raised training left behind] in _common.py
        self._refuse_unsupported(trainer, pl_module)
        model = pl_module if self.module is None else self._submodule(pl_module)
        opt = torch_optimizer(trainer.optimizers[0], "MemschedCallback")
        accumulate = trainer.accumulate_grad_batches if (self.ooo or self.fuse_optimizer) else 1
        run = optimize(model, opt, budget=self.budget, planner=self.planner, ooo=self.ooo,
                       fuse_optimizer=self.fuse_optimizer, grad_accumulation_steps=accumulate, **self.options)
        enter_run(run)
        self.run = run
        self.logged_steps_ = 0
        self.loss_step_ = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_start_step_ = trainer.global_step

    # Note [The first step with a loss]
    #   Rationale: "the module's forward was never called" was tested as trainer.global_step >= 1 with
    #   nothing profiled. A fit resumed from a checkpoint (or a second fit) starts at global_step > 0,
    #   so with accumulate_grad_batches >= 2 its first micro-batch, before any step ended, was refused;
    #   a first batch whose training_step returned None (Lightning's way to skip one) still bumps
    #   global_step with no forward, and was refused too, with advice (module=) that did not apply
    #   (found by a helper probing the integrations).
    #   Approach: remember the global_step at the start of the first batch of this fit whose
    #   training_step returned a loss; the check runs once an optimizer step ended after it.
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        run = self.run
        if run is None or not run.entered_:
            return
        if self.loss_step_ is None and outputs is not None and outputs != {}:
            self.loss_step_ = self.batch_start_step_
        if self.loss_step_ is not None and trainer.global_step > self.loss_step_ and run.steps_profiled == 0 \
                and run.trace is None and not run.steps_not_profiled and not run.compiled_why_:
            where = "the LightningModule" if self.module is None else f"submodule '{self.module}'"
            raise MemschedError(
                f"MemschedCallback: an optimizer step ran but {where}'s forward was never called, so memsched had "
                "nothing to profile or offload (that step was plain PyTorch). memsched hooks the forward of the "
                "module it is given: call self(...) in training_step, or pass MemschedCallback(module='name') with "
                "the submodule training_step calls (e.g. module='model' for self.model(x))")
        executed = len(run.step_stats)
        if self.log_figures and executed != self.logged_steps_:
            self.logged_steps_ = executed
            pl_module.log_dict(step_figures(run), on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer, pl_module):
        self.close()

    def on_exception(self, trainer, pl_module, exception):
        if self.run is not None:
            leave_run(self.run, exception=exception)  # See Note [Leaving the Run of a training that raised]

    def teardown(self, trainer, pl_module, stage):
        self.close()

    def close(self):
        """Leave the Run (remove every memsched hook); safe to call twice. `self.run` stays readable."""
        if self.run is not None:
            leave_run(self.run)

    # -- checks -------------------------------------------------------------------------------------
    def _submodule(self, pl_module):
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError:
            names = [n for n, _ in pl_module.named_children()]
            raise ValueError(f"module: the LightningModule has no submodule '{self.module}'; its children: "
                             f"{', '.join(names) or 'none'}") from None

    def _refuse_accumulation_schedule(self, trainer):
        """With ooo/fuse_optimizer the update follows the accumulation passed when training starts; a
        GradientAccumulationScheduler changes trainer.accumulate_grad_batches at later epochs' starts, and
        was refused only at the first step after the change, by a message naming memsched's own setting."""
        for cb in trainer.callbacks:
            if not isinstance(cb, pl.callbacks.GradientAccumulationScheduler):
                continue
            last = trainer.max_epochs - 1 if trainer.max_epochs not in (None, -1) else max(cb.scheduling)
            changes = {e: cb.get_accumulate_grad_batches(e) for e in range(trainer.current_epoch, last + 1)}
            changes = {e: k for e, k in changes.items() if k != trainer.accumulate_grad_batches}
            if changes and len(set(changes.values())) == 1 and len(changes) == last + 1 - trainer.current_epoch:
                # one value for the whole fit, which the scheduler sets only at the first epoch's start, after
                # memsched took the trainer's (found by a helper reviewing this check)
                k = next(iter(changes.values()))
                raise MemschedError(
                    f"GradientAccumulationScheduler(scheduling={cb.scheduling}): it sets accumulate_grad_batches={k} "
                    f"for the whole fit, but only at the first epoch's start, after memsched took the trainer's "
                    f"({trainer.accumulate_grad_batches}) for {'ooo=True' if self.ooo else 'fuse_optimizer=True'}. "
                    f"Use Trainer(accumulate_grad_batches={k}) instead of the scheduler")
            if changes:
                e, k = next(iter(changes.items()))
                raise MemschedError(
                    f"GradientAccumulationScheduler(scheduling={cb.scheduling}): the gradient accumulation changes "
                    f"during this fit (epoch {e}: accumulate_grad_batches={k}), and with "
                    f"{'ooo=True' if self.ooo else 'fuse_optimizer=True'} memsched's update follows the one "
                    f"accumulation fixed when training starts ({trainer.accumulate_grad_batches}). Drop the "
                    "scheduler for a fixed Trainer(accumulate_grad_batches=N), or use "
                    "MemschedCallback(ooo=False, fuse_optimizer=False), which follows the trainer's accumulation "
                    "at every step")

    def _refuse_unsupported(self, trainer, pl_module):
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise MemschedError(
                f"Trainer(precision={trainer.precision!r}): memsched's Lightning callback does not support a "
                "GradScaler yet (a step the scaler skips is a step boundary of memsched's, but this path has not "
                "run on a GPU, where the scaler is made). Use precision='bf16-mixed' (no scaler) or '32-true'")
        if trainer.world_size > 1:
            raise MemschedError(f"Trainer: memsched's Lightning callback runs single-process training only (this run: "
                                f"world_size={trainer.world_size}); drop the callback for distributed training")
        if not pl_module.automatic_optimization:
            raise MemschedError("LightningModule.automatic_optimization is False: memsched's Lightning callback "
                                "supports automatic optimization; with manual optimization use "
                                "`with memsched.optimize(...)` around your own optimizer steps")
        if len(trainer.optimizers) != 1:
            raise MemschedError(f"configure_optimizers: memsched's Lightning callback needs exactly one optimizer, "
                                f"this module has {len(trainer.optimizers)}")
        if self.ooo or self.fuse_optimizer:
            self._refuse_accumulation_schedule(trainer)
            batches = trainer.num_training_batches
            refusal = short_accumulation_refusal(
                None if batches == float("inf") else int(batches), trainer.accumulate_grad_batches,
                trainer.global_step, trainer.max_steps, "Trainer: accumulate_grad_batches",
                "ooo=True" if self.ooo else "fuse_optimizer=True", "the dataset's size, the batch size, limit_train_batches")
            if refusal is not None:
                raise refusal
        if self.fuse_optimizer and trainer.gradient_clip_val:
            raise MemschedError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): gradient clipping cannot be fused with the "
                "optimizer update (global-norm clipping needs every gradient before the first parameter is "
                "updated, and the fused update frees each gradient when it is used). Drop gradient_clip_val, or "
                "use MemschedCallback(fuse_optimizer=False)")
