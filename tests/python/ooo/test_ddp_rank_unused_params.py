"""A parameter that one rank uses and another does not, under DistributedDataParallel with
out-of-order backward (memsched's bucket reducer, ooo/ddp.py, Note [DDP and deferred weight
gradients], "Unused parameters"): plain DDP (find_unused_parameters=True) gives it the reduced
gradient on every rank, so every replica steps it alike. gloo on CPU, two processes; after three
AdamW steps with zero_grad(set_to_none=True), both ranks' parameters must equal each other and plain
DDP's bit for bit -- for ooo alone and with the fused update."""

import pytest
import torch
import torch.nn as nn

from spawn_helpers import free_port, init_gloo, spawn_and_wait

STEPS = 3
WORLD = 2
MODES = ("plain", "ooo", "fused")


class TwoHeads(nn.Module):
    """Rank r trains through head r only: head 0 is unused on rank 1 and head 1 on rank 0."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 4)])

    def forward(self, x, head):
        return self.heads[head](torch.tanh(self.body(x)))



def _train(mode, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memsched.ooo import OutOfOrderBackward

    torch.manual_seed(0)
    model = TwoHeads()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.0001)  # a bucket per few parameters
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    ooo = None if mode == "plain" else OutOfOrderBackward(ddp, opt, fuse_optimizer=(mode == "fused"))
    if ooo is not None:
        ooo.install()
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(4, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            ddp(x, rank).square().sum().backward()
            if ooo is None or ooo.step():
                opt.step()
    finally:
        if ooo is not None:
            ooo.remove()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank, port, out):
    import torch.distributed as dist

    init_gloo(rank, port, WORLD)
    try:
        torch.save({mode: _train(mode, rank) for mode in MODES}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp2") / "params.pt")
    spawn_and_wait(_worker, (free_port(), out), WORLD)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("mode", ["ooo", "fused"])
def test_a_parameter_one_rank_did_not_use_is_stepped_as_plain_ddp(results, mode):
    plain = results[0]["plain"]
    for r in range(WORLD):
        assert all(torch.equal(a, b) for a, b in zip(results[r]["plain"], plain)), "plain DDP replicas differ"
        for i, (a, b) in enumerate(zip(plain, results[r][mode])):
            assert torch.equal(a, b), f"rank {r}, parameter {i}: max |diff| {(a - b).abs().max().item():.3g}"
    # both heads moved (each was unused on one rank, and plain DDP stepped it there too): the case at hand
    torch.manual_seed(0)
    init = [p.detach() for p in TwoHeads().parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(init[2:], plain[2:]))
