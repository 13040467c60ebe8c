"""`python -m memsched profile` and `python -m memsched demo` in a subprocess:
the JSON loads and matches an in-process profile of the same step; the PNG exists."""
import subprocess
import sys

import memsched
from memsched import models


def run_cli(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "memsched", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_profile_command_writes_trace_matching_in_process_profile(tmp_path):
    out = tmp_path / "trace.json"
    stdout = run_cli("profile", "--model", "mlp", "--batch", "4", "--out", str(out), cwd=tmp_path)
    trace = memsched.Trace.from_json(str(out))
    model = models.build_model("mlp", "small")
    expected = memsched.profile(models.make_step_fn(model, "mlp", 4), model=model)
    assert [o.name for o in trace.ops] == [o.name for o in expected.ops]
    assert trace.activation_bytes() == expected.activation_bytes() > 0
    assert trace.peak_bytes() == expected.peak_bytes()
    assert trace.live_bytes() == expected.live_bytes()
    assert "wrote" in stdout and memsched.format_bytes(trace.peak_bytes()) in stdout


def test_profile_command_rejects_unknown_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memsched", "profile", "--model", "resnet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "invalid choice: 'resnet'" in proc.stderr


def test_demo_command_prints_table_and_writes_png(tmp_path):
    # --no-compare: the side-by-side run is tested in-process (test_offload_compare.py)
    stdout = run_cli("demo", "--out-dir", str(tmp_path / "demo"), "--batch", "2", "--no-compare", cwd=tmp_path)
    assert "plain PyTorch" not in stdout and not (tmp_path / "demo" / "timeline.png").exists()
    png = tmp_path / "demo" / "memory_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = memsched.Trace.from_json(str(tmp_path / "demo" / "trace.json"))
    assert "peak live bytes" in stdout and memsched.format_bytes(trace.peak_bytes()) in stdout
    assert memsched.format_bytes(trace.activation_bytes()) in stdout
    peak = trace.ops[trace.peak_op()]
    assert f"op {peak.id} {peak.name}" in stdout
