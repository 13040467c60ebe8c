"""memsched.saved_tensors: ModuleStack and ActivationNumbering (Note [Activation identity])."""
import pytest
import torch
from torch import nn

import memsched
from memsched.saved_tensors import ActivationNumbering, ModuleStack, activation_label, storage_key


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


class Outer(nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.a = Inner()
        self.b = Inner()
        self.fail = fail

    def forward(self, x):
        return self.b(self.a(x)) * 2


def test_module_stack_tracks_innermost_path():
    model = Outer()
    seen = []
    stack = ModuleStack(model)
    # Record the stack top from inside the leaf Linear layers and the ReLU step.
    model.a.fc.register_forward_hook(lambda m, i, o: seen.append(("a.fc", stack.current)))
    model.b.register_forward_hook(lambda m, i, o: seen.append(("b", stack.current)))
    with stack:
        assert stack.current == ""
        model(torch.randn(2, 4))
        assert stack.current == "" and stack.depth == 0
    assert ("a.fc", "a.fc") in seen and ("b", "b") in seen
    assert hook_count(model) == 2  # only the two recording hooks of this test remain


def test_module_stack_balanced_and_removed_when_forward_raises():
    model = Outer()

    def boom(module, args, output):
        raise ValueError("boom")

    model.b.fc.register_forward_hook(boom)
    base = hook_count(model)
    stack = ModuleStack(model).install()
    assert hook_count(model) == base + 2 * len(list(model.modules()))
    with pytest.raises(ValueError):
        model(torch.randn(2, 4))
    assert stack.depth == 0 and stack.current == ""
    stack.remove()
    assert hook_count(model) == base
    assert not stack.installed


def test_module_stack_double_install_is_an_error():
    stack = ModuleStack(Outer()).install()
    with pytest.raises(RuntimeError, match="already installed"):
        stack.install()
    stack.remove()


def test_storage_key_matches_native_storage_ref():
    t = torch.randn(4, 4)
    assert storage_key(t) == memsched._C.storage_ref(t)[0]
    assert storage_key(t[1:]) == storage_key(t)
    assert storage_key(t.clone()) != storage_key(t)


def test_numbering_parameters_views_and_labels():
    model = nn.Linear(4, 3)
    numbering = ActivationNumbering(model)
    x = torch.randn(2, 4)
    y = torch.randn(5, 6, dtype=torch.float16)
    assert numbering.number(model.weight) is None
    assert numbering.number(model.weight.t()) is None  # a view of a parameter is a parameter
    a = numbering.number(x, "fc")
    assert tuple(a) == (0, True, "act:0:fc:[2, 4]:float32")
    # A view of x (autograd-tracked or not) reuses the ordinal and the first label.
    assert tuple(numbering.number(x.view(8), "other")) == (0, False, "act:0:fc:[2, 4]:float32")
    b = numbering.number(y[1], "")
    # y[1] is a view: the label carries its base's shape.
    assert b.ordinal == 1 and b.is_first_pack and b.label == "act:1::[5, 6]:float16"
    assert numbering.count == 2 and numbering.labels == ["act:0:fc:[2, 4]:float32", "act:1::[5, 6]:float16"]
    numbering.start_step()
    assert numbering.count == 0
    assert numbering.number(y, "m").label == "act:0:m:[5, 6]:float16"


def test_label_uses_view_base_shape():
    base = torch.randn(3, 8, requires_grad=True) * 1.0  # non-leaf, so views track _base
    v = base[:, :4]
    assert activation_label(7, "x", v) == "act:7:x:[3, 8]:float32"


def test_numbering_no_merge_after_storage_dies():
    # A storage freed during the step must not lend its key (or ordinal) to the next one.
    numbering = ActivationNumbering()
    keys = set()
    for i in range(20):
        t = torch.empty(1024)
        keys.add(storage_key(t))
        assert numbering.number(t).ordinal == i
        del t
    assert numbering.count == 20 and len(keys) == 20


def test_numbering_inside_saved_tensors_hooks():
    # The rule end to end on a 2-layer MLP whose input needs no grad.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    stack = ModuleStack(model).install()
    numbering = ActivationNumbering(model)
    packs = []

    def pack(t):
        packs.append(numbering.number(t, stack.current))
        return t

    x = torch.randn(3, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    stack.remove()
    acts = [p for p in packs if p is not None]
    firsts = [p.label for p in acts if p.is_first_pack]
    # Linear0 saves x only (W0 would serve dx, which nobody needs); ReLU saves its
    # output h; Linear2 saves h again (same storage, not first) and W2 (a parameter).
    assert firsts == ["act:0:0:[3, 4]:float32", "act:1:1:[3, 8]:float32"]
    assert [None if p is None else (p.ordinal, p.is_first_pack) for p in packs] == [
        (0, True), (1, True), (1, False), None]
