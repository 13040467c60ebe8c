"""Byte quantities as users write them: 6GiB, 512MiB, 1.5GB, 4096."""
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, *, name="budget"):
    """Return a byte count from an int, a float or a string such as "6GiB".

    Raises ValueError naming `name` and the accepted forms on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte count, got {value!r}")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float):
        result = int(value)
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(
                f"{name}: cannot read {value!r} as a size; write bytes (4096) or a number "
                f"with a unit: B, KB, MB, GB, KiB, MiB, GiB (e.g. '6GiB')")
        result = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{name}: expected bytes or a string like '6GiB', got {type(value).__name__}")
    if result < 0:
        raise ValueError(f"{name}: must not be negative, got {value!r}")
    return result


def format_bytes(n):
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"
