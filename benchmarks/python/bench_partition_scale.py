"""S3 on a 100k-op synthetic training step (issue 15: under 60 s on a 2-core machine): 4 simulated
H100 SXM at a cap of 40% of the single-device peak, measured durations of the synthetic trace.

Run: python -m pytest -q benchmarks/python/bench_partition_scale.py -s [--benchmark-json=...]
"""
import memsched
from memsched import _C


def _problem():
    # 25000 layers x 2 forward ops + the loss + their backward mirrors = 100001 ops.
    trace = _C.synthetic_trace(num_layers=25000, ops_per_layer=2, seed=7)
    assert len(trace.ops) >= 100_000
    devices = [memsched.load_device("h100-sxm")] * 4
    return trace, _C.PartitionProblem(trace, devices, [int(0.4 * trace.peak_bytes())] * 4)


def test_s3_partitions_100k_ops_under_60_s(benchmark):
    trace, problem = _problem()
    result = benchmark.pedantic(problem.s3, rounds=1, iterations=1)
    ev = result["eval"]
    print(f"\n{len(trace.ops)} ops, {len(trace.tensors)} tensors: S3 {result['seconds']:.1f} s (winning start "
          f"{result['start']}, {result['num_clusters']} clusters), makespan {ev['makespan_us'] / 1e3:.1f} ms, "
          f"peaks {[memsched.format_bytes(p) for p in ev['peak_bytes']]} under cap "
          f"{memsched.format_bytes(problem.caps[0])}")
    assert result["fits"]
    assert result["seconds"] < 60.0
