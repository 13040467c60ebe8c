"""The side-by-side demo of memsched.optimize(): the same training, plainly and under a budget.

Entry point: compare(model_name="transformer", ...) -> (rows, run), used by
`python -m memsched demo` (memsched/commands/demo.py). Trains one of the
example models (memsched.models) for a few steps three ways from the same
initial weights and data -- plain PyTorch, memsched with no budget
(keep_all: the instrumented baseline) and memsched at a fraction of the
activation memory -- prints one table and writes the timeline PNG of the
budgeted run. Works on CPU (copies are host copies; memory is the executor's
count of saved activations alive) and on CUDA (memory_allocated).
"""
import copy
import statistics
import time

import torch

from memsched import allocator
from memsched.offload.report import format_table
from memsched.units import format_bytes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(model, opt, data, loss_fn, steps, device, run=None):
    x, y = data
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def compare(model_name="transformer", size="small", batch=8, steps=5, budget_fraction=0.5, device="cpu",
            planner="dp", timeline_path=None, out=print, cpu_threads=1):
    """Train plainly and under memsched; print the table; return (rows, budgeted Run).

    On CPU the runs use `cpu_threads` intra-op threads (restored afterwards): tiny models on a busy
    2-core machine time erratically with OpenMP's spinning threads (steps of 2 ms become 2 s).
    """
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        return _compare(model_name, size, batch, steps, budget_fraction, device, planner, timeline_path, out)
    finally:
        torch.set_num_threads(threads)


def _compare(model_name, size, batch, steps, budget_fraction, device, planner, timeline_path, out):
    import memsched
    from memsched import models

    device = torch.device(device)
    base = models.build_model(model_name, size, device=device)
    data = models.example_batch(model_name, batch, size, device=device)
    loss_fn = lambda logits, y: models.loss_fn(model_name, logits, y)
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)
    rows, runs = [], {}
    results = {}
    warm = copy.deepcopy(base)  # one-time costs (allocator, kernels) stay out of every timed row
    _train(warm, make_opt(warm), data, loss_fn, 2, device)
    notes = []
    for label, budget in (("plain PyTorch", "plain"), ("memsched keep_all (no budget)", None),
                          (f"memsched {planner} {budget_fraction:.0%} of activations", budget_fraction)):
        model = copy.deepcopy(base)
        opt = make_opt(model)
        if device.type == "cuda":
            allocator.reset_cuda_peak(device)
        if budget == "plain":
            times = _train(model, opt, data, loss_fn, steps, device)
            peak = allocator.cuda_max_memory_allocated(device) if device.type == "cuda" else None
            results[label] = dict(times=times, peak=peak, moved=0, stall=0.0, params=model)
            continue
        attempts = [(planner, budget)]
        while True:
            use_planner, use_budget = attempts[-1]
            model = copy.deepcopy(base)
            opt = make_opt(model)
            run = memsched.optimize(model, opt, budget=use_budget, planner=use_planner, timeline=True)
            try:
                with run:
                    times = _train(model, opt, data, loss_fn, steps, device, run=run)
                break
            except memsched.MemschedError as e:
                if use_budget is None or len(attempts) > 2 or run.trace is None:
                    raise
                # The planner cannot meet this budget on this (small) model. Say so and retry: first with
                # greedy (which reaches the least budget any plan can), then at that least budget.
                # the least the refusal names: with the optimizer state the first step created, which
                # least_budget_bytes(trace) alone leaves out (the retry at that was refused again)
                least = memsched.planning.planner_least_bytes(e, run.trace)
                if use_planner != "greedy" and run.budget_bytes is not None and run.budget_bytes >= least:
                    notes.append(f"note: {use_planner} cannot meet {format_bytes(run.budget_bytes)}; "
                                 "used greedy, which reaches the least budget")
                    attempts.append(("greedy", use_budget))
                else:
                    notes.append(f"note: {format_bytes(run.budget_bytes)} is below the least budget any plan "
                                 f"reaches on this model ({format_bytes(least)}); used that least budget")
                    attempts.append(("greedy", least))
        if len(attempts) > 1:
            label = f"memsched {attempts[-1][0]} " + (f"{budget_fraction:.0%} of activations"
                                                      if attempts[-1][1] == budget else "at the least budget")
        executed = [s for s in run.step_stats if s.mode == "planned"]
        runs[label] = run
        results[label] = dict(
            times=times[1:],  # the profiled step is not a step of the method
            peak=max((s.peak_bytes for s in executed), default=None),
            moved=statistics.median(s.d2h_bytes + s.h2d_bytes for s in executed) if executed else 0,
            stall=statistics.median(s.stall_s for s in executed) if executed else 0.0,
            params=model, run=run)
    plain = results["plain PyTorch"]
    plain_ms = statistics.median(plain["times"]) * 1e3
    mem_name = "peak allocated" if device.type == "cuda" else "peak saved activations (measured)"
    for label, r in results.items():
        ms = statistics.median(r["times"]) * 1e3
        same = all(torch.equal(a, b) for a, b in zip(r["params"].parameters(), plain["params"].parameters()))
        rows.append([label, f"{ms:.2f}", f"{ms / plain_ms:.2f}x",
                     format_bytes(r["peak"]) if r["peak"] is not None else "- (not instrumented)",
                     format_bytes(r["moved"]), f"{r['stall'] * 1e3:.2f}", "yes" if same else "NO"])
    header = ["run", "step (ms)", "vs plain", mem_name, "bytes moved", "stall (ms)", "weights == plain"]
    out(f"memsched demo: {model_name} ({size}), batch {batch}, {steps} AdamW steps each, on {device}"
        + (f" ({torch.get_num_threads()} thread) -- CPU times, host copies stand in for PCIe"
           if device.type == "cpu" else ""))
    out(format_table(header, rows))
    for n in notes:
        out(n)
    budgeted = runs[list(runs)[-1]]
    out("")
    if out is print:
        budgeted.report()
    else:
        out(str(budgeted.report(file=_Null())))
    if timeline_path is not None:
        budgeted.save_timeline(timeline_path)
        out(f"wrote {timeline_path}")
    return rows, budgeted


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass
