"""Allocator replay on real traces: the three example model families (transformer, CNN, MLP)
profiled on this machine's CPU at realistic sizes, each step's allocations replayed three ways
(no real memory is touched; addresses are virtual):

  block pool      memsched's caching allocator (512 B rounding, 2/20 MiB segments, best fit
                  with splitting and coalescing: PyTorch's policy), two steps
  plain best fit  the same pool with split_blocks=False: one segment per request size, a
                  cached block reused whole by any request it can hold
  placement       planned placement: fixed offsets in one arena (plan_placement)

For each: peak reserved bytes / peak live bytes (the trace's peak, the lower bound). Prints the
table, saves bench_out/alloc_replay_table.md, asserts placement <= 1.05x. pytest-benchmark times
plan_placement and the replay on each trace.

Run: python -m pytest -q benchmarks/python/bench_alloc_replay.py -s
 or: python benchmarks/python/bench_alloc_replay.py
"""
import os

import pytest

from bench_common import FAMILIES, OUT_DIR, profiled_trace
from memsched import allocator

_ROWS = {}




def measure(family, batch):
    trace = profiled_trace(family, batch)
    live = trace.peak_bytes()
    pool = allocator.replay_trace(trace, split_blocks=True, steps=2)
    plain = allocator.replay_trace(trace, split_blocks=False, steps=2)
    placement = allocator.plan_placement(trace)
    placement.check_invariants(trace)
    assert pool["peak_live_bytes"] == live == plain["peak_live_bytes"]
    return {
        "family": family,
        "batch": batch,
        "tensors": len(trace.tensors),
        "live": live,
        "pool": pool["peak_reserved_bytes"],
        "plain": plain["peak_reserved_bytes"],
        "placement": placement.arena_bytes,
        "pool_segments": pool["stats"]["segment.all.peak"],
        "plain_segments": plain["stats"]["segment.all.peak"],
    }


def table(rows):
    mib = 1 << 20
    lines = [
        "| model (batch) | tensors | peak live | block pool | plain best fit | placement |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        def cell(key):
            return f"{r[key] / mib:.1f} MiB ({r[key] / r['live']:.3f}x)"
        lines.append(f"| {r['family']} ({r['batch']}) | {r['tensors']} | {r['live'] / mib:.1f} MiB | "
                     f"{cell('pool')} | {cell('plain')} | {cell('placement')} |")
    return "\n".join(lines)


def _save(rows):
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "alloc_replay_table.md"), "w") as f:
        f.write(table(rows) + "\n")


@pytest.mark.parametrize("family,batch", FAMILIES)
def test_alloc_replay_table(benchmark, family, batch):
    row = measure(family, batch)
    _ROWS[family] = row
    assert row["placement"] <= 1.05 * row["live"], row
    assert row["pool"] >= row["live"] and row["plain"] >= row["live"]
    trace = profiled_trace(family, batch)
    benchmark.pedantic(allocator.plan_placement, args=(trace,), rounds=5, iterations=1)
    if len(_ROWS) == len(FAMILIES):
        rows = [_ROWS[f] for f, _ in FAMILIES]
        print("\n" + table(rows))
        _save(rows)


@pytest.mark.parametrize("family,batch", FAMILIES)
def test_replay_speed(benchmark, family, batch):
    trace = profiled_trace(family, batch)
    benchmark.pedantic(allocator.replay_trace, args=(trace,), rounds=5, iterations=1)


if __name__ == "__main__":
    rows = [measure(f, b) for f, b in FAMILIES]
    print(table(rows))
    _save(rows)
