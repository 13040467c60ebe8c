"""Tied parameters under the out-of-order backward (Note [Tied parameters] in ooo/backward.py): a
weight owned by an nn.Embedding and an nn.Linear (T5/BART's shared embedding) used two or more
times through autograd and once through the Linear. Parameters bitwise equal to plain PyTorch
after 3 AdamW steps."""
import copy

import pytest
import torch
import torch.nn as nn

import memsched


class Tied(nn.Module):
    def __init__(self, embedding_uses):
        super().__init__()
        self.embedding_uses = embedding_uses
        self.emb = nn.Embedding(64, 32)
        self.enc = nn.Linear(32, 32)
        self.dec = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, src, tgt):
        h = self.enc(self.emb(src)).mean(1, keepdim=True)
        d = sum(self.emb(tgt) for _ in range(self.embedding_uses - 1))
        return self.head(self.dec(d + h))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 10), generator=g), torch.randint(0, 64, (2, 6), generator=g))
            for _ in range(3)]


@pytest.mark.parametrize("flags", [dict(ooo=True), dict(fuse_optimizer=True)], ids=["ooo", "fused"])
@pytest.mark.parametrize("embedding_uses", [2, 3, 4])
def test_tied_embedding_and_linear_bitwise_plain(embedding_uses, flags):
    torch.manual_seed(0)
    base = Tied(embedding_uses)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    for src, tgt in _batches():
        a(src, tgt).pow(2).mean().backward()
        oa.step()
        oa.zero_grad()
    with memsched.optimize(b, ob, **flags) as run:
        for src, tgt in _batches():
            b(src, tgt).pow(2).mean().backward()
            run.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"


def test_tied_linear_is_not_patched_and_others_are():
    m = Tied(3)
    with memsched.OutOfOrderBackward(m) as ooo:
        assert "forward" not in m.head.__dict__
        assert "forward" in m.enc.__dict__ and "forward" in m.dec.__dict__
        assert ooo.report()["eligible_layers"] == 2


def test_weight_shared_by_two_linears_stays_deferred():
    """Every use deferred: summed in autograd's order, so no reason to run them plainly."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    m[2].weight = m[0].weight
    with memsched.OutOfOrderBackward(m) as ooo:
        assert ooo.report()["eligible_layers"] == 2
