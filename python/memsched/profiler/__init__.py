"""memsched.profiler -- the profiler pass: one training step -> memsched.Trace.

Entry point: profile(step_fn, model=..., optimizer=...). See Note [What
profile() records] in profile.py.
"""
from memsched.profiler.profile import profile

__all__ = ["profile"]
