"""DDP features that act through DDP's own gradient sync, which memsched's out-of-order backward turns
off to all-reduce buckets itself (Note [DDP features the bucket reduction replaces] in ooo/ddp.py): module
buffers are broadcast at every forward as plain DDP does (BatchNorm running statistics drifted apart across
ranks, 4.6e-2 off plain); static_graph, a comm hook, ddp.no_sync() around a step's last micro-step and
ddp.join() are refused by name before anything changes (they failed inside torch's Reducer, were skipped
silently, 1.1e-4 and 7e-2 off plain, or aborted the process); the optimizer's parameters outside the model are
stepped as plain DDP steps them. gloo on CPU, two ranks with their own data."""
import contextlib
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spawn_helpers import free_port, init_gloo, spawn_and_wait

STEPS = 4


def _model(bn=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), *([nn.BatchNorm1d(32)] if bn else []), nn.Linear(32, 8))


def _batch(rank, k):
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def _bn_state(rank, ooo):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memsched

    model = _model(bn=True)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    with (memsched.OutOfOrderBackward(ddp, optimizer=opt, fuse_optimizer=True) if ooo
          else contextlib.nullcontext()) as o:
        for k in range(STEPS):
            x, y = _batch(rank, k)
            F.mse_loss(ddp(x), y).backward()
            if o is None or o.step():
                opt.step()
            opt.zero_grad()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _outside_state(rank, ooo):
    """A learned temperature in the optimizer, outside the DDP model: plain DDP steps it with its local
    gradient (it reduces only the model's); the fused update did not step it at all."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memsched

    model = _model()
    ddp = DDP(model)
    temp = nn.Parameter(torch.tensor(1.5))
    opt = torch.optim.AdamW(list(ddp.parameters()) + [temp], lr=1e-2)
    with (memsched.OutOfOrderBackward(ddp, optimizer=opt, fuse_optimizer=True) if ooo
          else contextlib.nullcontext()) as o:
        for k in range(STEPS):
            x, y = _batch(rank, k)
            F.mse_loss(ddp(x) * temp, y).backward()
            if o is None or o.step():
                opt.step()
            opt.zero_grad()
    return {"temp": temp.detach().clone(), **{n: t.detach().clone() for n, t in model.state_dict().items()}}


def _accumulated_bn_state(rank, ooo):
    """Two micro-steps per step without ddp.no_sync(): plain DDP broadcasts rank 0's buffers at every forward
    (memsched did so only after the last micro-step: BatchNorm statistics 7e-3 off on rank 1). lr=0 keeps the
    parameters (the accumulated gradients differ from plain DDP's by float rounding, which a warning names),
    so the running statistics compare bitwise. (the statistics, the warnings memsched gave)"""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import memsched

    model = _model(bn=True)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (memsched.OutOfOrderBackward(ddp, optimizer=opt, grad_accumulation_steps=2) if ooo
              else contextlib.nullcontext()) as o:
            for k in range(STEPS):
                for micro in range(2):
                    x, y = _batch(rank, 10 * k + micro)
                    F.mse_loss(ddp(x), y).backward()
                    if o is not None:
                        o.step()
                opt.step()
                opt.zero_grad()
    said = [str(w.message) for w in caught if "outside ddp.no_sync()" in str(w.message)]
    return {n: t.detach().clone() for n, t in model.state_dict().items()}, said


def _refusal(rank, case):
    """(the MemschedError's message or None, whether the parameters are unchanged)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memsched

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model, static_graph=case == "static_graph")
    if case == "comm_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    message = None
    try:
        with memsched.OutOfOrderBackward(ddp, optimizer=opt, fuse_optimizer=True) as ooo:
            for k in range(STEPS):
                if case == "comm_hook_later" and k == 1:
                    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                x, y = _batch(rank, k)
                around = ddp.no_sync() if case == "no_sync_last" else \
                    ddp.join() if case == "join" else contextlib.nullcontext()
                with around:
                    F.mse_loss(ddp(x), y).backward()
                ooo.step()
    except memsched.MemschedError as e:
        message = str(e)
    if case == "comm_hook_later":  # refused at the second step's forward: the first step's update stays
        before = None
    unchanged = before is None or all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return message, unchanged


REFUSALS = {
    "static_graph": r"DistributedDataParallel\(static_graph=True\) is not supported.*static_graph=False",
    "comm_hook": r"a DDP comm hook \(register_comm_hook.*Register no comm hook",
    "comm_hook_later": r"a DDP comm hook \(register_comm_hook.*Register no comm hook",
    "no_sync_last": r"a forward under ddp.no_sync\(\) ends an optimizer step \(grad_accumulation_steps=1.*"
                    r"pass grad_accumulation_steps=",
    "join": r"DistributedDataParallel.join\(\) \(uneven inputs\) is not supported.*drop_last=True",
}


def _worker(rank, port, out):
    import torch.distributed as dist

    init_gloo(rank, port, 2)
    try:
        results = {"bn": (_bn_state(rank, False), _bn_state(rank, True)),
                   "outside": (_outside_state(rank, False), _outside_state(rank, True)),
                   "accumulated_bn": (_accumulated_bn_state(rank, False), _accumulated_bn_state(rank, True))}
        for case in REFUSALS:
            results[case] = _refusal(rank, case)
            dist.barrier()
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp_features") / "results")
    spawn_and_wait(_worker, (free_port(), out), 2)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]


def _assert_states_equal(rank, plain, ooo):
    for name, t in plain.items():
        assert torch.equal(t, ooo[name]), f"rank {rank} {name}: max |diff| {(t - ooo[name]).abs().max().item():.3g}"


def test_module_buffers_are_broadcast_at_every_forward_as_plain_ddp(results):
    for rank, r in enumerate(results):
        _assert_states_equal(rank, *r["bn"])


def test_an_optimizer_parameter_outside_the_model_is_stepped_as_plain_ddp(results):
    for rank, r in enumerate(results):
        _assert_states_equal(rank, *r["outside"])


def test_buffers_are_broadcast_at_every_micro_step_and_accumulating_without_no_sync_is_named(results):
    for rank, r in enumerate(results):
        (plain, _), (ooo, said) = r["accumulated_bn"]
        _assert_states_equal(rank, plain, ooo)
        assert len(said) == 1 and "Wrap the micro-steps before the last in ddp.no_sync()" in said[0], said


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_the_bucket_reduction_cannot_replace_is_refused_by_name(results, case):
    for rank, r in enumerate(results):
        message, unchanged = r[case]
        assert message is not None and re.search(REFUSALS[case], message), f"rank {rank}: {message}"
        assert unchanged, f"rank {rank}: parameters changed before the refusal"
