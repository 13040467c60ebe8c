"""Asynchronous 1F1B's weight policies change what training reaches, in the direction S2 claims:
on a short seeded run (4 gloo processes, AdamW), predict ends at a held-out loss no worse than none
(stale weights), and its weights end nearer those of synchronous training (the same batches, the same
number of updates) than stash's and none's. With prediction switched off, predict would hold the
forward's own weights, as stash does, and the strict comparison with stash would fail."""
import torch

from pipeline_helpers import build_model, loss_fn, single_process, spawn, split_points

STAGES = 4
STEPS = 100
LR = 0.01
POLICIES = ("predict", "stash", "none")


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def teacher_batches(n, batch, seed):
    """A learnable task: 3 classes, the argmax of a fixed random linear map of 6 inputs."""
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 6, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def _worker(rank, world):
    from memsched.pipeline import Pipeline

    out = {}
    for policy in POLICIES:
        with Pipeline(build_model(), split_points(world), optimizer=adamw, loss_fn=loss_fn,
                      schedule="async-1f1b", policy=policy) as pipe:
            for b in teacher_batches(STEPS, 32, seed=1):
                pipe.step(b)
        # leaving the block applied the micro-batches still in flight: STEPS updates on every stage
        out[policy] = [p.detach().clone() for p in pipe.stage_module.parameters()]
    return out


def _distance(a, b):
    return torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b))).item()


@torch.no_grad()
def _held_out_loss(params):
    model = build_model()
    for p, q in zip(model.parameters(), params):
        p.copy_(q)
    x, y = teacher_batches(1, 2000, seed=99)[0]
    return loss_fn(model(x), y).item()


def test_predict_trains_nearer_synchronous_than_stash_and_none(tmp_path):
    per_rank = spawn(_worker, STAGES, tmp_path)
    final = {pol: [p for r in per_rank for p in r[pol]] for pol in POLICIES}
    model = build_model()
    single_process(model, adamw(model.parameters()), teacher_batches(STEPS, 32, seed=1))
    sync = [p.detach() for p in model.parameters()]

    loss = {pol: _held_out_loss(final[pol]) for pol in POLICIES}
    dist = {pol: _distance(final[pol], sync) for pol in POLICIES}
    msg = f"held-out loss {loss}, synchronous {_held_out_loss(sync):.4f}; distance to synchronous {dist}"
    # None of the three equals synchronous training, and none equals another
    assert min(dist.values()) > 0 and len({round(d, 6) for d in dist.values()}) == 3, msg
    # Prediction steers the trajectory toward the synchronous one: by a clear margin, not rounding
    assert dist["predict"] < 0.9 * dist["stash"], msg
    assert dist["predict"] < 0.9 * dist["none"], msg
    # ... and ends at least as good as stale weights
    assert loss["predict"] <= loss["none"], msg
