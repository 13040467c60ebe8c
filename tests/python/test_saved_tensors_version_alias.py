"""memsched.saved_tensors.version_alias / on_counter: a save's version counter without its storage, and the
bytes given back on it, made in C++ without dispatch (Note [Version counter aliases in C++] in
csrc/torch/tensor_adapter.h), so a recording dispatch mode around them sees nothing."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memsched.saved_tensors import on_counter, version_alias


class Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_the_alias_holds_the_counter_not_the_storage_and_no_mode_sees_it(dtype):
    t = torch.randn(4, 6, dtype=dtype)
    if dtype.is_complex:
        t = t.conj()  # a lazy conj view: the alias keeps the bit, so the bytes come back conjugated
    with Seen() as mode:
        alias = version_alias(t)
        back = on_counter(alias, t, ((6, 4), (1, 6), 0))
    assert mode.ops == []
    assert alias.untyped_storage().nbytes() == 0 and alias.dtype == dtype and alias.is_conj() == t.is_conj()
    assert torch.equal(back, t.t()) and back.is_conj() == t.is_conj()
    before = alias._version
    t.add_(1)  # a write through the saved tensor shows on the alias and on what unpack returned
    assert alias._version == back._version == before + 1
    back.mul_(2)  # and a write through the unpacked tensor on the saved one (a backward writing its input)
    assert t._version == alias._version == before + 2


def test_a_tensor_subclass_is_left_to_python():
    """The C++ functions make plain tensors: a subclass (Python dispatch) gets None, and saved_tensors falls
    back to detach() and set_() for it."""
    from memsched import _C
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.randn(3), torch.randn(3))
    assert _C.counter_alias(t) is None
    assert _C.on_counter(t, torch.randn(3), (3,), (1,), 0) is None
