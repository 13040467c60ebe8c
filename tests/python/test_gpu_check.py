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
    # ooo's share of 400 s is ~70 s: its CPU run takes 8 s here, and 40 s on a loaded machine
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--parts", "ooo,allocator,trainer", "--budget", "400",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=480, env=env)
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


# -- Note [CUDA tests that crash] and rows that crash ------------------------------------------------
_FAKE_INI = "[pytest]\nmarkers =\n    requires_cuda: needs a CUDA device\n"
_FAKE_TESTS = {
    "test_a.py": "import pytest\npytestmark = pytest.mark.requires_cuda\n\n\ndef test_one():\n    pass\n",
    # test_f2 comes after the crash and its node id starts with test_f's: pytest's --deselect (prefixes)
    # would drop it with test_f; the recorder deselects by exact node id
    "test_b.py": ("import os\nimport signal\n\nimport pytest\n\n\n@pytest.mark.requires_cuda\ndef test_f():\n    pass\n\n\n"
                  "@pytest.mark.requires_cuda\ndef test_segfault():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\n\n"
                  "@pytest.mark.requires_cuda\ndef test_f2():\n    pass\n\n\ndef test_not_selected():\n    pass\n"),
    "test_c.py": ("import os\nimport signal\n\nimport pytest\n\npytestmark = pytest.mark.requires_cuda\n\n\n"
                  "def test_fails():\n    assert 1 == 2, 'one is not two'\n\n\ndef test_skips():\n    pytest.skip('why not')\n\n\n"
                  "def test_crashes_again():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\n\n"
                  "@pytest.mark.parametrize('x', [0.7, 'a b'])\ndef test_after(x):\n    pass\n"),
}


def _fake_tests(tmp_path, files):
    d = tmp_path / "fake_tests"
    d.mkdir()
    (d / "pytest.ini").write_text(_FAKE_INI)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def _run_tests_part(tmp_path, targets, timeout):
    gc = _load()
    work = tmp_path / "work"
    work.mkdir()
    with open(tmp_path / "log", "w") as log:
        return gc.run_pytest_part(gc.Runner(log, dict(os.environ)), "cuda_tests", sys.executable, [str(targets)],
                                  timeout, str(work))


def test_a_test_that_crashes_its_process_costs_that_test_only(tmp_path):
    """A segfault in one test (the H100 run lost every result to one in test_recompute.py): the crashed test
    is recorded with its innermost Python frame, and the tests after it (in its file and the next) still run
    and count, as do the ones before it."""
    res, part = _run_tests_part(tmp_path, _fake_tests(tmp_path, _FAKE_TESTS), 120)
    assert res["outcomes"] == {
        "test_a::test_one": "passed", "test_b::test_f": "passed", "test_b::test_segfault": "crashed",
        "test_b::test_f2": "passed", "test_c::test_fails": "failed", "test_c::test_skips": "skipped",
        "test_c::test_crashes_again": "crashed", "test_c::test_after[0.7]": "passed", "test_c::test_after[a b]": "passed"}
    assert (res["tests"], res["passed"], res["failed"], res["skipped"], res["crashed"], res["not_run"]) == (9, 5, 1, 1, 2, 0)
    assert [c["test"] for c in res["crashes"]] == ["test_b::test_segfault", "test_c::test_crashes_again"]
    assert res["crashes"][0]["frame"].endswith("test_b.py:14 in test_segfault"), res["crashes"]
    assert res["crashes"][0]["rc"] == -11
    crashed = next(f for f in res["failures"] if f["test"] == "test_b::test_segfault")
    assert crashed["kind"] == "crashed" and "SIGSEGV" in crashed["message"] and "in the test's call" in crashed["message"]
    assert "one is not two" in next(f for f in res["failures"] if f["test"] == "test_c::test_fails")["message"]
    assert [p["rc"] for p in res["processes"]] == [-11, -11, 0]  # a new process after each crash
    assert part["status"] == "failed (1 failed, 2 crashed)"
    gc = _load()
    md = gc.tests_md(res)
    assert "2 crashed" in md and "test_b.py:14 in test_segfault" in md and "3 pytest processes" in md



_PLANS_THEN_CRASHES = (
    "import os\nimport signal\n\nimport pytest\n\nimport memsched\n\n\n@pytest.mark.requires_cuda\n"
    "def test_plans_then_crashes():\n"
    "    trace = memsched._C.synthetic_trace(num_layers=6, ops_per_layer=2, seed=1)\n"
    "    memsched.plan(trace, budget='70%', planner='dp')\n"
    "    memsched.plan(trace, budget='60%', planner='hybrid')\n"
    "    os.kill(os.getpid(), signal.SIGSEGV)\n\n\n"
    "@pytest.mark.requires_cuda\ndef test_plans_and_passes():\n"
    "    memsched.plan(memsched._C.synthetic_trace(num_layers=4, ops_per_layer=2, seed=2), budget='80%')\n")


def test_a_crashed_process_brings_back_the_planning_input_it_had_in_flight(tmp_path):
    """Note [A crash's planning input comes back]: the H100's planner segfault did not reproduce on any CPU
    trace. The newest plan() input of a process that died of a signal is kept (the hybrid call here), packed
    into crash_inputs.tar.gz, and replays; a process that ended normally keeps nothing. Without cuda-gdb
    the crash record says so (Note [A crash's C++ frames])."""
    import shutil
    import tarfile
    gc = _load()
    work = tmp_path / "work"
    work.mkdir()
    targets = _fake_tests(tmp_path, {"test_p.py": _PLANS_THEN_CRASHES})
    with open(tmp_path / "log", "w") as log:
        run = gc.Runner(log, dict(os.environ), dump_root=str(work / "plan_dumps"))
        res, _ = gc.run_pytest_part(run, "cuda_tests", sys.executable, [str(targets)], 120, str(work))
    assert res["outcomes"] == {"test_p::test_plans_then_crashes": "crashed", "test_p::test_plans_and_passes": "passed"}
    crash = res["crashes"][0]
    assert crash["input"] and crash["input"].endswith(".json"), crash
    if shutil.which("cuda-gdb") is None:
        assert crash["backtrace"] == ["no backtrace: cuda-gdb is not on PATH"]
    out = tmp_path / "out"
    out.mkdir()
    assert gc.pack_crash_inputs(run.dump_root, str(out)) == "crash_inputs.tar.gz"
    with tarfile.open(out / "crash_inputs.tar.gz") as tar:
        tar.extractall(tmp_path / "x")
    specs = sorted((tmp_path / "x" / "crash_inputs").glob("*/plan-*[0-9].json"))
    assert len(specs) == 1, specs  # the crashed process's newest call; the passing one kept nothing
    spec = json.loads(specs[0].read_text())
    assert spec["planner"] == "hybrid"
    from memsched import planning
    plan = planning.replay_planning_input(str(specs[0]))
    assert plan.planner == "hybrid" and plan.budget_bytes == spec["budget_bytes"]
    assert not any((work / "plan_dumps" / "all").iterdir()) if (work / "plan_dumps" / "all").exists() else True
    assert "planning input in flight" in gc.tests_md(res)

def test_a_test_running_when_the_time_ends_is_not_run_and_the_ones_before_it_are_kept(tmp_path):
    slow = "import time\n\nimport pytest\n\n\n@pytest.mark.requires_cuda\ndef test_slow():\n    time.sleep(120)\n"
    d = _fake_tests(tmp_path, {"test_a.py": _FAKE_TESTS["test_a.py"], "test_b.py": slow,
                               "test_c.py": "import pytest\n\n\n@pytest.mark.requires_cuda\ndef test_later():\n    pass\n"})
    res, part = _run_tests_part(tmp_path, d, 15)
    assert res["outcomes"] == {"test_a::test_one": "passed", "test_b::test_slow": "not run", "test_c::test_later": "not run"}
    assert "test_b::test_slow ran" in res["not_run_why"]
    assert part["status"].startswith("timeout after 15 s")


def test_the_recorded_crash_names_the_frame_faulthandler_printed():
    """The frame from the H100 run's log (faulthandler under pytest -v), and pytest-timeout's stack dump."""
    gc = _load()
    tail = ["tests/python/offload/test_recompute.py::test_cuda_recompute_is_bitwise_and_never_waits_for_the_gpu "
            "Fatal Python error: Segmentation fault", "", "Thread 0x00007fd03bd0a6c0 (most recent call first):",
            "  <no Python frame>", "", "Current thread 0x00007fd3eab50140 (most recent call first):",
            f'  File "{gc.ROOT}/python/memsched/planning.py", line 262 in plan',
            f'  File "{gc.ROOT}/python/memsched/optimize.py", line 293 in make_plan', "", "Extension modules: numpy"]
    assert gc.crash_frame(tail) == "python/memsched/planning.py:262 in plan"
    assert gc.crash_summary(tail, -11) == ("Fatal Python error: Segmentation fault; rc -11, SIGSEGV in "
                                           "python/memsched/planning.py:262 in plan")
    hung = ["+++++++++++++++++++++++++++++++++++ Timeout +++++++++++++++++++++++++++++++++++",
            "~~~~~~~~~~~~~~~~~~~~~ Stack of MainThread (140) ~~~~~~~~~~~~~~~~~~~~~",
            '  File "/x/_pytest/runner.py", line 1, in run', '  File "/x/tests/test_q.py", line 9, in test_wait',
            "    torch.cuda.synchronize()", "+++++++++++++++++++++++++++++++++++ Timeout +++++++++++++++++++++++++++++++++++"]
    assert gc.crash_frame(hung) == "/x/tests/test_q.py:9 in test_wait"
    assert gc.crash_summary(hung, 1) == "rc 1, ended by pytest-timeout in /x/tests/test_q.py:9 in test_wait"


_FAKE_BENCH = """import argparse, json, os, signal
p = argparse.ArgumentParser()
p.add_argument("--rows")
p.add_argument("--out")
p.add_argument("--time-budget")
a = p.parse_args()
res = {"rows": []}
for row in a.rows.split(","):
    if row == "boom":
        os.kill(os.getpid(), signal.SIGSEGV)
    res["rows"].append({"row": row, "median_ms": 1.0})
    json.dump(res, open(a.out, "w"))
"""


def _run_rows_part(tmp_path, rows, timeout=60, min_restart_s=20.0):
    gc = _load()
    script = tmp_path / "bench.py"
    script.write_text(_FAKE_BENCH)
    with open(tmp_path / "log", "w") as log:
        return gc.run_resumable(
            gc.Runner(log, dict(os.environ, PYTHONFAULTHANDLER="1")), "trainer", rows,
            lambda todo, out, left: [sys.executable, str(script), "--rows", ",".join(todo), "--out", out,
                                     "--time-budget", f"{left:.0f}"],
            str(tmp_path / "trainer.json"), lambda r: r.setdefault("rows", []), "row", timeout,
            empty=lambda: {"rows": []}, min_restart_s=min_restart_s)


def test_a_benchmark_row_that_crashes_costs_that_row_only(tmp_path):
    res, part = _run_rows_part(tmp_path, ["plain", "boom", "checkpointing", "boom2"])
    assert [r["row"] for r in res["rows"]] == ["plain", "boom", "checkpointing", "boom2"]
    assert "error" in res["rows"][1] and "SIGSEGV" in res["rows"][1]["error"], res["rows"][1]
    assert "bench.py:10 in <module>" in res["rows"][1]["error"]
    assert all("median_ms" in r for i, r in enumerate(res["rows"]) if i != 1)
    assert part["status"] == "failed (rc -11, SIGSEGV in row 'boom')" and len(part["commands"]) == 2
    # a crash in the first row, before any JSON, and nothing left to run after the last
    res, part = _run_rows_part(tmp_path, ["boom"])
    assert res["rows"][0]["row"] == "boom" and "crashed" in res["rows"][0]["error"]
    # with too little of the part's time left to start again, the rows after the crash are recorded as skipped
    res, part = _run_rows_part(tmp_path, ["plain", "boom", "checkpointing"], min_restart_s=1000)
    assert [r["row"] for r in res["rows"]] == ["plain", "boom", "checkpointing"]
    assert "crashed" in res["rows"][2]["skipped"] and len(part["commands"]) == 1


def test_offload_rows_come_in_the_order_the_issues_ask_and_torch_compile_only_where_it_fits():
    """The H100 run spent its offload budgets on torch.compile (57 s) and the slow peers before the hybrid
    rows (issue 12); every bench_offload row is still asked for."""
    gc = _load()
    order = gc.OFFLOAD_ORDER
    assert order[:6] == ["plain", "memsched budget None", "memsched dp 70%", "checkpoint", "memsched hybrid 50%",
                         "memsched hybrid 30%"]
    slow = ("offload_all_prefetch", "trl OffloadActivations", "save_on_cpu", gc.COMPILE_ROW)
    assert all(order.index(m) > order.index("memsched dp 50%") for m in slow) and order[-1] == gc.COMPILE_ROW
    bench = load_gpu_script("bench_offload")
    assert sorted(order) == sorted(bench.METHODS)
    methods, dropped = gc.offload_methods("gpt", 55)  # about the default budget's share
    assert gc.COMPILE_ROW not in methods and dropped[0][0] == gc.COMPILE_ROW and "~57 s" in dropped[0][1]
    assert gc.offload_methods("gpt", 300) == (order, [])


def test_the_default_budget_leaves_the_build_its_measured_time():
    """With the H100 run's env time (18 s), the build's share of the default budget holds its 69 s."""
    gc = _load()
    left = gc.DEFAULT_BUDGET_S - 18
    assert left * gc.WEIGHTS["build"] / sum(gc.WEIGHTS.values()) > 69 + 5
    assert list(gc.WEIGHTS)[:2] == ["build", "cuda_tests"]


def test_the_allocator_bench_under_a_time_budget_measures_round_0_of_every_family_first(monkeypatch, tmp_path):
    """Note [Allocator bench time budget]: its workers take ~10 s each on the H100, and the first run's
    84 s went to one family's rounds. With --time-budget the step rounds come round-major, then the replay;
    a worker that would not fit is not started and a failed one is recorded, the others run."""
    bench = load_gpu_script("bench_allocator_gpu")
    clock, calls = [0.0], []

    def fake_run(mode, part, family, args, timeout=1800):
        calls.append((mode, part, family))
        clock[0] += 10.0
        if (mode, part, family) == ("memsched", "step", "cnn"):
            raise RuntimeError("memsched step cnn failed (rc -11):\nFatal Python error: Segmentation fault")
        if part == "replay":
            return {"live": 100, "reserved": 150, "allocated": 120, "us_per_alloc": 5.0}
        return {"median_ms": 10.0 if mode == "native" else 10.1, "min_ms": 9.0, "max_ms": 11.0, "reserved": 200,
                "allocated": 150}

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "time", type("T", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the workers are faked: no GPU is touched
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "fake")
    out = tmp_path / "a.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(out), "--rounds", "2", "--time-budget", "65"])
    bench.main()
    assert calls == [("native", "step", "transformer"), ("memsched", "step", "transformer"), ("native", "step", "cnn"),
                     ("memsched", "step", "cnn"), ("native", "step", "mlp"), ("memsched", "step", "mlp")]
    res = json.loads(out.read_text())
    assert sorted(res["step_ratio"]) == ["mlp", "transformer"] and res["step_ratio"]["mlp"]["rounds"] == 1
    assert len(res["errors"]) == 1 and "Segmentation fault" in res["errors"][0]
    assert "memsched step transformer: time budget (65 s)" in res["skipped"] and len(res["skipped"]) == 6 + 6
    gc = _load()
    rep = {"mode": "gpu", "environment": {"cuda_available": True}, "parts": {"allocator": {"status": "ok"}},
           "results": {"allocator": res}}
    v = next(x for x in gc.verdicts(rep) if x["criterion"].startswith("whole-step time"))
    assert v["verdict"].startswith("not measured: cnn: no paired native/memsched step round"), v
    assert "1.010x" in v["measured"] and "over 1 rounds" in v["measured"]
