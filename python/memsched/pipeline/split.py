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
processes would get two different updates. A module called more than once (See
Note [A module used twice in the Sequential]) keeps every call.
"""
from __future__ import annotations

import numbers
from typing import List, Sequence, Tuple

import torch.nn as nn

from memsched._C import MemschedError


# Note [A module used twice in the Sequential]
#   Rationale: nn.Sequential(l, act, l, act, head) calls `l` twice, legal PyTorch (its forward iterates
#   _modules, one call per entry). named_children() and named_modules() de-duplicate by identity, so a
#   split built from them silently dropped the second call and the pipeline trained another function.
#   Approach: _flatten walks _modules, so every call is an entry in model order. Repeats inside one
#   stage run as in the model (nn.Sequential(*mods) keeps duplicates; parameters() counts them once).
#   A module with parameters or buffers whose calls land in two stages is refused, naming both
#   positions: each stage lives in its own process, which would train (or update the statistics of)
#   its own copy. A stateless repeat (a shared nn.ReLU) holds nothing and may span stages.
def _flatten(prefix: str, seq: nn.Sequential, out: List[Tuple[str, nn.Module]]) -> None:
    for name, child in seq._modules.items():  # not named_children(): See Note [A module used twice in the Sequential]
        if child is None:
            continue
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
            f"tensor flowing between children. For another model, memsched.partition(model, example_inputs=...) "
            f"places its fx graph and memsched.partition.stages.pipeline_stage(model, partition, rank) turns a "
            f"contiguous partition into torch.distributed.pipelining stages.")
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
    _refuse_state_across_stages(entries, bounds, cuts)
    owner = {}
    for k, st in enumerate(stages):
        for p in st.parameters():
            if owner.setdefault(id(p), k) != k:
                name = next(n for n, q in model.named_parameters(remove_duplicate=False) if q is p)
                raise MemschedError(
                    f"split_points: parameter {name} is used by stage {owner[id(p)]} and stage {k} (tied weights). "
                    f"Each stage is updated by its own process; untie it or keep its users in one stage")
    return stages


def _refuse_state_across_stages(entries, bounds, cuts) -> None:
    """Refuses a module with parameters or buffers whose calls fall in two stages, naming both positions
    (See Note [A module used twice in the Sequential])."""
    first = {}  # id(state tensor) -> (stage, entry name, module)
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        for j in range(lo, hi):
            name, mod = entries[j]
            if mod is None:
                continue
            for t in list(mod.parameters()) + list(mod.buffers()):
                k0, name0, mod0 = first.setdefault(id(t), (k, name, mod))
                if k0 == k:
                    continue
                if mod0 is mod:
                    raise MemschedError(
                        f"split_points: module '{name0}' ({type(mod).__name__}) is called again as '{name}', and "
                        f"split point {cuts[k0][1]!r} puts the first call in stage {k0} and the second in stage "
                        f"{k}. Each stage is trained by its own process, which would update its own copy; move the "
                        f"split point so both calls are in one stage, or use two separate modules")
                # a tensor shared by two different modules: the tied-parameter check below names it
