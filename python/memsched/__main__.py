"""python -m memsched <command>: the command line.

Each command is a module in memsched/commands/ with `add_arguments(parser)`,
`run(args) -> int` and a one-line `HELP`; COMMANDS lists them in help order.
"""
import argparse
import importlib
import sys

COMMANDS = ["demo", "profile", "plan"]


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
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
