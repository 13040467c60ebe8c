"""A backward pass that raises under the fused update (Note [A failed backward] in
ooo/backward.py): parameters already stepped keep their update, and a RuntimeWarning says how
many; without a fused update (or before any step) there is no warning and the result is plain."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import memsched
from ooo_helpers import GuardedNet as Net, guarded_loop as _loop


def _run(guard_at_loss, flags):
    torch.manual_seed(0)
    base = Net(guard_at_loss)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    _loop(a, oa, lambda: (oa.step(), oa.zero_grad()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(b, ob, **flags) as run:
            _loop(b, ob, run.step)
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    return same, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                  and "backward pass raised" in str(w.message)]


def test_fused_warns_naming_parameters_already_stepped():
    same, warned = _run(guard_at_loss=False, flags=dict(fuse_optimizer=True))
    assert not same  # documented: c.weight and c.bias keep their update
    assert len(warned) == 1 and "already stepped 2 of 6 parameters" in warned[0]


@pytest.mark.parametrize("guard_at_loss, flags", [(False, dict(ooo=True)), (True, dict(fuse_optimizer=True))],
                         ids=["ooo_unfused", "fused_raises_before_any_step"])
def test_no_warning_when_nothing_was_stepped(guard_at_loss, flags):
    same, warned = _run(guard_at_loss, flags)
    assert same and warned == []


def test_leaving_between_a_fused_backward_and_its_step_says_the_update_stays():
    """Ctrl-C (or any exception, a break) between loss.backward() and step(): a plain loop updates nothing
    for that iteration, the fused update already ran inside backward; the parameters kept it without a word
    (1e-2 off plain)."""
    torch.manual_seed(0)
    m = Net(guard_at_loss=False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    with pytest.warns(RuntimeWarning, match=r"removed \(its `with` block left\) after a backward pass whose fused "
                                            r"optimizer update.*had already stepped 6 parameters, before step\(\)"):
        with pytest.raises(KeyboardInterrupt):
            with memsched.OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True) as ooo:
                F.cross_entropy(m(x), y).backward()
                ooo.step()
                F.cross_entropy(m(x), y).backward()
                raise KeyboardInterrupt
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a loop that ends with step() says nothing
        with memsched.OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True) as ooo:
            F.cross_entropy(m(x), y).backward()
            ooo.step()


def test_an_optimizer_step_hook_that_raises_inside_the_fused_update_is_counted_in_the_warning():
    """A step post-hook that raises at the fused update's first call, after that layer was stepped: the
    failed backward's warning did not fire (the count was booked after the step returned)."""
    torch.manual_seed(0)
    m = Net(guard_at_loss=False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    calls = []

    def post(optimizer, args, kwargs):
        calls.append(1)
        raise RuntimeError("a hook of the caller's")

    opt.register_step_post_hook(post)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True):
            with pytest.raises(RuntimeError, match="a hook of the caller's"):
                F.cross_entropy(m(x), y).backward()
            m(x)  # the next forward abandons the failed iteration
    said = [str(w.message) for w in caught if "the fused optimizer update (fuse_optimizer=True) raised" in str(w.message)]
    assert len(said) == 1 and "up to 2 of 6 parameters may hold that update" in said[0], [str(w.message) for w in caught]


def test_an_optimizer_step_pre_hook_that_raises_is_not_said_to_have_stepped_anything_for_sure():
    """A pre-hook raises before the optimizer steps anything: the warning said '2 of 6 parameters ... keep
    that update' and blamed a backward pass, where none changed (found by a helper)."""
    torch.manual_seed(0)
    m = Net(guard_at_loss=False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: (_ for _ in ()).throw(FloatingPointError("checked")))
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    before = [p.detach().clone() for p in m.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True):
            with pytest.raises(FloatingPointError):
                F.cross_entropy(m(x), y).backward()
            m(x)  # the next forward abandons the failed iteration
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters()))
    said = [str(w.message) for w in caught if "fused optimizer update" in str(w.message)]
    assert len(said) == 1 and "raised during a backward pass" in said[0] and "may hold" in said[0], said
    assert "keep that update" not in said[0]
