"""python -m memsched plan TRACE.json --budget 4GiB --planner all|dp|...: plan and simulate a saved
trace with each planner, print one table, write the best plan's simulated timeline as a PNG."""
import sys

from memsched.commands.args import budget, output_file

HELP = "plan a saved trace under a memory budget and compare planners in the simulator"


def add_arguments(p):
    p.add_argument("trace", help="trace JSON (from `python -m memsched profile` or Trace.to_json)")
    p.add_argument("--budget", required=True, type=budget,
                   help="device memory budget: bytes, a size like 4GiB, a percentage of keep_all's peak like 50%%, "
                        "or a fraction of the activation memory like 0.5")
    p.add_argument("--planner", default="all", help="a planner name or 'all' (default: all)")
    p.add_argument("--device", default=None,
                   help="device preset (h100-pcie [default], h100-sxm, cpu; aliases h100 and h100-sxm5 for h100-sxm, "
                        "h100-pcie5 for h100-pcie) or a JSON path")
    p.add_argument("--durations", default="auto", choices=["auto", "measured", "roofline"],
                   help="op times: the trace's measured durations or the roofline (default auto: measured only when "
                        "the trace was recorded on the same kind of device as the preset)")
    p.add_argument("--out", default="timeline.png", help="PNG for the best plan's simulated timeline (default timeline.png)")


def run(args):
    import memsched
    from memsched import planning

    try:
        trace = memsched.Trace.from_json(args.trace)
    except memsched.MemschedError as e:
        print(f"memsched plan: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    if not trace.ops:  # every row read "nanx" and a timeline of nothing was written
        print(f"memsched plan: {args.trace}: the trace has no ops; profile a training step first", file=sys.stderr)
        return 2
    error = output_file(args.out, "--out", "timeline.png")  # before the work (Note [Command-line input is checked ...])
    if error is None:
        from memsched._images import image_format
        try:
            image_format(args.out, "--out")
        except ValueError as e:
            error = str(e)
    if error is not None:
        print(f"memsched plan: {error}", file=sys.stderr)
        return 2
    names = "all" if args.planner == "all" else [args.planner]
    if names != "all" and args.planner not in planning.planner_names():
        print(f"memsched plan: unknown planner '{args.planner}'; known: all, {', '.join(planning.planner_names())}",
              file=sys.stderr)
        return 2
    try:
        rows = planning.compare(trace, args.budget, names, device=args.device, durations=args.durations)
    except (ValueError, memsched.MemschedError) as e:
        print(f"memsched plan: {e}", file=sys.stderr)
        return 2
    budget = rows[0]["budget_bytes"]
    device = planning.resolve_device(args.device, trace, args.durations)
    print(f"trace {args.trace}: {len(trace.ops)} ops, {len(trace.tensors)} tensors, keep_all peak "
          f"{memsched.format_bytes(trace.peak_bytes())}, least reachable "
          f"{memsched.format_bytes(memsched._C.least_budget_bytes(trace))}")
    print(f"budget {memsched.format_bytes(budget)} on device '{device.name}' "
          f"({'measured' if device.use_measured_durations else 'roofline'} op times)")
    print(planning.format_table(rows))
    for r in rows:
        if not r["ok"]:
            least = r.get("least_budget_bytes")
            print(f"  {r['planner']}: {r['error']}" +
                  (f" -- {r['planner']} itself needs at least {least} bytes ({memsched.format_bytes(least)})"
                   if least is not None and f"at least {least} bytes" not in r["error"] else ""))
    best = planning.best_row(rows)
    if best is None:
        print("no planner meets this budget", file=sys.stderr)
        return 1
    planning.save_timeline(best["result"], args.out,
                           title=f"{best['planner']} at {memsched.format_bytes(budget)} ({device.name})")
    print(f"best: {best['planner']}; timeline written to {args.out}")
    return 0
