"""Profile a step the user drives: memsched.profile()'s instrumentation as start() / stop().

Entry point: ProfileSession(model, optimizer, device).start() ... stop() -> Trace.

memsched.profile(step_fn, ...) (python/memsched/profiler/profile.py) wraps a
step function; optimize() has no step function (See Note [Profiling inside
the user's first step] in optimize.py), so this session installs the same
pieces -- Recorder, its ModuleStack, the saved-tensor hooks and RecordingMode
-- in the same order and removes them in reverse at stop(). What it records is
profile()'s Note [What profile() records] except the optimizer step, which
run.step() calls after the trace is closed.
WARNING: this mirrors profile()'s body; a change there must be mirrored here
(tests/python/test_optimize_real.py compares the two on one model).
"""
import contextlib

import torch


class ProfileSession:
    """One step of memsched.profiler instrumentation, opened and closed by the caller."""

    def __init__(self, model, optimizer=None, device=None):
        self.model = model
        self.optimizer = optimizer
        self.device = str(device) if device is not None else "cpu"
        self.exits_ = None   # contextlib.ExitStack while recording

    @property
    def recording(self):
        return self.exits_ is not None

    def start(self):
        from memsched.profiler.profile import _register_optimizer_state
        from memsched.profiler.recorder import Recorder, RecordingMode

        if self.exits_ is not None:
            raise RuntimeError("ProfileSession.start(): already recording")
        rec = Recorder(self.model, self.device)
        exits = contextlib.ExitStack()
        try:
            exits.callback(rec.close)
            for p in self.model.parameters():
                rec.register_existing(p, "parameter")
                if p.grad is not None:
                    rec.register_existing(p.grad, "gradient")
            for buf in self.model.buffers():
                rec.register_existing(buf, "parameter")
            if self.optimizer is not None:
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        rec.register_existing(p, "parameter")
                        if p.grad is not None:
                            rec.register_existing(p.grad, "gradient")
                _register_optimizer_state(rec, self.optimizer, upgrade_only=False)
            if rec.stack is not None:
                rec.stack.install()
                exits.callback(rec.stack.remove)
            exits.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack))
            mode = RecordingMode(rec)
            mode.__enter__()
        except BaseException:
            exits.close()
            raise
        self.rec_, self.mode_, self.exits_ = rec, mode, exits
        return self

    def abort(self):
        """Stop recording and drop what was recorded (the step failed). Safe to call twice."""
        if self.exits_ is not None:
            exits, mode, self.exits_ = self.exits_, self.mode_, None
            try:
                mode.__exit__(None, None, None)
            finally:
                exits.close()

    def stop(self):
        """Stop recording; return the validated memsched.Trace of what ran since start()."""
        from memsched.profiler.profile import _register_optimizer_state

        if self.exits_ is None:
            raise RuntimeError("ProfileSession.stop(): not recording")
        rec, mode, exits = self.rec_, self.mode_, self.exits_
        self.exits_ = None
        with exits:
            mode.__exit__(None, None, None)   # profile(): the `with RecordingMode` block ends here
            rec.in_optimizer = False
            for p in self.model.parameters():
                if p.grad is not None:
                    rec.register_existing(p.grad, "gradient")
            if self.optimizer is not None:
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            rec.register_existing(p.grad, "gradient")
                _register_optimizer_state(rec, self.optimizer, upgrade_only=True)
            rec.timer.resolve(rec.builder)
            rec.close()
            return rec.builder.finish()
