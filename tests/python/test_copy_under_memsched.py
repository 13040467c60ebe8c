"""A model copied while memsched is on (EMA / eval copies, checkpoints) is an independent plain model.

See Note [Copies of a model under memsched] in copy_inert.py.
"""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.optimize import optimize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Conv1d(1, 1, 3, padding=0), nn.Flatten(), nn.Linear(6, 2))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _model()

    def forward(self, x):
        return self.body[4](self.body[3](self.body[2](self.body[1](self.body[0](x)).unsqueeze(1))))


def _train_plainly(model, steps=3, seed=5):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("how", ["ooo-fused", "optimize-offload", "optimize-offload+ooo-fused"])
def test_a_deepcopy_made_inside_trains_as_an_independent_plain_model(how):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    if how == "ooo-fused":
        ctx = memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True)
    else:
        ctx = optimize(model, opt, budget="1GiB", planner="offload_all_prefetch",
                       ooo=how.endswith("fused"), fuse_optimizer=how.endswith("fused"))
    with ctx as run:
        for _ in range(2):
            model(x).pow(2).sum().backward()
            run.step()
        before = _params(model)
        twin = copy.deepcopy(model)               # an EMA / eval copy, made mid-training
        reference = _train_plainly(copy.deepcopy(twin))
        _train_plainly(twin)                      # trained plainly, inside the context
        _assert_same(_params(model), before)      # the original is untouched
        _assert_same(_params(twin), _params(reference))
        model(x).pow(2).sum().backward()          # and the original still trains under memsched
        run.step()
    assert not any(torch.equal(a, b) for a, b in zip(_params(model), before))


@pytest.mark.parametrize("how", ["ooo-fused", "optimize-offload"])
def test_a_model_under_memsched_pickles_and_saves_as_a_plain_model(how):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    ctx = (memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) if how == "ooo-fused"
           else optimize(model, opt, budget="1GiB", planner="offload_all_prefetch"))
    with ctx as run:
        model(x).pow(2).sum().backward()
        run.step()
        loaded = pickle.loads(pickle.dumps(model))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
    for copy_ in (loaded, saved):
        _assert_same(_params(copy_), _params(model))
        plain = _Net()
        plain.load_state_dict(model.state_dict())
        _assert_same(_params(_train_plainly(copy_)), _params(_train_plainly(plain)))
