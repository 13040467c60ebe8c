"""benchmarks/gpu/bench_copy_engine.py runs end to end on CPU in its reduced size (--small)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "bench_copy_engine.py")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env)


def test_bench_copy_engine_small_runs_on_cpu(tmp_path):
    out = tmp_path / "copy.json"
    proc = _run("--small", "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU (not a GPU number)" in proc.stdout
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"memsched d2h", "memsched h2d", "memsched both", "torch d2h", "torch h2d"}
    assert res["bytes_per_direction"] == 4 << 20 and res["gpu"] is None
    for name, row in res["rows"].items():
        assert len(row["gbps_rounds"]) == 2 and row["gbps_median"] > 0, name
    for d in ("d2h", "h2d"):  # the ratio to the peer, measured in the same rounds
        row = res["rows"][f"memsched {d}"]
        assert row["vs_torch"] == row["gbps_median"] / res["rows"][f"torch {d}"]["gbps_median"]
    assert "x torch's)" in proc.stdout


def test_bench_copy_engine_refuses_a_zero_size():
    proc = _run("--device", "cpu", "--mib", "0")
    assert proc.returncode == 2 and "--mib must be at least 1, got 0" in proc.stderr
