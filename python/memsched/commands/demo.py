"""python -m memsched demo: profile a small transformer training step on CPU (or
--device cuda), print what the Trace says and plot its memory curve.

Writes DIR/trace.json and DIR/memory_curve.png (matplotlib, Agg backend).
"""
import argparse
import os
import sys

from memsched.commands.args import fraction, int_at_least, output_dir, torch_device

HELP = "profile a small transformer step: print a table and write the memory curve as a PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="demo_out", help="output folder (default demo_out)")
    parser.add_argument("--batch", type=int_at_least(1, most=100_000), default=8, help="batch size (default 8)")
    parser.add_argument("--device", type=torch_device, default="cpu", help="torch device (default cpu)")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the side-by-side training run (plain vs memsched at --budget)")
    parser.add_argument("--steps", type=int_at_least(2, " (a memsched run's first step is profiled, not timed)"),
                        default=5, help="training steps per run of the comparison, at least 2 (default 5)")
    parser.add_argument("--budget", type=fraction, default=0.5,
                        help="comparison budget, as a share of plain's activation memory (default 0.5)")
    parser.add_argument("--warmup", type=int_at_least(0, most=1000), default=1,
                        help="plain steps before the profiled one, to keep one-time setup out of op times (default 1)")


def summary_rows(trace):
    """(label, value) rows of the demo table, computed from a Trace."""
    from memsched.units import format_bytes

    phases = {p: sum(o.phase == p for o in trace.ops) for p in ("forward", "backward", "optimizer")}
    peak_id = trace.peak_op()
    peak = trace.ops[peak_id] if peak_id >= 0 else None
    rows = [
        ("ops (forward / backward / optimizer)",
         f"{len(trace.ops)} ({phases['forward']} / {phases['backward']} / {phases['optimizer']})"),
        ("tensors (after storage de-dup)", str(len(trace.tensors))),
        ("saved activations", f"{format_bytes(trace.activation_bytes())} "
                              f"({sum(t.kind == 'activation' for t in trace.tensors)} tensors)"),
        ("parameters", format_bytes(trace.bytes_of_kind("parameter"))),
        ("gradients", format_bytes(trace.bytes_of_kind("gradient"))),
        ("peak live bytes", format_bytes(trace.peak_bytes())),
    ]
    if peak is not None:
        rows.append(("peak at", f"op {peak.id} {peak.name} ({peak.phase}, module '{peak.module_path}')"))
    rows.append(("measured op time", f"{sum(o.duration_us for o in trace.ops) / 1000:.2f} ms"))
    return rows


def plot_memory_curve(trace, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = trace.live_bytes()
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(range(len(live)), [b / 2**20 for b in live], lw=1.2, label="live bytes")
    colors = {"forward": "#dbe9f6", "backward": "#fde3cf", "optimizer": "#e2f0d9"}
    start = 0
    ops = trace.ops  # once: each read copies every op
    for i in range(1, len(ops) + 1):  # shade each run of one phase
        if i == len(ops) or ops[i].phase != ops[start].phase:
            ax.axvspan(start - 0.5, i - 0.5, color=colors[ops[start].phase], lw=0)
            start = i
    peak = trace.peak_op()
    if peak >= 0:
        ax.plot([peak], [live[peak] / 2**20], "r.", ms=8, label=f"peak: op {peak} {ops[peak].name}")
    ax.set_xlabel("op (execution order; blue forward, orange backward, green optimizer)")
    ax.set_ylabel("live MiB")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    import memsched
    from memsched import models

    error = output_dir(args.out_dir, "--out-dir")  # created before the work (Note [Command-line input ...])
    if error is not None:
        print(f"memsched demo: {error}", file=sys.stderr)
        return 2
    model = models.build_model("transformer", "small", device=args.device)
    step = models.make_step_fn(model, "transformer", args.batch, device=args.device)
    for _ in range(args.warmup):
        step()
    trace = memsched.profile(step, model=model)
    rows = summary_rows(trace)
    width = max(len(k) for k, _ in rows)
    print(f"memsched demo: one training step of the small transformer (batch {args.batch}, {trace.device})")
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
    trace_path = os.path.join(args.out_dir, "trace.json")
    png_path = os.path.join(args.out_dir, "memory_curve.png")
    trace.to_json(trace_path)
    plot_memory_curve(trace, png_path, f"small transformer, batch {args.batch}: live bytes per op")
    print(f"wrote {trace_path} and {png_path}")
    if args.compare:  # issue 5: the same training plainly and under memsched.optimize (offload/compare.py)
        from memsched.offload.compare import compare
        print()
        try:
            compare("transformer", "small", args.batch, args.steps, args.budget, args.device,
                    timeline_path=os.path.join(args.out_dir, "timeline.png"))
        except memsched.MemschedError as e:  # a traceback before; the message names the least budget
            print(f"memsched demo: {e}", file=sys.stderr)
            return 1
    return 0
