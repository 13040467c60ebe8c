"""saved_tensors.py -- the activation-identity rule, as two reusable pieces.

Shared by the profiler (memsched.profiler) and the offload executor
(memsched.offload). See docs/CONVENTIONS-activation-identity.md, Note
[Activation identity].

  ModuleStack          forward pre/post hooks on every submodule; `.current`
                       is the path of the innermost module running now.
  ActivationNumbering  per step: packed tensor -> None (parameter/buffer
                       storage) or Activation(ordinal, is_first_pack, label).
  storage_key(t)       the storage identity used by both (a StorageImpl address).

Typical use inside saved_tensors_hooks::

    stack = ModuleStack(model).install()
    numbering = ActivationNumbering(model)
    numbering.start_step()
    def pack(t):
        act = numbering.number(t, stack.current)
        ...
    stack.remove()

Note [Storage keys and reuse]
  Rationale: views of one storage must share a key, and a key must not be
  handed to a different storage later in the same step (an activation freed
  in forward -- e.g. offloaded to the host -- lets the allocator hand its
  memory to the next one; a data_ptr key would then merge the two).
  Approach: the key is the StorageImpl address (`untyped_storage()._cdata`,
  the same number as memsched._C.storage_ref(t)[0]), and ActivationNumbering
  holds a torch StorageWeakRef to every storage it has keyed. A weak
  reference keeps the StorageImpl object (not its data) alive, so its address
  cannot be reused while we hold it: within one step a key names exactly one
  storage. start_step() drops the weak references.
  Limitations: tensors without a storage (sparse, some subclasses) cannot be
  de-duplicated; each pack of one counts as a new activation.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from memsched import _C
from memsched.copy_inert import inert_on_copy

__all__ = ["ModuleStack", "ActivationNumbering", "Activation", "storage_key", "activation_label", "dtype_name",
           "storage_free", "version_alias", "on_counter"]


def storage_key(tensor: torch.Tensor) -> Optional[int]:
    """StorageImpl address of `tensor` (views share it); None without a storage.

    Equal to memsched._C.storage_ref(tensor)[0]. See Note [Storage keys and reuse]
    for how long a key stays unique.
    """
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_free(alias: torch.Tensor) -> torch.Tensor:
    """Set `alias`, a detached alias of ours, to an empty storage without bumping its version: it keeps
    the version counter it shares and lets the storage go (Note [Version counter of a saved tensor])."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        alias.set_()
    return alias


def version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing `t`'s version counter but not its storage (Note [Version counter of a saved
    tensor]), made in C++ without dispatch (Note [Version counter aliases in C++] in
    csrc/torch/tensor_adapter.h). WARNING: for a tensor subclass, only where autograd runs (a
    saved-tensor hook): inside a dispatch mode, below ADInplaceOrView, detach() makes a new counter --
    use storage_free() on an alias made earlier."""
    alias = _C.counter_alias(t)
    return alias if alias is not None else storage_free(t.detach())


def on_counter(counter: torch.Tensor, base: torch.Tensor, geometry) -> torch.Tensor:
    """A new tensor on `base`'s storage with geometry (size, stride, storage offset) and the dtype and
    version counter of `counter` (a version_alias): what an unpack hook returns for a save whose
    bytes were copied or recomputed (Note [Version counter of a saved tensor]). Where autograd runs
    only, as version_alias."""
    size, stride, offset = geometry
    out = _C.on_counter(counter, base, size, stride, offset)  # Note [Version counter aliases in C++]
    if out is not None:
        return out
    out = counter.detach()  # a tensor subclass
    with torch._C._AutoDispatchBelowADInplaceOrView():
        out.set_(base.untyped_storage(), offset, size, stride)
    return out


# Note [Version counter of a saved tensor]
#   Rationale: plain PyTorch raises at backward when a saved tensor was modified in place after its
#   save, through any alias: views, detached aliases and the tensors autograd unpacks all share one
#   version counter. Saved-tensor hooks turn that check off, so memsched redoes it; a save whose
#   bytes are copied (the profiled step's offload) or recomputed must do so without holding the
#   storage. Two holes were found: (1) the recompute check followed a weak reference to the saved
#   tensor's Python object, which dies with the forward's frames (a block's output held only by
#   the next block): `h = block(x); out = head(h); h.add_(1)` raised in plain PyTorch and trained
#   silently on the replayed, unmodified values under planner="hybrid"; (2) an unpacked copy had a
#   counter of its own, so a backward that changed it in place (a custom Function's backward
#   writing its saved input) bumped nothing another save of the same tensor checks: plain PyTorch
#   raises at that other save's unpack, memsched trained on.
#   Approach: version_alias(t) holds t's counter: a detached alias (which shares the counter) set
#   to an empty storage below ADInplaceOrView (so the set_ bumps no version) -- the activation's
#   memory can go while its counter stays readable. An unpack checks that counter and returns its
#   bytes as on_counter(...): another detached alias of the counter, set onto the copy, so a change
#   made through the unpacked tensor bumps the saved tensor's counter as in plain PyTorch.
#   Offloaded saves of executed steps do the same in C++ (unpack_offloaded, Note [Offloaded saves in
#   C++]): the returned tensor is set onto the counter the save holds.


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (the Trace's dtype spelling)."""
    return str(dtype).replace("torch.", "")


def activation_label(ordinal: int, module_path: str, tensor: torch.Tensor) -> str:
    """`act:<ordinal>:<module_path>:<shape>:<dtype>` (Note [Activation identity]).

    shape is the storage-owning tensor's shape: the view base (`tensor._base`)
    when `tensor` is an autograd-tracked view, else `tensor` itself. Formatted
    in C++, where ActivationNumbering labels too.
    """
    return _C.activation_label(ordinal, module_path, tensor)


class ModuleStack:
    """The innermost nn.Module running now, by its path in `model`.

    install() registers a forward pre-hook (push) and an always-called forward
    hook (pop) on every submodule of `model` (the root included, path "");
    `current` is the path on top of the stack, "" outside any module. Forward
    hooks registered with always_call=True run even when forward raises, so the
    stack stays balanced; remove() removes every hook it added and clears the
    stack. Usable as a context manager. Forward only: autograd runs backward
    without calling module hooks (the profiler maps backward ops separately).
    """

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._stack: List[str] = []
        self._handles: list = []

    @property
    def current(self) -> str:
        return self._stack[-1] if self._stack else ""

    @property
    def depth(self) -> int:
        return len(self._stack)

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> "ModuleStack":
        if self._handles:
            raise RuntimeError("ModuleStack.install(): already installed; call remove() first")
        try:
            for path, module in self._model.named_modules():
                # See Note [Copies of a model under memsched] (copy_inert.py)
                self._handles.append(module.register_forward_pre_hook(inert_on_copy(self._make_push(path))))
                self._handles.append(module.register_forward_hook(inert_on_copy(self._make_pop(path)),
                                                                  always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def __enter__(self) -> "ModuleStack":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _make_push(self, path: str):
        stack = self._stack

        def push(module, args):
            stack.append(path)

        return push

    def _make_pop(self, path: str):
        stack = self._stack

        def pop(module, args, output):
            # Pop down to (and including) this module's own entry: tolerant of a
            # child whose pop never ran (cannot happen with always_call, but a
            # hook added by someone else may raise between ours).
            while stack:
                if stack.pop() == path:
                    break

        return pop


class Activation(NamedTuple):
    ordinal: int          # 0, 1, 2, ... in first-pack order within the step
    is_first_pack: bool   # True the first time this storage is packed in the step
    label: str            # act:<ordinal>:<module_path>:<shape>:<dtype>


class ActivationNumbering:
    """Numbers the saved activations of one step (Note [Activation identity]).

    number(t, module_path) returns None when t's storage belongs to a parameter
    or buffer of `model` (autograd saved a weight: kind `parameter`), else an
    Activation. Views of one storage share an ordinal; the label is fixed at the
    storage's first pack. Call start_step() at the start of every step (it also
    re-reads the parameter storages, so replaced parameters are seen).

    The rule is implemented once, in C++ (csrc/torch/activation_numbering.h),
    and shared with the offload executor's hooks (Note [The saved-tensor fast
    path]), so a profiled step and an executed step number alike.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None):
        self._model = model
        self._impl = _C.ActivationNumbering()
        self.start_step()

    def start_step(self) -> None:
        if self._model is not None:
            self._impl.set_parameters(list(self._model.parameters()) + list(self._model.buffers()))
        self._impl.start_step()

    @property
    def count(self) -> int:
        """Activations numbered so far in this step."""
        return self._impl.count

    @property
    def labels(self) -> List[str]:
        """Labels by ordinal, for this step so far (a copy)."""
        return self._impl.labels

    def is_parameter(self, tensor: torch.Tensor) -> bool:
        return self._impl.is_parameter(tensor)

    def number(self, tensor: torch.Tensor, module_path: str = "") -> Optional[Activation]:
        hit = self._impl.number(tensor, module_path)
        return None if hit is None else Activation(*hit)
