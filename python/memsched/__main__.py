"""python -m memsched <command>: the command line.

Each command is a module in memsched/commands/ with `add_arguments(parser)`,
`run(args) -> int` and a one-line `HELP`; COMMANDS lists them in help order.
"""
import argparse
import importlib
import sys

COMMANDS = ["demo", "profile", "plan", "partition"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m memsched", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"memsched.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"memsched.commands.{name}":
                raise
            continue  # command not built yet
        modules[name] = module
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args) or 0
    except MemoryError as e:  # the CPU allocator's failure, or torch.OutOfMemoryError on a GPU
        return _out_of_memory(args, e)
    except RuntimeError as e:
        if "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
            return _out_of_memory(args, e)
        raise


def _out_of_memory(args, err):
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    batch = getattr(args, "batch", None)
    fix = f"; lower --batch (it is {batch})" if batch is not None else ""
    print(f"python -m memsched {args.command}: out of memory ({first}){fix}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
