"""accuracy.py -- does asynchronous 1F1B with weight prediction (S2) train as well as synchronous
pipelining? A character-level language model on a corpus shipped with Python itself, 4 gloo processes
(one stage each) on this CPU, trained a fixed number of steps per policy; held-out next-character
accuracy every --eval-every steps, the curves saved as a plot.

    python benchmarks/pipeline/accuracy.py [--steps 1500] [--out-dir pipeline_accuracy] [--stages 4]
        [--optimizer adamw|sgd] [--lr LR] [--warmup N] [--schedule constant|cosine] [--clip NORM]
        [--seed S] [--runs sync,predict,stash,none]

Corpus: pydoc_data.topics (CPython's help texts, ~465k characters, no download); the last 10% is held
out. Model: nn.Sequential(Embedding(V, 24) over the previous 16 characters, Flatten, 4 Linear+Tanh layers of
256, Linear(256, V)), cut into one stage per process at the Linear layers. Rows: synchronous 1F1B
(torch.distributed.pipelining through memsched.pipeline; equal to single-process training, see
tests/python/pipeline), and async-1f1b with policy predict, stash and none. Same seed, same batches
(64 windows per step), AdamW lr 2e-3 unless --lr (--optimizer sgd: SGD momentum 0.9, lr 0.1); --warmup,
--schedule and --clip are hooks on each stage's optimizer (lr indexed by that stage's update count,
each stage clips its own gradient), identical for every row. The async rows update once per step with
a micro-batch of the same 64 windows; the synchronous row once per step with 4 micro-batches of 16 (the
same batch). Curve points are each stage's weights at that step, as they are; the final accuracy is
taken after Pipeline.flush(), so every row has applied all --steps batches ("before the flush" is the
last curve point).

Measured (loaded 2-core CPU; final held-out accuracy, points vs synchronous 1F1B of the same settings):

| settings (all rows identical) | steps | seed | 1F1B | predict | stash | none |
| --- | --- | --- | --- | --- | --- | --- |
| AdamW lr 2e-3 constant | 1500 | 0 | 51.00 | 49.21 (-1.79) | -- | 42.10 (-8.89) |
| AdamW lr 2e-3, warm-up 100, cosine | 1500 | 0 | 52.19 | 50.34 (-1.85) | -- | 44.55 (-7.64) |
| AdamW lr 2e-3 constant | 3000 | 0 | 55.62 | 54.29 (-1.33) | -- | -- |
| AdamW lr 2e-3 constant, clip 1.0 | 1500 | 0 | 51.56 | 48.04 (-3.52) | -- | -- |
| AdamW lr 1e-3 constant | 1500 | 0 | 51.88 | 51.17 (-0.71) | -- | -- |
| AdamW lr 1e-3 constant | 1500 | 1 | 51.96 | 51.80 (-0.15) | -- | -- |
| AdamW lr 1e-3, warm-up 100, cosine | 1500 | 0 | 50.31 | 49.95 (-0.36) | 48.09 (-2.22) | 48.26 (-2.05) |
| AdamW lr 1e-3, warm-up 100, cosine | 1500 | 1 | 50.14 | 49.75 (-0.40) | -- | -- |
| AdamW lr 1e-3, warm-up 100, cosine | 1500 | 2 | 49.15 | 48.74 (-0.41) | -- | -- |

    python benchmarks/pipeline/accuracy.py --steps 1500 --lr 1e-3 --warmup 100 --schedule cosine  # the plot
    python benchmarks/pipeline/accuracy.py --steps 1500 --runs sync,predict,none                     # row 1
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

CONTEXT = 16
BATCH = 64
HIDDEN = 256


def corpus():
    import pydoc_data.topics as topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], len(chars)


def build_model(vocab, stages, seed=0):
    torch.manual_seed(seed)
    mods = [nn.Embedding(vocab, 24), nn.Flatten(), nn.Linear(24 * CONTEXT, HIDDEN), nn.Tanh()]
    for _ in range(max(3, stages) - 1):
        mods += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    mods += [nn.Linear(HIDDEN, vocab)]
    model = nn.Sequential(*mods)
    linear = [str(i) for i, m in enumerate(mods) if isinstance(m, nn.Linear)]
    # stage 0 begins with the embedding; stages 1..K-1 begin at Linear layers spread over the rest
    picks = [linear[round(j * (len(linear) - 1) / stages) + 1] if j else None for j in range(stages)][1:]
    return model, picks


def windows(ids, n, gen):
    start = torch.randint(0, len(ids) - CONTEXT - 1, (n,), generator=gen)
    idx = start[:, None] + torch.arange(CONTEXT + 1)
    w = ids[idx]
    return w[:, :-1], w[:, -1]


def lr_factor(step, warmup, total, schedule):
    """The learning rate of update number `step` (0-based) as a fraction of --lr."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return 1.0


def optimizer_factory(args):
    """The same optimizer for every row. Warm-up/decay and clipping are hooks on the stage's own optimizer,
    so the learning rate is indexed by that stage's update count and each stage clips its own gradient
    (the same in the synchronous and the asynchronous rows)."""
    def make(params):
        params = list(params)
        if args["optimizer"] == "sgd":
            opt = torch.optim.SGD(params, lr=args["lr"] or 0.1, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=args["lr"] or 2e-3)
        if args["warmup"] or args["schedule"] != "constant":
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda i: lr_factor(i, args["warmup"], args["steps"], args["schedule"]))
            opt.register_step_post_hook(lambda *_: sched.step())
        if args["clip"]:
            def clip(*_):  # a pre-hook returns None (or new args)
                torch.nn.utils.clip_grad_norm_(params, args["clip"])
            opt.register_step_pre_hook(clip)
        return opt
    return make


def _worker(rank, world, port, run, args, out_dir):
    import torch.distributed as dist

    from memsched.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    train, _, vocab = corpus()
    model, splits = build_model(vocab, world, seed=args["seed"])
    schedule, policy = run
    kw = {"n_microbatches": 4} if schedule != "async-1f1b" else {"policy": policy}
    gen = torch.Generator().manual_seed(1234 + args["seed"])
    losses, ckpts = [], {}
    t0 = time.perf_counter()
    with Pipeline(model, splits, optimizer=optimizer_factory(args), loss_fn=F.cross_entropy,
                  schedule=schedule, **kw) as pipe:
        for step in range(1, args["steps"] + 1):
            loss = pipe.step(windows(train, BATCH, gen))
            if loss is not None:
                losses.append(float(loss))
            if step % args["eval_every"] == 0 or step == args["steps"]:
                ckpts[step] = {k: v.detach().clone() for k, v in pipe.stage_module.state_dict().items()}
        pipe.flush()  # async: apply the micro-batches still in flight, so every row has made `steps` updates
        ckpts["flushed"] = {k: v.detach().clone() for k, v in pipe.stage_module.state_dict().items()}
        seconds = time.perf_counter() - t0
        report = pipe.report()
        dist.barrier()
    torch.save({"losses": losses, "ckpts": ckpts, "stage": pipe.stage_indices[0], "report": report,
                "seconds": seconds, "splits": splits}, os.path.join(out_dir, f"{rank}.pt"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(run, world, args, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, run, args, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{run}: a process failed (exit codes {[p.exitcode for p in procs]})")
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


@torch.no_grad()
def accuracy(model, held):
    x = held.unfold(0, CONTEXT + 1, 1)[:: 2]  # every other window of the held-out text
    correct = 0
    for i in range(0, len(x), 4096):
        w = x[i:i + 4096]
        correct += (model(w[:, :-1]).argmax(-1) == w[:, -1]).sum().item()
    return 100.0 * correct / len(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float, default=None, help="default 2e-3 (adamw), 0.1 (sgd)")
    ap.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up over this many updates")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                    help="learning rate after the warm-up: constant, or cosine decay to 0 at --steps")
    ap.add_argument("--clip", type=float, default=0.0, help="clip each stage's gradient norm to this (0: off)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and batch order")
    ap.add_argument("--out-dir", default="pipeline_accuracy")
    ap.add_argument("--runs", default="sync,predict,stash,none",
                    help="which rows: sync (1F1B, the reference row; always run), predict, stash, none")
    args = ap.parse_args(argv)
    cfg = {"steps": args.steps, "eval_every": args.eval_every, "optimizer": args.optimizer, "lr": args.lr,
           "warmup": args.warmup, "schedule": args.schedule, "clip": args.clip, "seed": args.seed}
    _, held, vocab = corpus()
    wanted = set(args.runs.split(","))
    runs = [("1f1b", None)] + [("async-1f1b", p) for p in ("predict", "stash", "none") if p in wanted]
    results = {}
    for run in runs:
        name = run[0] if run[1] is None else f"{run[0]} {run[1]}"
        per_rank = run_one(run, args.stages, cfg, os.path.join(args.out_dir, name.replace(" ", "_")))
        model, _ = build_model(vocab, args.stages, seed=args.seed)
        from memsched.pipeline import split_stages
        stages = split_stages(model, per_rank[0]["splits"])
        curve = {}
        for step in per_rank[0]["ckpts"]:
            for r in per_rank:
                stages[r["stage"]].load_state_dict(r["ckpts"][step])
            curve[step] = accuracy(model, held)
        final = curve.pop("flushed")
        results[name] = {"curve": curve, "final_accuracy": final, "unflushed_accuracy": curve[max(curve)],
                         "losses": per_rank[-1]["losses"],
                         "seconds": max(r["seconds"] for r in per_rank),
                         "memory": [r["report"] for r in per_rank]}
        print(f"{name:22s} final held-out accuracy {final:.2f}% (before the flush {curve[max(curve)]:.2f}%)  "
              f"({max(r['seconds'] for r in per_rank):.1f} s for {args.steps} steps)", flush=True)
    sync = results["1f1b"]["final_accuracy"]
    print(f"\n| run | final accuracy | vs synchronous | before the flush |\n| --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['final_accuracy']:.2f}% | {r['final_accuracy'] - sync:+.2f} points | "
              f"{r['unflushed_accuracy']:.2f}% |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for name, r in results.items():
            a.plot(list(r["curve"]), list(r["curve"].values()), label=name, marker=".")
            ls = torch.tensor(r["losses"])
            k = 25
            smooth = ls.unfold(0, k, 1).mean(1) if len(ls) > k else ls
            b.plot(range(k, k + len(smooth)), smooth.tolist(), label=name)
        a.set(xlabel="step", ylabel="held-out next-character accuracy (%)", title=f"{args.stages} stages, {args.optimizer}")
        b.set(xlabel="step", ylabel="training loss (mean of 25)", title="training loss (last stage)")
        a.legend()
        b.legend()
        fig.tight_layout()
        path = os.path.join(args.out_dir, "accuracy.png")
        fig.savefig(path, dpi=110)
        print(f"\nplot: {path}")
    except ImportError:
        print("matplotlib is not installed: no plot")
    with open(os.path.join(args.out_dir, "accuracy.json"), "w") as f:
        json.dump({k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in results.items()}, f, indent=1,
                  default=str)
    return results


if __name__ == "__main__":
    main()
