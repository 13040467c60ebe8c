"""python -m memsched partition TRACE.json --devices 4 --cap 8GiB: place a saved trace's ops on several
devices under a memory cap with every method (S3 and the baselines), print the table, save the best
partition as JSON."""
import sys

from memsched.commands.args import int_at_least, output_file

HELP = "partition a saved trace across devices under memory caps and compare methods (S3, even, flops, metis, milp)"


def add_arguments(p):
    p.add_argument("trace", help="trace JSON (from `python -m memsched profile` or Trace.to_json)")
    p.add_argument("--devices", type=int_at_least(1), default=4, help="number of devices (default 4)")
    p.add_argument("--device", default="h100-sxm",
                   help="device preset for every device (h100-sxm [default], h100-pcie, cpu) or a JSON path")
    p.add_argument("--cap", required=True,
                   help="memory cap per device: a size like 8GiB, bytes, or a percentage of the single-device "
                        "peak like 50%%")
    p.add_argument("--methods", default="all", help="comma-separated methods or 'all' (s3,even,flops,metis,milp; default all)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="link bandwidth between devices, GB/s (default: NVLink 450 for h100-sxm, else PCIe)")
    p.add_argument("--durations", default="auto", choices=["auto", "measured", "roofline"],
                   help="op times: measured or roofline (default auto: measured only for a trace from the same device "
                        "kind)")
    p.add_argument("--out", default=None, help="write the best fitting partition as JSON here")


def run(args):
    import memsched
    from memsched.partition import METHODS, compare, format_table
    from memsched.partition.devices import resolve_devices
    from memsched.partition.table import best_row

    methods = "all" if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:  # --methods "" (a table of no row raised a TypeError)
        print(f"memsched partition: --methods names no method; give all or some of {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    if methods != "all":
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            print(f"memsched partition: unknown method(s) {', '.join(unknown)}; known: all, {', '.join(METHODS)}",
                  file=sys.stderr)
            return 2
    if args.out is not None:
        error = output_file(args.out, "--out", "partition.json")
        if error is not None:
            print(f"memsched partition: {error}", file=sys.stderr)
            return 2
    try:
        trace = memsched.Trace.from_json(args.trace)
    except memsched.MemschedError as e:
        print(f"memsched partition: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    if args.devices > len(trace.ops):  # (before a list of that many names: 10**9 filled the host's memory)
        print(f"memsched partition: --devices {args.devices} for a trace of {len(trace.ops)} ops; a device holds at "
              f"least one op, so give at most {len(trace.ops)}", file=sys.stderr)
        return 2
    try:
        dset = resolve_devices([args.device] * args.devices, args.cap, trace.peak_bytes(), links=args.link_gbps,
                               trace=trace, durations=args.durations)
        rows = compare(trace, [args.device] * args.devices, args.cap, methods, links=args.link_gbps,
                       durations=args.durations)
    except (ValueError, memsched.MemschedError) as e:
        print(f"memsched partition: {str(e).removeprefix('partition: ')}", file=sys.stderr)
        return 2
    print(f"trace {args.trace}: {len(trace.ops)} ops, {len(trace.tensors)} tensors, single-device peak "
          f"{memsched.format_bytes(trace.peak_bytes())}")
    print(f"{args.devices} x {dset.names[0]}, cap {memsched.format_bytes(dset.caps[0])} each, links "
          f"{dset.link_bw_gbps:g} GB/s + {dset.link_latency_us:g} us")
    print(format_table(rows))
    best = best_row(rows)
    if best is None and all(r["partition"] is None for r in rows):
        # no method ran (milp alone on more ops than it takes): the caps were never tried
        why = "; ".join(f"{r['method']}: {r['error']}" for r in rows)
        print(f"memsched partition: no method produced a placement ({why}); choose others with --methods",
              file=sys.stderr)
        return 1
    if best is None:
        from memsched.partition.api import caps_error, _Source, _problem
        problem, _ = _problem(_Source(trace, None), [args.device] * args.devices, args.cap, args.link_gbps, 5.0,
                              args.durations)
        message = str(caps_error(problem, dset, trace, None, flag="--cap ")).removeprefix("partition: ")
        print(f"memsched partition: {message}", file=sys.stderr)
        return 1
    if args.out is not None:
        best["partition"].to_json(args.out)
        print(f"best: {best['method']}; partition written to {args.out}")
    else:
        print(f"best: {best['method']}")
    return 0
