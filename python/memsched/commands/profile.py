"""python -m memsched profile: profile one step of a built-in example model and
write its Trace as JSON (memsched.models, memsched.profile)."""
import argparse
import sys

from memsched.commands.args import int_at_least, output_file, torch_device

HELP = "profile one training step of a built-in example model and write its Trace as JSON"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from memsched.models import MODEL_NAMES, SIZES

    parser.add_argument("--model", choices=MODEL_NAMES, default="transformer", help="example model (default transformer)")
    parser.add_argument("--size", choices=SIZES, default="small", help="model size (default small)")
    parser.add_argument("--batch", type=int_at_least(1, most=100_000), default=8, help="batch size (default 8)")
    parser.add_argument("--device", type=torch_device, default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    parser.add_argument("--optimizer", choices=("none", "sgd", "adam"), default="none",
                        help="also profile an optimizer step (default none)")
    parser.add_argument("--warmup", type=int_at_least(0, most=1000), default=1,
                        help="plain steps before the profiled one, to keep one-time setup out of op times (default 1)")
    parser.add_argument("--out", default="trace.json", help="where to write the trace (default trace.json)")


def _not_an_image(path):
    """A trace is JSON: an image extension (the timeline `plan --out` draws) is a mix-up, refused before
    the work rather than writing JSON into a .png."""
    import os

    from memsched._images import SUPPORTED
    ext = os.path.splitext(path)[1][1:].lower()
    if ext in SUPPORTED:
        return (f"--out {path}: the trace is JSON, not a '.{ext}' image; give a .json path (the timeline image "
                f"comes from `python -m memsched plan TRACE.json --budget ... --out timeline.{ext}`)")
    return None


def run(args) -> int:
    import torch

    import memsched
    from memsched import models

    error = output_file(args.out, "--out", "trace.json")  # before the work (Note [Command-line input is checked ...])
    if error is None:
        error = _not_an_image(args.out)
    if error is not None:
        print(f"memsched profile: {error}", file=sys.stderr)
        return 2
    model = models.build_model(args.model, args.size, device=args.device)
    step = models.make_step_fn(model, args.model, args.batch, args.size, device=args.device)
    optimizer = None
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    elif args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(args.warmup):
        step()  # no optimizer step: the profiled step starts from the same weights
    trace = memsched.profile(step, model=model, optimizer=optimizer)
    trace.to_json(args.out)
    peak_op = trace.ops[trace.peak_op()] if trace.ops else None
    where = f" at op {peak_op.id} ({peak_op.name}, {peak_op.phase}, '{peak_op.module_path}')" if peak_op else ""
    print(f"{args.model} ({args.size}, batch {args.batch}, {trace.device}): {len(trace.ops)} ops, "
          f"{len(trace.tensors)} tensors, activations {memsched.format_bytes(trace.activation_bytes())}, "
          f"peak {memsched.format_bytes(trace.peak_bytes())}{where}")
    print(f"wrote {args.out}")
    return 0
