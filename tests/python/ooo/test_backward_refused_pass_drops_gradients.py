"""A backward pass that memsched refuses part way (Note [A failed backward] in ooo/backward.py) drops the
step's gradients once it is abandoned: they were left half-written (some stored by AccumulateGrad, some
None, a deferred one partial), and a retry without ooo=True, as the refusal says, trained on the leftovers
(3.7e-3 off plain)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


class TiedAutoencoder(nn.Module):
    """The decoder reads the encoder's weights functionally: a use out-of-order backward did not count."""

    def __init__(self):
        super().__init__()
        self.enc1, self.enc2 = nn.Linear(64, 128), nn.Linear(128, 32)
        self.b1, self.b0 = nn.Parameter(torch.zeros(128)), nn.Parameter(torch.zeros(64))
        self.cls = nn.Linear(32, 10)

    def forward(self, x):
        z = torch.tanh(self.enc2(torch.tanh(self.enc1(x))))
        r = F.linear(torch.tanh(F.linear(z, self.enc2.weight.t(), self.b1)), self.enc1.weight.t(), self.b0)
        return self.cls(z), r


def _loss(model, x, y):
    logits, r = model(x)
    return F.cross_entropy(logits, y) + F.mse_loss(r, x)


@pytest.mark.parametrize("caught", ["outside the Run", "inside the Run"])
@pytest.mark.parametrize("flags", [dict(ooo=True), dict(fuse_optimizer=True)], ids=["ooo", "fused"])
def test_a_refused_backward_drops_the_steps_gradients_so_a_retry_trains_as_plain(flags, caught):
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    base = TiedAutoencoder()
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(memsched.MemschedError, match=r"did not count.*The gradients of this step are dropped"):
        with memsched.optimize(model, opt, **flags) as run:
            try:
                _loss(model, x, y).backward()
            except memsched.MemschedError:
                if caught == "outside the Run":
                    raise
                model(x)  # the next forward abandons the refused pass
                assert all(p.grad is None for p in model.parameters())
                raise
    assert all(p.grad is None for p in model.parameters())
    with memsched.optimize(model, opt, budget=0.9, planner="dp") as run:  # the retry the message names
        _loss(model, x, y).backward()
        run.step()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    _loss(plain, x, y).backward()
    plain_opt.step()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"
