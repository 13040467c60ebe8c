"""benchmarks/gpu/gpu_check.py: the one-command GPU table. Its CPU smoke mode runs here; a failing part is
recorded with its log tail and the run goes on."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gpu_scripts import load_gpu_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "gpu_check.py")


def _load():
    return load_gpu_script("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke mode")
def test_cpu_smoke_writes_one_markdown_and_one_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--parts", "ooo,allocator,trainer", "--budget", "240",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["environment"]["torch"] == torch.__version__
    assert report["parts"]["env"]["status"] == "ok"
    assert report["parts"]["ooo"]["status"] == "ok"
    assert report["results"]["ooo"]["models"]
    assert report["parts"]["allocator"]["status"] == "skipped"  # needs CUDA; says so
    if report["parts"]["trainer"]["status"] == "ok" and report["results"]["trainer"]["rows"]:
        rows = {r["row"]: r for r in report["results"]["trainer"]["rows"]}
        assert set(rows) == {"plain", "checkpointing", "memsched-dp-50%", "memsched-hybrid-50%"}
        assert all("median_ms" in r for r in rows.values()), rows
        assert rows["memsched-dp-50%"]["steps_planned"] >= 1 and rows["memsched-dp-50%"]["mismatches"] == 0
    ooo_rows = next(iter(report["results"]["ooo"]["models"].values()))
    assert "optim_in_bwd" in ooo_rows  # issue 13's comparison row runs in the reduced CPU mode
    # a CPU run judges no GPU criterion
    assert {v["issue"] for v in report["verdicts"]} == {10, 11, 12, 13, 14, 17}
    assert all(v["verdict"] == "not measured (CPU run)" for v in report["verdicts"]), report["verdicts"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Done when" in md and "not measured (CPU run)" in md and "| met |" not in md
    assert "## bench_ooo_gpu.py" in md and "## bench_trainer_gpu.py" in md and report["tree"]["digest"] in md


def test_the_stress_part_runs_only_when_named(tmp_path):
    """The 1M-operation allocator stress run takes minutes: it is no default part, --parts names it."""
    gc = _load()
    assert "stress" not in gc.WEIGHTS and "stress" in gc.ALL_WEIGHTS
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--parts", "stress", "--budget", "60",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["parts"]) == ["env", "stress"]
    assert report["parts"]["stress"]["status"] == "skipped" and "CUDA" in report["parts"]["stress"]["note"]


def test_failed_part_shows_its_log_tail():
    gc = _load()
    report = {"mode": "gpu", "environment": {"cuda_available": False, "torch": "x"}, "tree": {"digest": "d", "git": None},
              "started": "now", "wall_s": 1.0, "budget_s": 500,
              "parts": {"build": {"status": "failed (rc 1)", "wall_s": 3.0, "timeout_s": 100,
                                  "log_tail": ["cmake ...", "CMake Error: nlohmann/json.hpp not found"]}},
              "results": {}}
    md = gc.render_md(report)
    assert "failed (rc 1)" in md and "CMake Error: nlohmann/json.hpp not found" in md


def test_runner_kills_at_timeout(tmp_path):
    gc = _load()
    with open(tmp_path / "log", "w") as log:
        r = gc.Runner(log, dict(os.environ))("t", [sys.executable, "-c", "import time; print('hi', flush=True); "
                                                                            "time.sleep(60)"], 2)
    assert r["timed_out"] and r["tail"] == ["hi"] and r["wall_s"] < 30
