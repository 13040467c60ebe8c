"""Shared pieces of the pipeline tests: a small model that splits into 2, 4 or
8 stages, its batches, gloo process spawning, and a one-process reference of
asynchronous 1F1B's semantics (stash / predict) written straight from the
definition: stage k's gradient of micro-batch t is the gradient of the whole
model at the weights each stage's forward of t used, applied s_k = K-1-k calls
later."""
import os
import socket
import traceback
from collections import deque

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

LAYERS = 8
WIDTH = 12
TIMEOUT_S = 180


def build_model(seed=0):
    torch.manual_seed(seed)
    mods = [nn.Linear(6, WIDTH), nn.Tanh()]
    for _ in range(LAYERS - 2):
        mods += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    mods += [nn.Linear(WIDTH, 3)]
    return nn.Sequential(*mods)


def split_points(num_stages):
    """Names of the Linear layers that begin stages 1..K-1 (8 Linear layers in 2, 4 or 8 equal groups)."""
    per = LAYERS // num_stages
    return [str(2 * per * j) for j in range(1, num_stages)]


def batches(n, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


loss_fn = F.cross_entropy


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world)
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise


def spawn(fn, world, tmp_path):
    """Runs fn(rank, world) in `world` gloo processes; returns the per-rank results (raises on any failure)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    out = []
    for r in range(world):
        path = os.path.join(tmp_path, f"{r}.pt")
        assert os.path.exists(path), f"rank {r} wrote no result (timed out or crashed)"
        res = torch.load(path, weights_only=False)
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
        out.append(res["ok"])
    return out


def single_process(model, opt, data):
    """Plain training on the whole batch: the losses of every step."""
    losses = []
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def reference_async(num_stages, opt_factory, data, policy, flush_after=()):
    """Asynchronous 1F1B (stash or predict) in one process, from its definition. After step t in
    flush_after, every micro-batch in flight is applied (Pipeline.flush())."""
    from torch.func import functional_call

    from memsched.pipeline import split_stages
    from memsched.pipeline.weight_policy import make_policy

    model = build_model()
    stages = split_stages(model, split_points(num_stages))
    K = len(stages)
    opts = [opt_factory(list(st.parameters())) for st in stages]
    pols = [make_policy(policy, o) for o in opts]
    queues = [deque() for _ in range(K)]
    losses = []

    def apply(k, grads):
        for p, g in zip(stages[k].parameters(), grads):
            p.grad = g
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)

    for t, (x, y) in enumerate(data):
        weights = []
        for k, st in enumerate(stages):
            params = list(st.parameters())
            w = [p.detach().clone() for p in params]
            s = len(queues[k])  # the updates of stage k before this micro-batch's backward (K-1-k, or fewer
            if s > 0:           # after a flush)
                pols[k].load(params, w, s)  # stash: a no-op on the clone; predict: W - lr*s*d
            weights.append([t_.requires_grad_() for t_ in w])
        h = x
        for st, w in zip(stages, weights):
            h = functional_call(st, {n: t_ for (n, _), t_ in zip(st.named_parameters(), w)}, (h,))
        loss = loss_fn(h, y)
        grads = torch.autograd.grad(loss, [t_ for w in weights for t_ in w])
        losses.append(loss.detach())
        i = 0
        for k, w in enumerate(weights):
            queues[k].append(list(grads[i:i + len(w)]))
            i += len(w)
        for k in range(K):
            if len(queues[k]) > K - 1 - k:
                apply(k, queues[k].popleft())
        if t in flush_after:
            for k in range(K):
                while queues[k]:
                    apply(k, queues[k].popleft())
    for k in range(K):
        while queues[k]:
            apply(k, queues[k].popleft())
    return losses, [p.detach().clone() for st in stages for p in st.parameters()]
