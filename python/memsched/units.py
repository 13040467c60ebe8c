"""Byte quantities as users write them: 6GiB, 512MiB, 1.5GB, 4096."""
import math
import numbers
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


MAX_BYTES = 2**63 - 1   # the largest byte count the core's int64 fields hold


def parse_bytes(value, *, name="budget"):
    """Return a byte count from an int, a whole-valued float or a string such as "6GiB".

    Raises ValueError naming `name`, the accepted forms and the range [0, 2**63 - 1] on anything
    else (NaN, infinities, fractions of a byte, counts that do not fit an int64).
    """
    forms = ("write bytes (4096) or a number with a unit: B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, "
             "TiB or K, M, G, T (powers of 1024; e.g. '6GiB')")
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte count, got {value!r}; {forms}")
    if isinstance(value, numbers.Integral):
        result = int(value)
    elif isinstance(value, numbers.Real):
        value_f = float(value)
        if not math.isfinite(value_f):
            raise ValueError(f"{name}: {value!r} is not a byte count; {forms}")
        if value_f != int(value_f):
            raise ValueError(f"{name}: {value!r} is not a whole number of bytes; {forms}")
        result = int(value_f)
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).lower() if m else None
        if not m and _PATTERN.match(value.strip().removeprefix("-")):
            raise ValueError(f"{name}: must not be negative, got {value!r}")
        if not m or unit not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; {forms}")
        text = m.group(1)
        number = int(text) if text.isdigit() else float(text)  # digits only: exact, also near 2**63
        if not math.isfinite(number) or number * _UNITS[unit] > MAX_BYTES:
            raise ValueError(f"{name}: {value!r} is out of range; a size must be at most 2**63 - 1 bytes "
                             f"(8 EiB)")
        if _UNITS[unit] == 1 and number != int(number):  # "0.5" read as 0 bytes, where 0.5 may mean a fraction
            raise ValueError(f"{name}: {value!r} is not a whole number of bytes; {forms}")
        result = int(number * _UNITS[unit])
    else:
        raise ValueError(f"{name}: expected bytes or a string like '6GiB', got {type(value).__name__}")
    if result < 0:
        raise ValueError(f"{name}: must not be negative, got {value!r}")
    if result > MAX_BYTES:
        raise ValueError(f"{name}: {value!r} is out of range; a byte count must be in [0, 2**63 - 1] "
                         f"(8 EiB)")
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


def format_bytes_up(n):
    """A size in binary units rounded up to two decimals, so that passing it back as a size is at
    least n bytes (format_bytes rounds to nearest: 3,729,600 bytes -> '3.56 MiB' = 3,732,930 read back
    is fine, but 3,725,000 -> '3.55 MiB' would read back as 3,722,445)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{math.ceil(100 * n / scale) / 100:.2f} {unit}"
    return f"{n} B"
