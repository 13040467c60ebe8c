"""Out-of-order backward with parameters that no called module owns (nn.ParameterList read directly)."""
import copy

import torch
import torch.nn as nn

import memsched


class Scaled(nn.Module):
    """Its only parameters live in a ParameterList whose own forward is never called."""

    def __init__(self):
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(3, 4))])
        self.pool = nn.AdaptiveAvgPool1d(2)

    def forward(self, x):
        return self.pool(x * self.scales[0])


def _plain_and_fused(model, call):
    """(plain twin, model) after 3 AdamW steps, the twin plainly, the model under the fused update; call(m, x)
    runs the forward."""
    twin = copy.deepcopy(model)
    xs = [torch.randn(3, 4) for _ in range(3)]
    opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    for x in xs:
        call(twin, x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        for x in xs:
            call(model, x).pow(2).sum().backward()
            assert not ooo.step()
    return twin, model


def test_parameter_list_read_directly_gets_the_fused_update_bitwise():
    torch.manual_seed(0)
    twin, model = _plain_and_fused(Scaled(), lambda m, x: m(x))
    assert torch.equal(model.scales[0], twin.scales[0])


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Scaled()

    def forward(self, x):
        return self.inner(x)


def test_a_loop_that_calls_a_submodule_holding_a_parameter_list_trains_as_plain():
    """The loop calls model.inner(x), never the model: the root's forward pre-hook never runs, so it could
    not tell this first gradient from a backward over an ended iteration's graph, and refused it."""
    torch.manual_seed(0)
    twin, model = _plain_and_fused(_Outer(), lambda m, x: m.inner(x))
    assert torch.equal(model.inner.scales[0], twin.inner.scales[0])
