"""backward_modules.py -- which module a backward op belongs to.

Entry point: BackwardModuleMap. Forward: `note_outputs(tensors, path)` after
each forward op, `tag_pending()` before the next one. Backward:
`module_of_current_node()` inside an op run by the autograd engine.

Note [Backward module path]
  Rationale: module hooks do not run in backward, yet the planner wants every
  backward op attributed to the layer whose forward it differentiates.
  Approach: a dispatch-level forward op runs *below* autograd, so its outputs
  get their grad_fn only after the op returns. We keep weak references to the
  outputs of the last forward op together with the module path that ran it;
  at the start of the next op (or of backward) each output's grad_fn exists
  and we write the path into `grad_fn.metadata[KEY]` (first writer wins, so a
  node keeps its innermost module). In backward,
  torch._C._current_autograd_node() is the node being executed; its metadata
  gives the path. AccumulateGrad nodes get the path of the module owning the
  parameter they accumulate into.
  A node without the tag (view ops are not recorded, so their nodes are never
  tagged; custom autograd Functions; tensors that died before the next op)
  takes the path of the previous backward op: the engine runs a view's node
  next to the nodes of the module that made it.
  Limitations: that fallback is a best effort -- never a wrong phase or
  wrong bytes, at worst a neighbouring module's path. The seed gradient
  (ones_like, before the engine starts) is a forward-phase op.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch

KEY = "memsched_module"
_current_node = torch._C._current_autograd_node  # the node the engine is running now, or None


class BackwardModuleMap:
    def __init__(self, model: torch.nn.Module | None, named_params: Optional[list] = None):
        """`named_params`: model.named_parameters() already listed by the caller (or None)."""
        self._pending: List[Tuple[weakref.ref, str]] = []
        self._last = ""  # path of the previous backward op (fallback for untagged nodes)
        self._param_owner: Dict[int, str] = {}
        if model is not None:
            for name, p in (named_params if named_params is not None else model.named_parameters()):
                self._param_owner[id(p)] = name.rpartition(".")[0]

    def note_outputs(self, tensors, module_path: str) -> None:
        # At dispatch level requires_grad/grad_fn are not set yet: keep them all.
        pending = self._pending
        for t in tensors:
            pending.append((weakref.ref(t), module_path))

    def tag_pending(self) -> None:
        if not self._pending:
            return
        for ref, path in self._pending:
            t = ref()
            if t is None:
                continue
            fn = t.grad_fn
            if fn is not None:
                md = fn.metadata
                if KEY not in md:
                    md[KEY] = path
        self._pending.clear()

    def module_of_current_node(self) -> str:
        node = _current_node()
        if node is None:
            return self._last
        path = node.metadata.get(KEY)
        if path is None:
            var = getattr(node, "variable", None)  # AccumulateGrad
            path = self._param_owner.get(id(var), self._last) if var is not None else self._last
        self._last = path
        return path

    def clear(self) -> None:
        self._pending.clear()
