"""bench_copy_engine.py -- copy throughput of memsched's CopyEngine while copies are the bottleneck.

Issue 10 asks for at least 45 GB/s per direction on an H100, where pinned copies measured 55 GB/s
each way and 94 GB/s both ways at once (../shared/evidence). This measures the engine alone, with
nothing else on the GPU, beside torch's own non_blocking copies as the peer:

    python benchmarks/gpu/bench_copy_engine.py [--device cuda] [--mib 64] [--count 16] [--rounds 5] [--out F]
                                               [--time-budget SECONDS]

Rows (GB/s = 1e9 bytes per second; median over --rounds):
  memsched d2h   offload_many of count x mib MiB device tensors (the D2H stream, pinned
                 HostTensorPool blocks), timed by the engine's own copy events (timeline=True): all
                 bytes over the span from the first copy's start to the last one's end;
  memsched h2d   fetch() of those host copies back to fresh device tensors, timed the same way;
  memsched both  the next offload_many and the fetches of the previous copies issued together, so
                 the D2H and H2D streams run at once: all bytes over the span of all copies;
  torch d2h/h2d  tensor.copy_(non_blocking=True) into / from pinned tensors on one side stream,
                 timed by CUDA events around the copies: the link without memsched.
On CPU the same code runs with host memcpy and the wall clock (reduced sizes with --small); those
figures are not GPU numbers and the output says so.
Time: the sources are drawn on the device (the H100 run of 2026-11-28 drew its 2 x 16 x 64 MiB on the
CPU, ~0.5 s each, and gpu_check's 14 s ran out before the first round); --time-budget S starts no round
once S seconds have passed since the script started, after at least one measured round past the warm-up
round, and the JSON's "rounds" says how many ran.
"""
import argparse
import faulthandler
import json
import platform
import statistics
import sys
import time

STARTED = time.monotonic()  # --time-budget counts from here: torch's and memsched's imports included
faulthandler.enable()  # a crash in the extension names its Python frame

import torch  # noqa: E402

from memsched import _C  # noqa: E402


def _spans(copies):
    """{kind: (bytes, first start, last end)} of [(kind, start_s, end_s, nbytes)]."""
    out = {}
    for kind, start, end, nbytes in copies:
        b, s, e = out.get(kind, (0, start, end))
        out[kind] = (b + nbytes, min(s, start), max(e, end))
    return out


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _copies_of(engine, log, device):
    if device.type == "cuda":
        engine.mark_end(log)
        return log.resolve()[2]
    return log.host_copies()


def _sources(device, count, nbytes, seed):
    g = torch.Generator(device).manual_seed(seed)  # drawn where they live: on the GPU, not ~0.4 s per 64 MiB
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device) for _ in range(count)]


def memsched_round(engine, device, sources, later):
    """{row: GB/s} for one round: offload `sources`, fetch them back, then offload `later` while
    fetching the first copies again (both streams at once)."""
    _sync(device)
    engine.begin_step()
    tickets = engine.offload_many(sources)
    d2h = _spans(_copies_of(engine, engine.end_step(), device))["d2h"]
    engine.begin_step()
    fetched = [engine.fetch(t.dst, t) for t in tickets]
    h2d = _spans(_copies_of(engine, engine.end_step(), device))["h2d"]
    del fetched
    engine.begin_step()
    more = engine.offload_many(later)
    again = [engine.fetch(t.dst, t) for t in tickets]
    spans = _spans(_copies_of(engine, engine.end_step(), device))
    both_bytes = sum(b for b, _, _ in spans.values())
    both_s = max(e for _, _, e in spans.values()) - min(s for _, s, _ in spans.values())
    del more, again, tickets
    _sync(device)
    engine.poll()
    return {"memsched d2h": _gbps(d2h[0], d2h[2] - d2h[1]), "memsched h2d": _gbps(h2d[0], h2d[2] - h2d[1]),
            "memsched both": _gbps(both_bytes, both_s)}


def torch_round(device, sources, pinned):
    """{row: GB/s}: the same bytes through tensor.copy_(non_blocking=True) on one side stream."""
    nbytes = sum(s.numel() for s in sources)
    out = {}
    if device.type != "cuda":
        t0 = time.perf_counter()
        for s, h in zip(sources, pinned):
            h.copy_(s)
        out["torch d2h"] = _gbps(nbytes, time.perf_counter() - t0)
        back = [torch.empty_like(s) for s in sources]
        t0 = time.perf_counter()
        for b, h in zip(back, pinned):
            b.copy_(h)
        out["torch h2d"] = _gbps(nbytes, time.perf_counter() - t0)
        return out
    stream = torch.cuda.Stream(device)
    back = [torch.empty_like(s) for s in sources]
    for name, pairs in (("torch d2h", zip(pinned, sources)), ("torch h2d", zip(back, pinned))):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        out[name] = _gbps(nbytes, start.elapsed_time(end) / 1e3)
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device, mib, count, rounds, time_budget=None):
    """time_budget: seconds since the script started after which no further round starts (at least one
    measured round runs after the warm-up round)."""
    device = torch.device(device)
    nbytes = mib << 20
    engine = _C.CopyEngine(device, _C.HostTensorPool(device.type == "cuda"), -1, True)
    sources = _sources(device, count, nbytes, 0)
    later = _sources(device, count, nbytes, 1)
    pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(count)]
    samples = {}
    for i in range(rounds + 1):  # the first round warms the pools and the streams
        if i >= 2 and time_budget is not None and time.monotonic() - STARTED > time_budget:
            break
        row = memsched_round(engine, device, sources, later)
        row.update(torch_round(device, sources, pinned))
        for k, v in row.items():
            samples.setdefault(k, []).append(v)
    engine.release()
    rounds = len(next(iter(samples.values()))) - 1
    rows = {k: {"gbps_median": statistics.median(v[1:]), "gbps_rounds": v[1:]} for k, v in samples.items()}
    for d in ("d2h", "h2d"):  # memsched's rate as a share of torch's own copies, rounds side by side
        rows[f"memsched {d}"]["vs_torch"] = rows[f"memsched {d}"]["gbps_median"] / rows[f"torch {d}"]["gbps_median"]
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "python": platform.python_version(), "mib": mib, "count": count,
            "rounds": rounds, "bytes_per_direction": count * nbytes, "rows": rows}


def format_rows(res):
    lines = [f"# bench_copy_engine on {res['gpu'] or 'CPU (not a GPU number)'}: {res['count']} x {res['mib']} MiB, "
             f"median of {res['rounds']} rounds"]
    for name, r in res["rows"].items():
        ratio = f"  ({r['vs_torch']:.2f}x torch's)" if "vs_torch" in r else ""
        lines.append(f"  {name:14s} {r['gbps_median']:8.2f} GB/s{ratio}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mib", type=int, default=64, help="size of each copy, MiB")
    p.add_argument("--count", type=int, default=16, help="copies per direction per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--small", action="store_true", help="4 x 1 MiB, 2 rounds (CPU smoke)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the start after which no further round starts (at least one measured round)")
    args = p.parse_args(argv)
    mib, count, rounds = (1, 4, 2) if args.small else (args.mib, args.count, args.rounds)
    for name, v in (("--mib", mib), ("--count", count), ("--rounds", rounds)):
        if v < 1:
            p.error(f"{name} must be at least 1, got {v}")
    res = measure(args.device, mib, count, rounds, args.time_budget)
    print(format_rows(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
