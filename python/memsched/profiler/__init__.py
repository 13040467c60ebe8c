"""memsched.profiler -- the profiler pass: one training step -> memsched.Trace.

Entry points: profile(step_fn, model=..., optimizer=...) and, for callers that
drive the step themselves, ProfilerSession(...).start() / .stop() -> Trace.
See Note [What profile() records] in profile.py.
"""
from memsched.profiler.profile import profile
from memsched.profiler.session import ProfilerSession

__all__ = ["profile", "ProfilerSession"]
