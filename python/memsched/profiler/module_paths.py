"""module_paths.py -- the innermost module of `model` running now, for the profiler.

Entry point: ModulePathStack(model).install() ... .remove(); `.stack[-1]` is
the path of the innermost module of `model` running now ("" is the root);
the list is empty outside the model.

Same paths as memsched.saved_tensors.ModuleStack (path = the module's first
name in model.named_modules(); pushed by a forward pre-hook, popped down to
its own entry by an always-called forward hook), but with two *global*
module hooks (torch.nn.modules.module.register_module_forward_pre_hook /
register_module_forward_hook) and a dict id(module) -> path, instead of two
hooks on every submodule: installing and removing 2 hooks instead of 2 per
module is most of the saving (Note [Profiler overhead]). Modules outside
`model` run the hooks too and are ignored (their id is not in the dict).
Forward only: autograd runs backward without module hooks.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.nn.modules import module as _module


class ModulePathStack:
    def __init__(self, model: torch.nn.Module, named_modules: Optional[list] = None):
        """named_modules: list(model.named_modules()) already made by the caller, or None."""
        self._model = model
        self._named_modules = named_modules
        self.stack: List[str] = []           # paths of the modules of `model` running now, innermost last
        self._paths: Dict[int, str] = {}     # id(module) -> path, for the modules of `model`
        self._handles: list = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def install(self) -> "ModulePathStack":
        if self._handles:
            raise RuntimeError("ModulePathStack.install(): already installed; call remove() first")
        # The modules are held by `model`, so their ids stay theirs while installed.
        named = self._named_modules if self._named_modules is not None else self._model.named_modules()
        self._paths = {id(m): path for path, m in named}
        paths, stack = self._paths, self.stack

        def push(module, args):
            path = paths.get(id(module))
            if path is not None:
                stack.append(path)

        def pop(module, args, output):
            path = paths.get(id(module))
            if path is None:
                return
            # Pop down to (and including) this module's own entry, as ModuleStack does.
            while stack:
                if stack.pop() == path:
                    break

        try:
            self._handles.append(_module.register_module_forward_pre_hook(push))
            self._handles.append(_module.register_module_forward_hook(pop, always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()
        self._paths = {}
