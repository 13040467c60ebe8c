"""Argument types and output-path checks shared by the commands.

Note [Command-line input is checked before the work]
  A command can run for minutes (profiling, training, planning), so every
  number is checked by its argparse type (argparse prints "argument --steps:
  ..." with the usage and exits with status 2) and every output path is
  checked before the work starts, never after it: a missing folder on the way
  to an output is created (as demo's --out-dir always was), and a path that
  cannot be written (a folder in its place, a file where a folder should be, no
  permission) is an error naming the option and the path.
"""
import argparse
import math
import os
import tempfile


def int_at_least(least, why="", most=None):
    """argparse type: an int >= least (and <= most, when given)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}{why}, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be <= {most}, got {value}")
        return value
    parse.__name__ = f"int >= {least}"
    return parse


def fraction(text):
    """argparse type: a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] such as 0.5, got {text!r}") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1] such as 0.5, got {text!r}")
    return value


def budget(text):
    """argparse type: a budget as memsched.plan reads it (Note [Budget forms] in planning.py)."""
    from memsched.planning import parse_budget

    try:
        parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_file(path, option, default="out"):
    """Check that `path` can be written (creating missing folders on the way); return an error line or
    None. A file that did not exist is not left behind."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return f"{option} {path}: is a folder; give a file path, e.g. {os.path.join(path, os.path.basename(default))}"
    error = output_dir(os.path.dirname(path) or ".", f"{option} {path}: its folder")
    if error is not None:
        return error
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"{option} {path}: cannot write it ({e.strerror or e}); choose another path"
    if not existed:
        os.remove(path)
    return None


def output_dir(path, option):
    """Create folder `path` if missing and check that it can be written; return an error line or None."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"{option} {path}: cannot create this folder ({e.strerror or e}); choose another path"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{option} {path}: cannot write into this folder ({e.strerror or e}); choose another path"
    return None


def torch_device(text):
    """argparse type: a torch device string that this machine has (cpu, cuda, cuda:1)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; write cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to "
                                             f"cuda:{count - 1}")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: memsched runs on cpu or cuda devices")
    return text
