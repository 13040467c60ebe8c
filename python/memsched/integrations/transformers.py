"""memsched for the Hugging Face Trainer (and TRL's trainers built on it).

Entry point:

    from memsched.integrations.transformers import MemschedCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MemschedCallback(budget=0.7, planner="dp")])
    trainer.train()

Note [memsched inside the Trainer]
  Rationale: the Trainer owns the loop (accumulation, clipping, optimizer.step(), lr_scheduler,
  zero_grad), so memsched.optimize()'s `with` block and run.step() have no place in user code.
  Approach: on_train_begin (after the Trainer built and prepared its optimizer; transformers
  hands the callback that optimizer, accelerate's AcceleratedOptimizer around the torch one)
  enters memsched.optimize(model, optimizer, ...); the Trainer's own optimizer.step() is the
  step boundary (Note [optimizer.step() without run.step()] in step_hook.py);
  grad_accumulation_steps is the Trainer's. on_log adds memsched/* figures to the Trainer's logs
  (so they reach its log history and the reporters listed after this callback); on_train_end
  leaves the Run and logs run.report() through transformers' logger; `callback.run` stays
  readable. A train() that raised never reaches on_train_end: the next on_train_begin (a retry,
  auto_find_batch_size, another Trainer's callback) or callback.close() leaves that Run first (Note [A
  Run a raised training left behind] in _common.py).
  Refused at on_train_begin, before the first step, naming the TrainingArguments field:
  fp16 (GradScaler skips optimizer.step() on overflow, so the step would have no end; use bf16),
  more than one process (DDP, FSDP, DeepSpeed: not supported yet), and with fuse_optimizer
  max_grad_norm > 0 (global clipping needs every gradient before the first fused update).
  Refused there too: torch_compile (the Trainer compiles the model around memsched's hooks), and with
  ooo/fuse_optimizer an epoch whose batch count is not a multiple of gradient_accumulation_steps, when
  training reaches its end (its last step accumulates fewer backward passes; plain offload handles it).
  Limitations: a dataloader without a length is checked at each step's end instead.
  With fuse_optimizer the Trainer's logged grad_norm is 0 (gradients are freed by the update).
  Evaluation forwards between steps run under no_grad and save nothing, so the plan keeps
  matching (tested with an evaluation after every step); they count in the next step's measured
  time, and when a re-profile is pending they are recorded into that step's trace.
"""
import transformers
from transformers import TrainerCallback

from memsched._C import MemschedError
from memsched.integrations._common import (check_callback_args, enter_run, leave_stale_runs,
                                          short_accumulation_refusal, step_figures, torch_optimizer)
from memsched.optimize import optimize

__all__ = ["MemschedCallback"]

logger = transformers.utils.logging.get_logger(__name__)


class MemschedCallback(TrainerCallback):
    """Train under memsched.optimize(model, optimizer, budget, planner, ...) inside Trainer.train().

    budget, planner, ooo, fuse_optimizer and options (min_offload_bytes, max_reprofiles,
    device_model, timeline, history) mean what they mean to memsched.optimize();
    grad_accumulation_steps is the Trainer's. After training, `callback.run` is the Run
    (run.report(), run.save_timeline("step.json")). See Note [memsched inside the Trainer]."""

    def __init__(self, budget=None, planner="dp", ooo=False, fuse_optimizer=False, **options):
        check_callback_args(budget, planner, ooo, fuse_optimizer, options)
        self.budget = budget
        self.planner = planner
        self.ooo = ooo
        self.fuse_optimizer = fuse_optimizer
        self.options = options
        self.run = None

    # -- the Trainer's events --------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        self.close()  # this callback's own Run of a train() that raised (a retry, auto_find_batch_size)
        leave_stale_runs()  # another's (Note [A Run a raised training left behind] in _common.py)
        self._refuse_unsupported(args)
        self._refuse_short_accumulation(args, state, train_dataloader)
        if model is None:
            raise MemschedError("MemschedCallback: the Trainer passed no model to on_train_begin")
        opt = torch_optimizer(optimizer, "MemschedCallback")
        accumulate = args.gradient_accumulation_steps if (self.ooo or self.fuse_optimizer) else 1
        run = optimize(model, opt, budget=self.budget, planner=self.planner, ooo=self.ooo,
                       fuse_optimizer=self.fuse_optimizer, grad_accumulation_steps=accumulate, **self.options)
        enter_run(run)
        self.run = run

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.run is not None and logs is not None and "loss" in logs:  # training logs only
            figures = step_figures(self.run)
            logs.update(figures)  # what the reporters after this callback see
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step and "loss" in last:
                last.update(figures)  # Trainer.log() stored a copy of logs before calling on_log

    def on_train_end(self, args, state, control, **kwargs):
        run = self.run
        self.close()
        if run is not None:
            state.log_history.append(dict(step_figures(run), step=state.global_step))
            logger.info("memsched:\n%s", run.report(file=_Discard()).table)

    def close(self):
        """Leave the Run (remove every memsched hook); safe to call twice. `self.run` stays readable."""
        if self.run is not None and self.run.entered_:
            self.run.__exit__(None, None, None)

    # -- checks -------------------------------------------------------------------------------------
    def _refuse_unsupported(self, args):
        if getattr(args, "fp16", False):
            raise MemschedError(
                "TrainingArguments.fp16: memsched does not support fp16 with a GradScaler yet: the scaler skips "
                "optimizer.step() when gradients overflow, and memsched ends each step there. Use bf16=True "
                "(no scaler), or fp16=False")
        if getattr(args, "world_size", 1) > 1 or getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise MemschedError(
                f"TrainingArguments: memsched's Trainer callback runs single-process training only (this run: "
                f"world_size={getattr(args, 'world_size', 1)}, deepspeed={bool(getattr(args, 'deepspeed', None))}, "
                f"fsdp={bool(getattr(args, 'fsdp', None))}); drop the callback for distributed training")
        if getattr(args, "torch_compile", False):
            raise MemschedError(
                "TrainingArguments.torch_compile=True: the Trainer compiles the model (through accelerate) around "
                "memsched's hooks, which cannot run inside a compiled graph (such steps were neither planned nor "
                "bitwise plain compiled training). Use torch_compile=False, for memsched to plan the eager model, "
                "or drop the callback to train compiled")
        if self.fuse_optimizer and (args.max_grad_norm or 0) > 0:
            raise MemschedError(
                f"TrainingArguments.max_grad_norm={args.max_grad_norm}: global gradient clipping cannot be fused "
                "with the optimizer update (the norm needs every gradient before the first parameter is updated, "
                "and the fused update frees each gradient when it is used). Pass max_grad_norm=0 to the "
                "TrainingArguments, or MemschedCallback(fuse_optimizer=False)")


    def _refuse_short_accumulation(self, args, state, train_dataloader):
        """See Note [memsched inside the Trainer]."""
        if not (self.ooo or self.fuse_optimizer) or train_dataloader is None:
            return
        try:
            batches = len(train_dataloader)
        except TypeError:
            return  # no length: each step is checked as it ends
        refusal = short_accumulation_refusal(
            batches, args.gradient_accumulation_steps, state.global_step, state.max_steps,
            "TrainingArguments.gradient_accumulation_steps", "ooo=True" if self.ooo else "fuse_optimizer=True",
            "the dataset's size, per_device_train_batch_size, dataloader_drop_last")
        if refusal is not None:
            raise refusal


class _Discard:
    """A file that drops what is written (run.report() prints its table; we log it instead)."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass
