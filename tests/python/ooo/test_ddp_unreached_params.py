"""Parameters a step does not reach, under DistributedDataParallel with the fused update (memsched's
bucket reducer, ooo/ddp.py; Note [Gradients the fused update did not see] in ooo/backward.py): after
zero_grad(set_to_none=False) plain DDP (find_unused_parameters=True) reduces their zero gradient and
optimizer.step() updates them. gloo on CPU, world size 1, in a subprocess; parameters and optimizer
state after 4 steps bitwise equal to plain DDP's, with and without gradient accumulation."""

import pytest
import torch

from spawn_helpers import free_port, init_gloo, spawn_and_wait
from test_fused_unreached_params import OPTIMIZERS, STEPS, ZEROING, Branchy, _batch

CASES = [(z, o, k) for z in ("optimizer_keyword", "model", "zeros_like_by_hand") for o in sorted(OPTIMIZERS)
         for k in (1, 2)]



def _train(fused, zeroing, opt_name, accumulation):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memsched.ooo import OutOfOrderBackward

    torch.manual_seed(0)
    model = Branchy(accumulation)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ddp = DDP(model, find_unused_parameters=not fused, bucket_cap_mb=0.001)  # several buckets
    opt = OPTIMIZERS[opt_name](ddp.parameters())
    ooo = OutOfOrderBackward(ddp, opt, fuse_optimizer=True, grad_accumulation_steps=accumulation) if fused else None
    if ooo is not None:
        ooo.install()
    try:
        for s in range(STEPS * accumulation):
            x, y = _batch(s)
            last = (s + 1) % accumulation == 0
            if fused or last:
                F.cross_entropy(ddp(x), y).backward()
            else:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
            if ooo is not None:
                ooo.step()
            elif last:
                opt.step()
            if last:
                ZEROING[zeroing](ddp, opt)
    finally:
        if ooo is not None:
            ooo.remove()
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    return params, state


def _worker(rank, port, out):
    import torch.distributed as dist

    init_gloo(rank, port, 1)
    try:
        torch.save({case: (_train(False, *case), _train(True, *case)) for case in CASES}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp") / "results.pt")
    spawn_and_wait(_worker, (free_port(), out), 1)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("zeroing, opt_name, accumulation", CASES)
def test_ddp_steps_unreached_parameters_as_plain_ddp(results, zeroing, opt_name, accumulation):
    (plain_params, plain_state), (params, state) = results[(zeroing, opt_name, accumulation)]
    for i, (a, b) in enumerate(zip(plain_params, params)):
        assert torch.equal(a, b), f"parameter {i}: max |diff| {(a - b).abs().max().item():.3g}"
    for sa, sb in zip(plain_state, state):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert plain_state[-3]  # `never`'s weight: plain DDP stepped it
