"""Splitting a model into pipeline stages at the user's split points.

Entry point: ``split_stages(model, split_points) -> list[nn.Sequential]``.

The model is an ``nn.Sequential`` (nested ``nn.Sequential`` children are
flattened, so a split point may name a module inside one, e.g.
``"blocks.4"``). A split point names the module that *begins* a new stage: its
dotted name (``"3"``, ``"blocks.4"``) or, for a top-level child, its index.
K - 1 split points give K stages. The stages hold the model's own modules (not
copies), so training a stage trains the user's model in place on that rank.

Tied parameters across stages (an embedding shared with the output layer) are
refused: each stage is updated by its own process, and a parameter owned by two
processes would get two different updates.
"""
from __future__ import annotations

import numbers
from typing import List, Sequence, Tuple

import torch.nn as nn

from memsched._C import MemschedError


def _flatten(prefix: str, seq: nn.Sequential, out: List[Tuple[str, nn.Module]]) -> None:
    for name, child in seq.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, nn.Sequential) and len(child) > 0:
            out.append((full, None))  # marker: the container begins at its first leaf
            _flatten(full + ".", child, out)
        else:
            out.append((full, child))


def split_stages(model: nn.Module, split_points: Sequence) -> List[nn.Sequential]:
    """K stages (``nn.Sequential``) of ``model`` cut before each split point, in model order."""
    if not isinstance(model, nn.Sequential):
        raise MemschedError(
            f"model: memsched.pipeline splits an nn.Sequential (nested Sequentials allowed), got "
            f"{type(model).__name__}. Write the model as nn.Sequential(embedding, *blocks, head) with one "
            f"tensor flowing between children, or pass stages=[module, ...] built yourself.")
    if isinstance(split_points, (str, bytes)) or not isinstance(split_points, Sequence):
        raise MemschedError(f"split_points: expected a list of module names or indices, got {split_points!r}")
    entries: List[Tuple[str, nn.Module]] = []
    _flatten("", model, entries)
    names = [n for n, _ in entries]
    leaves = [i for i, (_, m) in enumerate(entries) if m is not None]
    if not leaves:
        raise MemschedError("model: the nn.Sequential has no modules to split")
    cuts = []
    for sp in split_points:
        if isinstance(sp, numbers.Integral) and not isinstance(sp, bool):
            sp = str(int(sp))
        if not isinstance(sp, str) or sp not in names:
            top = [n for n in names if "." not in n]
            raise MemschedError(
                f"split_points: {sp!r} names no module of the nn.Sequential; use a dotted child name "
                f"(top level: {top}) or a top-level index")
        i = names.index(sp)
        first_leaf = next(j for j in leaves if j >= i)
        if first_leaf == leaves[0]:
            raise MemschedError(f"split_points: {sp!r} begins the model, so stage 0 would be empty; "
                                f"name the module that begins the second stage")
        cuts.append((first_leaf, sp))
    for (a, na), (b, nb) in zip(cuts, cuts[1:]):
        if b <= a:
            raise MemschedError(f"split_points: {nb!r} does not come after {na!r} in the model: give split "
                                f"points once each, in model order")
    bounds = [leaves[0]] + [c for c, _ in cuts] + [len(entries)]
    stages = []
    for lo, hi in zip(bounds, bounds[1:]):
        mods = [entries[j][1] for j in range(lo, hi) if entries[j][1] is not None]
        stages.append(nn.Sequential(*mods))
    owner = {}
    for k, st in enumerate(stages):
        for p in st.parameters():
            if owner.setdefault(id(p), k) != k:
                name = next(n for n, q in model.named_parameters(remove_duplicate=False) if q is p)
                raise MemschedError(
                    f"split_points: parameter {name} is used by stage {owner[id(p)]} and stage {k} (tied weights). "
                    f"Each stage is updated by its own process; untie it or keep its users in one stage")
    return stages
