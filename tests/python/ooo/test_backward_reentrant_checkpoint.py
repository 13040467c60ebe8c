"""ooo=True with torch.utils.checkpoint(..., use_reentrant=True) where the only trainable layers sit inside the
checkpointed segments (LoRA adapters, a frozen head): each segment's nested backward pass counted as a pass of
its own, so one loss.backward() per step was refused as '2 backward pass(es) ... expects 1' (Note [A reentrant
checkpoint's nested backward passes] in ooo/backward.py). Parameters bitwise plain's."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memsched


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(32, 32)
        self.lora = nn.Linear(32, 32, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.lora(x))


class Net(nn.Module):
    def __init__(self, trainable_head):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(32, 4)
        self.head.requires_grad_(trainable_head)

    def forward(self, x):
        x = x.requires_grad_()  # Hugging Face's enable_input_require_grads()
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return self.head(x)


def _train(model, accumulation, run_kwargs=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ctx = memsched.optimize(model, opt, **run_kwargs) if run_kwargs is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for step in range(3):
            for k in range(accumulation):
                g = torch.Generator().manual_seed(10 * step + k)
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
                (F.cross_entropy(model(x), y) / accumulation).backward()
            opt.step()
            opt.zero_grad()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


@pytest.mark.parametrize("trainable_head", [False, True], ids=["adapters-only", "with-head"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_one_backward_through_reentrant_segments_counts_once_and_trains_as_plain(accumulation, trainable_head):
    torch.manual_seed(0)
    base = Net(trainable_head)
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    _train(plain, accumulation)
    _train(model, accumulation, dict(budget=1.0, ooo=True, grad_accumulation_steps=accumulation))
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_a_wrong_accumulation_setting_is_still_refused():
    torch.manual_seed(0)
    model = Net(False)
    with pytest.raises(memsched.MemschedError, match=r"after 1 backward pass\(es\).*expects 2"):
        _train(model, 1, dict(budget=1.0, ooo=True, grad_accumulation_steps=2))
