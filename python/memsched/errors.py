"""MemschedArgumentError: a bad argument to a memsched constructor, caught as either kind.

Note [Argument errors of both kinds]
  Rationale: memsched.optimize() promises a ValueError naming a bad argument, and OutOfOrderBackward,
  which optimize() builds for ooo/fuse_optimizer, raised MemschedError for its own (fuse_optimizer
  without an optimizer, Adagrad with fuse_optimizer, grad_accumulation_steps=0): `except ValueError`
  missed those (found by a helper following the README as a new user), while code written against
  OutOfOrderBackward catches MemschedError.
  Approach: those checks raise MemschedArgumentError, a MemschedError that is also a ValueError.
"""
from memsched._C import MemschedError


class MemschedArgumentError(MemschedError, ValueError):
    """A bad argument, named in the message with what it accepts (a MemschedError and a ValueError)."""
