"""flops.py -- FLOPs of one aten op: torch.utils.flop_counter's formulas, with
direct fast paths for the matmul family (the registry's shape_wrapper
tree-maps every argument, which cost more than the op itself on small models).

Entry point: flop_fn(func) -> callable(args, kwargs, out) -> int, or None when
torch has no formula for the op (its FLOPs are then recorded as 0).
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten


def _mm(args, kwargs, out):          # (m, k) @ (k, n)
    a, b = args[0].shape, args[1].shape
    return 2 * a[0] * a[1] * b[1]


def _addmm(args, kwargs, out):       # bias + (m, k) @ (k, n); the add is not counted (as flop_counter)
    a, b = args[1].shape, args[2].shape
    return 2 * a[0] * a[1] * b[1]


def _bmm(args, kwargs, out):         # (B, m, k) @ (B, k, n)
    a, b = args[0].shape, args[1].shape
    return 2 * a[0] * a[1] * a[2] * b[2]


def _baddbmm(args, kwargs, out):
    a, b = args[1].shape, args[2].shape
    return 2 * a[0] * a[1] * a[2] * b[2]


_FAST = {aten.mm: _mm, aten.addmm: _addmm, aten.bmm: _bmm, aten.baddbmm: _baddbmm}


def flop_fn(func):
    packet = func._overloadpacket
    fast = _FAST.get(packet)
    if fast is not None:
        return fast
    formula = flop_registry.get(packet)
    if formula is None:
        return None

    def general(args, kwargs, out):
        try:
            return formula(*args, **kwargs, out_val=out)
        except Exception:  # a formula that does not cover this overload: unknown
            return 0

    return general
