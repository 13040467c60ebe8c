"""peak_snapshot.py -- what the CUDA caching allocator holds at a training step's peak, by where it was
allocated: bench_offload's --peak-snapshot.

Entry points: record_step(step, device) -> summary (CUDA only); attribute_peak(snapshot, device_index)
-> summary of a torch.cuda.memory._snapshot() taken while recording.

Note [Where a planned step's extra memory was allocated]
  Rationale: on the first H100 run the dp rows' measured peaks were about 650 MiB above their plans,
  all of it "not in the profiled step" (Note [Where the peak went] in memsched/offload/peak_gap.py):
  memory the planned step held in its backward that the profiled step did not, which the allocator's
  counters alone cannot name. The allocator's own trace can.
  Approach: one extra step of a row, after its timed steps, runs under
  torch.cuda.memory._record_memory_history(stacks="python"); its trace is replayed: the allocated
  count goes up at each 'alloc' and down at each 'free_requested' (where the allocator's
  allocated_bytes drops; a block used on another stream is reused only at 'free_completed'). At the
  step's highest count, the blocks allocated during the step and still live are summed by the
  innermost Python frame outside torch (the model's line, memsched's), by size and by stream.
  Blocks allocated by the autograd engine's thread carry no Python frame: those are "backward
  (autograd thread)"; their sizes, set beside the trace's tensors, still tell an activation brought
  back from a gradient. Rows measured this way side by side (plain, budget=None, dp) show what the
  planned step adds.
  Limitations: recording with Python stacks slows the recorded step's host (it is not timed), so the
  GPU falls less far behind than in a timed step and copies still in flight ("late release") may hold
  less there: the snapshot names what the step allocates, not how late it is given back; the ring
  buffer keeps max_entries events (a truncated trace says so); blocks the step did not allocate
  (parameters, optimizer state) are the baseline, not attributed.
"""
from __future__ import annotations

import os
from collections import defaultdict

AUTOGRAD_THREAD = "backward (autograd thread: no Python frame)"


def _torch_dir():
    import torch

    return os.path.dirname(torch.__file__)


def _where(frames, skip_prefixes):
    """The innermost frame outside torch and the interpreter's own files, as 'file:line name'."""
    for f in frames or ():
        name = f.get("filename", "")
        if not name or name.startswith(skip_prefixes) or name.startswith("<"):
            continue
        return f"{os.path.basename(name)}:{f.get('line', '?')} {f.get('name', '')}".rstrip()
    return AUTOGRAD_THREAD if not frames else "torch internals"


def attribute_peak(snapshot, device_index=0, top=12, skip_prefixes=None):
    """Summary of the step recorded in `snapshot` (torch.cuda.memory._snapshot()): the highest allocated
    count over the recording's start and the live blocks allocated during the recording at that moment,
    grouped (See Note [Where a planned step's extra memory was allocated])."""
    if skip_prefixes is None:
        import sysconfig

        skip_prefixes = (_torch_dir(), sysconfig.get_paths()["stdlib"])
    skip_prefixes = tuple(skip_prefixes)
    traces = snapshot.get("device_traces") or []
    events = traces[device_index] if device_index < len(traces) else []
    running = peak = 0
    peak_index = -1
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            running += e["size"]
        elif action == "free_requested":
            running -= e["size"]
        else:
            continue
        if running > peak:
            peak, peak_index = running, i
    live = {}
    for e in events[:peak_index + 1]:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
        elif action == "free_requested":
            live.pop(e["addr"], None)  # (a block allocated before the recording is not in `live`)
    by_where = defaultdict(lambda: [0, 0])
    by_size = defaultdict(int)
    by_stream = defaultdict(int)
    for e in live.values():
        w = by_where[_where(e.get("frames"), skip_prefixes)]
        w[0] += e["size"]
        w[1] += 1
        by_size[e["size"]] += 1
        by_stream[str(e.get("stream", 0))] += e["size"]
    return {
        "events": len(events),
        "peak_over_start_bytes": peak,
        "live_at_peak_bytes": sum(e["size"] for e in live.values()),
        "live_at_peak_blocks": len(live),
        "by_where": sorted(([w, b, n] for w, (b, n) in by_where.items()), key=lambda r: -r[1])[:top],
        "by_size": sorted(([s, n, s * n] for s, n in by_size.items()), key=lambda r: -r[2])[:top],
        "by_stream": dict(sorted(by_stream.items(), key=lambda kv: -kv[1])),
    }


def record_step(step, device, max_entries=1_000_000, top=12):
    """Run step() once with the allocator's history recorded; returns attribute_peak()'s summary with
    "truncated" (the ring buffer overflowed) and the allocated bytes before the step."""
    import torch

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    out = attribute_peak(snap, index, top=top)
    out["allocated_before_bytes"] = before
    out["truncated"] = out["events"] >= max_entries
    return out


def format_summary(method, s, fmt_bytes):
    """Lines for bench_offload's report."""
    lines = [f"peak snapshot, {method}: +{fmt_bytes(s['peak_over_start_bytes'])} over the step's start "
             f"({fmt_bytes(s['allocated_before_bytes'])} before it); {s['live_at_peak_blocks']} blocks the step "
             f"allocated live at its peak ({fmt_bytes(s['live_at_peak_bytes'])})"
             + ("; TRUNCATED trace" if s.get("truncated") else "")]
    for where, nbytes, n in s["by_where"]:
        lines.append(f"    {fmt_bytes(nbytes):>11s} in {n:5d} blocks  {where}")
    sizes = ", ".join(f"{n} x {fmt_bytes(size)}" for size, n, _ in s["by_size"][:6])
    lines.append(f"    largest by size: {sizes}; by stream: "
                 + ", ".join(f"{k}: {fmt_bytes(v)}" for k, v in s["by_stream"].items()))
    return lines
