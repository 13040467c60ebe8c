"""The exact MILP against brute force, and S3 against the MILP on small random graphs: within 10% of
the optimum on average, never over a cap (Note [Partition MILP], Note [S3 partitioner])."""
import itertools
import math

import pytest

pytest.importorskip("scipy")

from memsched import _C  # noqa: E402
from memsched.partition.milp import milp_partition  # noqa: E402


def _device(name="test"):
    d = _C.DeviceModel()
    d.name = name
    return d


def _problem(seed, layers, devices, cap_share, bw=2.0, latency=1.0):
    t = _C.synthetic_trace(num_layers=layers, ops_per_layer=1, min_bytes=1000, max_bytes=8000, min_op_us=1.0,
                           max_op_us=10.0, skip_probability=0.5, seed=seed)
    cap = int(cap_share * t.peak_bytes())
    return _C.PartitionProblem(t, [_device() for _ in range(devices)], [cap] * devices, link_bw_gbps=bw,
                               link_latency_us=latency)


def _brute_force(problem):
    best = math.inf
    for a in itertools.product(range(problem.num_devices), repeat=problem.num_ops):
        ev = problem.evaluate(list(a))
        if ev["fits"]:
            best = min(best, ev["makespan_us"])
    return best


@pytest.mark.parametrize("seed", range(1, 7))
def test_milp_equals_brute_force(seed):
    problem = _problem(seed, layers=3, devices=2, cap_share=0.7)  # 7 ops: 128 placements
    optimum = _brute_force(problem)
    out = milp_partition(problem, time_limit_s=60)
    if math.isinf(optimum):
        assert out is None
        return
    device_of_op, objective, proven = out
    assert proven
    ev = problem.evaluate(device_of_op)
    assert ev["fits"]
    assert ev["makespan_us"] == pytest.approx(optimum, rel=1e-6)
    assert objective == pytest.approx(optimum, rel=1e-6)


def test_s3_within_ten_percent_of_milp_on_average_and_never_over_a_cap():
    ratios = []
    for seed in range(1, 13):
        for devices, cap_share, bw in ((2, 0.7, 2.0), (3, 0.6, 10.0), (3, 1.0, 10.0)):
            problem = _problem(seed, layers=5, devices=devices, cap_share=cap_share, bw=bw, latency=0.5)  # 11 ops
            out = milp_partition(problem, time_limit_s=60)
            s3 = problem.s3()
            if out is None:
                assert not s3["fits"]
                continue
            assert s3["fits"], f"seed {seed}: the MILP fits and S3 does not"
            ev = s3["eval"]
            assert all(p <= c for p, c in zip(ev["peak_bytes"], problem.caps))
            optimum = problem.evaluate(out[0])["makespan_us"]
            assert ev["makespan_us"] >= optimum * (1 - 1e-9)  # the MILP is a true optimum of the same model
            ratios.append(ev["makespan_us"] / optimum)
    assert len(ratios) >= 24
    mean = sum(ratios) / len(ratios)
    print(f"S3 / MILP makespan over {len(ratios)} graphs: mean {mean:.4f}, max {max(ratios):.4f}")
    assert mean <= 1.10
