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
  leaves the Run, adds the last figures to the log history before the Trainer's summary (which
  stays log_history[-1]) and logs run.report() through transformers' logger; `callback.run` stays
  readable. A train() that raised never reaches on_train_end: the model's next forward outside
  that train() (Note [A forward after an unfinished train()]), the next on_train_begin (a retry,
  auto_find_batch_size, another Trainer's callback) or callback.close() leaves that Run first (Note [A
  Run a raised training left behind] in _common.py).
  Refused at on_train_begin, before the first step, naming the TrainingArguments field:
  fp16 (a GradScaler, not yet run here on a GPU, where fp16 needs one; use bf16),
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
import sys
import threading
import warnings

import transformers
from transformers import TrainerCallback, trainer_callback

from memsched._C import MemschedError
from memsched.copy_inert import inert_on_copy
from memsched.integrations._common import (check_callback_args, enter_run, leave_run, leave_stale_runs,
                                          quiet_root_hooks, short_accumulation_refusal, step_figures,
                                          torch_optimizer)
from memsched.optimize import optimize
from memsched.user_frame import user_stacklevel  # See Note [Warnings point at the caller's code]

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
        self._train_frame = None   # (id, code) of the frame of the Trainer's training loop that entered self.run
        self._train_thread = None  # ... and its thread (Note [A forward after an unfinished train()])
        self._guard = None         # handle of the forward pre-hook that checks for that frame

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
        self._watch_train(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.run is not None and logs is not None and "loss" in logs:  # training logs only
            figures = step_figures(self.run)
            logs.update(figures)  # what the reporters after this callback see
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step and "loss" in last:
                last.update(figures)  # Trainer.log() stored a copy of logs before calling on_log

    def on_train_end(self, args, state, control, **kwargs):
        run = self.run
        self._leave(raised=False)
        if run is not None:
            # before the Trainer's summary (train_runtime, train_loss), which it logged just before this event:
            # code reads that summary as log_history[-1]
            at = len(state.log_history)
            if at and "train_runtime" in state.log_history[-1]:
                at -= 1
            state.log_history.insert(at, dict(step_figures(run), step=state.global_step))
            logger.info("memsched:\n%s", run.report(file=_Discard()).table)

    def close(self):
        """Leave the Run (remove every memsched hook); safe to call twice. `self.run` stays readable. Before
        on_train_end the Run is one of a train() that raised or was interrupted."""
        self._leave(raised=True)

    def _leave(self, raised):
        if self._guard is not None:
            self._guard.remove()
        self._guard = self._train_frame = self._train_thread = None
        if self.run is not None:
            leave_run(self.run, raised=raised)  # See Note [Leaving the Run of a training that raised]

    # -- Note [A forward after an unfinished train()] -------------------------------------------------
    #   Rationale: the Trainer has no exception event, so a train() that raised (Ctrl-C in a notebook, an
    #   error of a callback or of the data) left the Run entered; the model then still ran under memsched
    #   outside any training: with fuse_optimizer=True a plain `model(...).loss.backward()` ran the
    #   Trainer's optimizer update inside backward -- every weight changed, no .grad -- silently (found by
    #   a helper probing the integrations).
    #   Approach: on_train_begin is called from the Trainer's training loop (_inner_training_loop, or a
    #   subclass's), through CallbackHandler; the callback keeps that loop's frame and its thread. While
    #   that train() runs, every forward of the model (training, evaluation, generation in a callback)
    #   has the frame on its thread's stack; once train() returned or raised, no forward has (the frame
    #   is kept as its id and code object: the frame itself would keep the loop's locals alive). A forward
    #   pre-hook (prepended, so it runs before memsched's own) walks the stack and, when the frame is not
    #   on it, warns once and closes the callback: that forward and everything after it run plainly.
    #   Closing inside a pre-hook: torch has already taken the list of the model's hooks for this call,
    #   so memsched's root hooks would still run after their Run ended; quiet_root_hooks (_common.py)
    #   makes them do nothing first. The walk costs a few microseconds per forward of the whole model,
    #   not per layer. Wrapping Trainer.train in try/finally is not possible from a callback (no event
    #   receives the Trainer, and on_train_begin comes after train() started). A forward from another
    #   thread is checked against the training thread's stack (sys._current_frames()).
    def _watch_train(self, model):
        handler_file = trainer_callback.__file__
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename != handler_file:  # up to CallbackHandler (through a
            f = f.f_back                                                # subclass's on_train_begin)
        if f is not None:
            self._run_before_reporters(f.f_locals.get("self"))
        while f is not None and f.f_code.co_filename == handler_file:  # ... and to the loop that called it
            f = f.f_back
        if f is None:
            return  # on_train_begin called by hand, not from a training loop: nothing to watch
        # the frame's identity, not the frame: a frame held here would keep the loop's locals (its last
        # batch, on the device) alive after a train() that raised, until the next forward
        self._train_frame, self._train_thread = (id(f), f.f_code), threading.get_ident()
        self._guard = model.register_forward_pre_hook(inert_on_copy(self._check_in_train), prepend=True)

    # Note [memsched figures reach the reporters]
    #   Rationale: the Trainer puts the reporters of report_to (TensorBoard, W&B, MLflow) before the
    #   callbacks the caller passes, and on_log's additions reach only the callbacks after this one:
    #   memsched/* figures reached state.log_history and the console, never a reporter (found by a
    #   helper following the README, which says they appear in the Trainer's logs).
    #   Approach: at on_train_begin the callback moves itself to the front of the Trainer's
    #   CallbackHandler (the `self` of the call_event frame that calls it), so its on_log adds the
    #   figures before any reporter reads the logs. The handler is iterating its list then: removing
    #   this callback at its index k and inserting it at 0 leaves every later callback at index k+1
    #   onwards, so the event goes on to each of them once.
    def _run_before_reporters(self, handler):
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and callbacks and callbacks[0] is not self and \
                any(c is self for c in callbacks):
            callbacks.remove(self)
            callbacks.insert(0, self)

    def _in_train(self):
        f = sys._getframe(2) if threading.get_ident() == self._train_thread \
            else sys._current_frames().get(self._train_thread)
        key, code = self._train_frame
        while f is not None:
            if id(f) == key and f.f_code is code:
                return True
            f = f.f_back
        return False

    def _check_in_train(self, module, args):
        if self._train_frame is None or self._in_train():
            return
        warnings.warn("memsched: the model ran outside Trainer.train() while the MemschedCallback of a train() that "
                      "did not finish (it raised or was interrupted) was still on; memsched is now turned off for "
                      "this model (as callback.close() does) and it runs as plain PyTorch. Call callback.close() "
                      "after an interrupted train() to turn memsched off before using the model",
                      RuntimeWarning, stacklevel=user_stacklevel())
        quiet_root_hooks(module)
        self.close()

    # -- checks -------------------------------------------------------------------------------------
    def _refuse_unsupported(self, args):
        if getattr(args, "fp16", False):
            raise MemschedError(
                "TrainingArguments.fp16: memsched's Trainer callback does not support fp16 with a GradScaler yet "
                "(a step the scaler skips is a step boundary of memsched's, but this path has not run on a GPU, "
                "where fp16 needs one). Use bf16=True (no scaler), or fp16=False")
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
