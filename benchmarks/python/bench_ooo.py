"""Out-of-order backward on CPU: step time, gradient memory, DDP communication start.

Run:  python3 -m pytest -q -s benchmarks/python/bench_ooo.py      (pytest-benchmark; prints tables)
      python3 benchmarks/python/bench_ooo.py [--json out.json]     (the same tables, no pytest)

1. Step time (forward + backward + AdamW update) of memsched.models' example
   models ("realistic" sizes), plain PyTorch vs ooo (deferred dW, caller runs
   optimizer.step()) vs ooo+fused (update inside backward). The three run
   interleaved round by round on identical copies, so machine load hits all
   alike; median and interquartile range in ms, ratio of medians vs plain.
2. Gradient memory of the realistic transformer: bytes held by gradients at
   their peak during the step (plain: sampled after every AccumulateGrad; ooo:
   the executor's own count of pending + .grad bytes), and the whole step's
   peak from torch.distributed._tools.mem_tracker.MemTracker (parameters,
   activations, gradients, optimizer state, temporaries).
3. DDP (gloo, 2 processes on 127.0.0.1, realistic transformer, default DDP
   buckets): ms from the start of loss.backward() to the first all-reduce
   launch and to the end of the step (after optimizer.step()), plain DDP (a
   comm hook timestamps each bucket) vs memsched ooo+fused.
All numbers are CPU numbers on this machine; they say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time

import torch

from memsched import models
from memsched.ooo import OutOfOrderBackward

MODES = ("plain", "ooo", "ooo_fused")
BATCH = {"mlp": 64, "cnn": 32, "transformer": 8}


def _runner(model, name, x, y, mode, executor="auto"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ooo = None
    if mode != "plain":
        ooo = OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=(mode == "ooo_fused"), executor=executor)
        ooo.install()

    def step():
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        if ooo is None or ooo.step():
            opt.step()
            opt.zero_grad(set_to_none=True)

    step.optimizer = opt
    return step, ooo


def step_times(name, size="realistic", rounds=15, warmup=3, executor="auto"):
    """Interleaved step times per mode, seconds."""
    base = models.build_model(name, size)
    x, y = models.example_batch(name, BATCH[name], size)
    runners = {m: _runner(copy.deepcopy(base), name, x, y, m, executor) for m in MODES}
    times = {m: [] for m in MODES}
    try:
        for r in range(warmup + rounds):
            for m in MODES:
                t0 = time.perf_counter()
                runners[m][0]()
                if r >= warmup:
                    times[m].append(time.perf_counter() - t0)
    finally:
        for _, ooo in runners.values():
            if ooo is not None:
                ooo.remove()
    return times


def _summary(ts):
    q = statistics.quantiles(ts, n=4)
    return {"median_ms": statistics.median(ts) * 1e3, "iqr_ms": (q[2] - q[0]) * 1e3, "min_ms": min(ts) * 1e3}


def gradient_memory(name="transformer", size="realistic", untie=False):
    """untie=True gives the transformer's unembedding its own weight: a tied
    weight's two gradients (embedding + unembedding, 2 MiB each) must coexist
    to be summed, which bounds the fused peak from below at twice its size."""
    from torch.distributed._tools.mem_tracker import MemTracker

    out = {}
    base = models.build_model(name, size)
    if untie:
        base.unembed.weight = torch.nn.Parameter(base.tok.weight.detach().clone())
    x, y = models.example_batch(name, BATCH[name], size)
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    for mode in ("plain", "ooo_fused"):
        model = copy.deepcopy(base)
        step, ooo = _runner(model, name, x, y, mode)
        step()  # optimizer state exists from here on
        peak = [0]

        def hook(_p):
            peak[0] = max(peak[0], sum(q.grad.numel() * q.grad.element_size() for q in model.parameters()
                                       if q.grad is not None))

        handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()] if ooo is None else []
        mt = MemTracker()
        mt.track_external(model, step.optimizer)
        with mt:
            step()
        for h in handles:
            h.remove()
        snap = mt.get_tracker_snapshot("peak")
        dev = next(iter(snap))
        grad_peak = peak[0] if ooo is None else ooo.report()["peak_grad_bytes"]
        out[mode] = {"peak_grad_bytes": grad_peak, "step_peak_bytes": snap[dev]["Total"]}
        if ooo is not None:
            ooo.remove()
    out["param_bytes"] = param_bytes
    out["grad_saving"] = 1 - out["ooo_fused"]["peak_grad_bytes"] / out["plain"]["peak_grad_bytes"]
    out["step_peak_saving"] = 1 - out["ooo_fused"]["step_peak_bytes"] / out["plain"]["step_peak_bytes"]
    return out


# ---------------------------------------------------------------- DDP trace
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, port, steps, out_path):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks share the two cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, y = models.example_batch("transformer", BATCH["transformer"], "realistic", seed=rank)
    results = {}
    for mode in ("plain", "ooo_fused"):
        model = models.build_model("transformer", "realistic")
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        launches = []
        ooo = None
        if mode == "plain":
            def hook(state, bucket):
                launches.append(time.perf_counter())
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
        else:
            ooo = OutOfOrderBackward(ddp, optimizer=opt, fuse_optimizer=True).install()
        rows = []
        for k in range(steps):
            launches.clear()
            dist.barrier()
            loss = models.loss_fn("transformer", ddp(x), y)
            t0 = time.perf_counter()
            loss.backward()
            t_bwd = time.perf_counter()
            if ooo is None or ooo.step():
                opt.step()
                opt.zero_grad(set_to_none=True)
            t_end = time.perf_counter()
            first = min(launches) if ooo is None else ooo._reducer.first_allreduce_start()
            if k >= 2:
                rows.append({"first_allreduce_ms": (first - t0) * 1e3, "backward_end_ms": (t_bwd - t0) * 1e3,
                             "step_end_ms": (t_end - t0) * 1e3,
                             "buckets": len(ooo._reducer.buckets) if ooo else None})
        if ooo is not None:
            ooo.remove()
        results[mode] = {key: statistics.median(r[key] for r in rows) for key in
                         ("first_allreduce_ms", "backward_end_ms", "step_end_ms")}
        if ooo is not None:
            results[mode]["buckets"] = rows[0]["buckets"]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def ddp_trace(steps=8, timeout_s=300):
    import tempfile

    import torch.multiprocessing as mp

    out = os.path.join(tempfile.mkdtemp(), "ddp.json")
    ctx = mp.start_processes(_ddp_worker, args=(_free_port(), steps, out), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"DDP benchmark did not finish in {timeout_s} s")
    with open(out) as f:
        return json.load(f)


# ---------------------------------------------------------------- pytest-benchmark entry points
def _bench_env():
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": "cpu"}


def test_step_time_side_by_side(benchmark):
    table = {}
    for name in ("mlp", "cnn", "transformer"):
        t = step_times(name)
        table[name] = {m: _summary(t[m]) for m in MODES}
        for m in MODES[1:]:
            table[name][m]["ratio_vs_plain"] = table[name][m]["median_ms"] / table[name]["plain"]["median_ms"]
    benchmark.extra_info.update({"step_time": table, **_bench_env()})
    print(format_step_table(table))
    benchmark.pedantic(lambda: None, rounds=1)


def test_gradient_memory_transformer(benchmark):
    mem = gradient_memory()
    untied = gradient_memory(untie=True)
    benchmark.extra_info.update({"gradient_memory": mem, "gradient_memory_untied": untied, **_bench_env()})
    print(format_memory(mem))
    print(format_memory(untied, "realistic transformer (untied copy)"))
    benchmark.pedantic(lambda: None, rounds=1)


def test_ddp_first_allreduce(benchmark):
    trace = ddp_trace()
    benchmark.extra_info.update({"ddp": trace, **_bench_env()})
    print(format_ddp(trace))
    benchmark.pedantic(lambda: None, rounds=1)


# ---------------------------------------------------------------- formatting
def format_step_table(table):
    lines = [f"CPU step time, AdamW, realistic models (median ms [IQR], ratio of medians vs plain; "
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)",
             f"{'model':12s}" + "".join(f"{m:>26s}" for m in MODES)]
    for name, row in table.items():
        cells = []
        for m in MODES:
            c = row[m]
            ratio = f" x{c['ratio_vs_plain']:.2f}" if "ratio_vs_plain" in c else ""
            cells.append(f"{c['median_ms']:9.2f} [{c['iqr_ms']:5.2f}]{ratio:>7s}")
        lines.append(f"{name:12s}" + "".join(f"{c:>26s}" for c in cells))
    return "\n".join(lines)


def format_memory(mem, label="realistic transformer (tied embedding)"):
    mib = 1024 * 1024
    return (f"{label}, batch {BATCH['transformer']}: parameters {mem['param_bytes'] / mib:.2f} MiB\n"
            f"  peak gradient bytes: plain {mem['plain']['peak_grad_bytes'] / mib:.2f} MiB, ooo+fused "
            f"{mem['ooo_fused']['peak_grad_bytes'] / mib:.2f} MiB  ({100 * mem['grad_saving']:.1f}% less)\n"
            f"  whole-step peak (MemTracker): plain {mem['plain']['step_peak_bytes'] / mib:.2f} MiB, ooo+fused "
            f"{mem['ooo_fused']['step_peak_bytes'] / mib:.2f} MiB  ({100 * mem['step_peak_saving']:.1f}% less)")


def format_ddp(trace):
    lines = ["DDP gloo x2 on CPU, realistic transformer (median ms from loss.backward() start)"]
    for mode, r in trace.items():
        lines.append(f"  {mode:10s} first all-reduce {r['first_allreduce_ms']:8.2f}   backward end "
                     f"{r['backward_end_ms']:8.2f}   step end {r['step_end_ms']:8.2f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--executor", default="auto", help="ooo executor for the step-time table")
    args = ap.parse_args(argv)
    table = {}
    for name in ("mlp", "cnn", "transformer"):
        t = step_times(name, executor=args.executor)
        table[name] = {m: _summary(t[m]) for m in MODES}
        for m in MODES[1:]:
            table[name][m]["ratio_vs_plain"] = table[name][m]["median_ms"] / table[name]["plain"]["median_ms"]
    print(format_step_table(table), flush=True)
    mem = gradient_memory()
    print(format_memory(mem), flush=True)
    untied = gradient_memory(untie=True)
    print(format_memory(untied, "realistic transformer (untied copy)"), flush=True)
    BATCH["transformer"] = 1  # activations small: the step's peak is where gradients live
    mem_b1 = gradient_memory()
    print(format_memory(mem_b1), flush=True)
    BATCH["transformer"] = 8
    result = {"step_time": table, "gradient_memory": mem, "gradient_memory_untied": untied,
              "gradient_memory_batch1": mem_b1, "executor": args.executor, **_bench_env()}
    if not args.skip_ddp:
        trace = ddp_trace()
        print(format_ddp(trace), flush=True)
        result["ddp"] = trace
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
