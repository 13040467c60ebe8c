"""Out-of-order backward under DistributedDataParallel: gloo on CPU, two
processes on 127.0.0.1. Parameters after K steps equal plain DDP's (bitwise;
also with gradient accumulation against DDP's no_sync recipe),
ranks stay in sync, several buckets are reduced in order, and the first
all-reduce starts before the backward pass ends."""
import os

import torch
import torch.distributed as dist

from spawn_helpers import free_port, init_gloo, spawn_and_wait

K_STEPS = 3
ACCUMULATE = (2, 4)   # micro-steps per optimizer step
WORLD = 2
TIMEOUT_S = 120



def _run(rank, mode, steps, accumulate=1):
    from datetime import timedelta  # noqa: F401

    from memsched import models
    from memsched.ooo import OutOfOrderBackward
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = models.build_model("transformer", seed=0)  # same initial weights on every rank
    ddp = DDP(model, bucket_cap_mb=0.02)                # ~20 KB buckets: several of them
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    data = [models.example_batch("transformer", 4, seed=100 * rank + k) for k in range(steps)]
    report = None
    if mode == "plain":
        for x, y in data:
            models.loss_fn("transformer", ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif mode == "plain_accum":  # DDP's recipe: no_sync() on all but the last micro-step
        for k, (x, y) in enumerate(data):
            if k % accumulate != accumulate - 1:
                with ddp.no_sync():
                    models.loss_fn("transformer", ddp(x), y).backward()
            else:
                models.loss_fn("transformer", ddp(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    elif mode in ("ooo_accum", "fused_accum"):
        fuse = mode == "fused_accum"
        with OutOfOrderBackward(ddp, optimizer=opt, fuse_optimizer=fuse, grad_accumulation_steps=accumulate) as ooo:
            for x, y in data:
                models.loss_fn("transformer", ddp(x), y).backward()
                if ooo.step():
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        report = ooo.report()
    else:
        fuse = mode == "fused"
        with OutOfOrderBackward(ddp, optimizer=opt, fuse_optimizer=fuse) as ooo:
            for x, y in data:
                models.loss_fn("transformer", ddp(x), y).backward()
                if ooo.step():
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        report = ooo.report()
        assert ddp.require_backward_grad_sync  # restored
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for p in model.parameters()]
    return params, state, report


def _worker(rank, port, out_dir):
    init_gloo(rank, port, WORLD, timeout_s=60)
    try:
        results = {mode: _run(rank, mode, K_STEPS) for mode in ("plain", "ooo", "fused")}
        for k in ACCUMULATE:
            results.update({(mode, k): _run(rank, mode, K_STEPS * k, accumulate=k)
                            for mode in ("plain_accum", "ooo_accum", "fused_accum")})
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_ooo_and_fused_match_plain_ddp(tmp_path):
    spawn_and_wait(_worker, (free_port(), str(tmp_path)), WORLD, TIMEOUT_S)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in range(WORLD):
        plain_params, plain_state, _ = res[r]["plain"]
        for mode in ("ooo", "fused"):
            params, state, report = res[r][mode]
            for i, (a, b) in enumerate(zip(plain_params, params)):
                assert torch.equal(a, b), f"rank {r} {mode}: parameter {i} differs from plain DDP"
            for sa, sb in zip(plain_state, state):
                for k in sa:
                    assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), (r, mode, k)
            assert report["buckets"] >= 3
            # communication started during backward, not after it
            assert 0 <= report["first_allreduce_start_ms"] < report["backward_ms"]
        # gradient accumulation over k micro-steps: reduce (and fuse) on the last one only
        for k in ACCUMULATE:
            for mode in ("ooo_accum", "fused_accum"):
                for i, (a, b) in enumerate(zip(res[r][("plain_accum", k)][0], res[r][(mode, k)][0])):
                    assert torch.equal(a, b), f"rank {r} {mode} k={k}: parameter {i} differs from DDP with no_sync"
    for k in ACCUMULATE:
        assert res[0][("fused_accum", k)][2]["fused_updates"] == K_STEPS * len(res[0][("fused_accum", k)][0])
    for mode in ("plain", "ooo", "fused", ("ooo_accum", 4), ("fused_accum", 4)):  # the ranks agree
        for a, b in zip(res[0][mode][0], res[1][mode][0]):
            assert torch.equal(a, b)
    assert res[0]["fused"][2]["fused_updates"] == K_STEPS * len(res[0]["fused"][0])
    # AdamW's update of a reduced bucket runs in C++ once torch created the state (first step)
    assert res[0]["fused"][2]["fused_updates_in_cpp"] == (K_STEPS - 1) * len(res[0]["fused"][0])
