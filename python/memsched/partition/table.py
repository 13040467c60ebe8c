"""The methods table: one row per partitioning method, side by side.

Entry point: format_table(rows) -> str (rows from memsched.partition.compare).
"""
from memsched.units import format_bytes


def best_row(rows):
    """The fitting row with the least makespan (None when none fits)."""
    ok = [r for r in rows if r["ok"]]
    return min(ok, key=lambda r: r["partition"].makespan_us) if ok else None


def format_table(rows):
    best = best_row(rows)
    base = best["partition"].makespan_us if best else None
    header = ("method", "makespan ms", "vs best", "max peak", "per-device peak", "bytes moved", "transfers",
              "fits", "time s")
    lines = []
    for r in rows:
        p = r["partition"]
        if p is None:
            lines.append((r["method"], "-", "-", "-", r["error"], "-", "-", "-", f"{r['seconds']:.2f}"))
            continue
        peaks = " ".join(format_bytes(x).replace(" ", "") for x in p.peak_bytes)
        lines.append((r["method"], f"{p.makespan_us / 1e3:.3f}",
                      f"{p.makespan_us / base:.3f}x" if base else "-", format_bytes(max(p.peak_bytes)), peaks,
                      format_bytes(p.bytes_moved), str(len(p.transfers)), "yes" if p.fits else "NO (breaks a cap)",
                      f"{p.seconds:.2f}"))
    widths = [max(len(h), *(len(l[k]) for l in lines)) for k, h in enumerate(header)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines])
