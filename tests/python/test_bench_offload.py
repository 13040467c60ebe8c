"""benchmarks/gpu/bench_offload.py runs end to end on CPU in its reduced size (--small)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "bench_offload.py")


def test_bench_offload_small_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--small", "--device", "cpu", "--steps", "1", "--warmup", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU (not a GPU number)" in proc.stdout
    res = json.loads(out.read_text())
    rows = res["models"]["gpt"]["rows"]
    assert [r["method"] for r in rows] == ["plain", "memsched budget None", "save_on_cpu", "offload_all_prefetch", "checkpoint",
                                           "memsched dp 30%", "memsched dp 50%", "memsched dp 70%",
                                           "memsched greedy 50%", "memsched hybrid 50%", "memsched hybrid 30%",
                                           "torch.compile budget 0.5",
                                           "trl OffloadActivations"]
    by = {r["method"]: r for r in rows}
    for name in ("plain", "memsched budget None", "save_on_cpu", "offload_all_prefetch", "checkpoint", "memsched greedy 50%"):
        assert "error" not in by[name], by[name]
        assert by[name]["step_ms"] > 0
    assert by["plain"]["bytes_moved"] == 0 and by["checkpoint"]["bytes_moved"] == 0
    # save_on_cpu moves every saved tensor (weights included) out and back; offload-all moves the
    # activations both ways.
    assert by["save_on_cpu"]["bytes_moved"] > by["offload_all_prefetch"]["bytes_moved"] > 0
    assert by["offload_all_prefetch"]["plain_steps"] == 0
    # issue 10's overhead row: optimize(budget=None) keeps everything on a device the step fits (CPU: always)
    none = by["memsched budget None"]
    assert none["budget_bytes"] is None and none["offloaded"] == 0 and none["bytes_moved"] == 0, none
    # A dp row either ran or says which budget it needs (the planner's infeasible-budget error).
    for name in ("memsched dp 30%", "memsched dp 50%", "memsched dp 70%"):
        assert "step_ms" in by[name] or "needs at least" in by[name]["error"], by[name]
    # What users pick instead: on CPU the compile row is skipped (inductor is slow there) and TRL's offloader
    # is skipped (accelerator tensors only; or no wheel carried) -- each with a message, never silently.
    assert "compile" in by["torch.compile budget 0.5"]["skipped"]
    assert "TRL" in by["trl OffloadActivations"]["skipped"]
    greedy = by["memsched greedy 50%"]
    assert greedy["offloaded"] > 0 and greedy["bytes_moved"] > 0
    assert greedy["sim_peak_bytes"] <= greedy["budget_bytes"]
    # the memory guard's waits are a column (on CPU copies hold nothing: it never waits)
    assert greedy["guard_waits"] == 0 and "guard waits" in proc.stdout
    # issue 11's keep_all figure comes from a memsched row's trace (set against plain's measured peak on a GPU)
    assert greedy["keep_all_sim_peak_bytes"] > greedy["sim_peak_bytes"] and greedy["unmodeled_bytes"] == 0
    # ResNet-50 is measured when torchvision is installed, otherwise skipped with a message.
    try:
        import torchvision  # noqa: F401
        assert res["models"]["resnet"]["rows"]
    except ImportError:
        assert "skipped" in res["models"]["resnet"]


def test_fraction_device_index_is_an_int():
    """set_per_process_memory_fraction needs an index: torch.device("cuda") has none (the GPU run crashed)."""
    import torch

    from gpu_scripts import load_gpu_script

    bench_offload = load_gpu_script("bench_offload")
    assert bench_offload._fraction_device(torch.device("cuda", 3)) == 3
    if torch.cuda.is_available():
        assert isinstance(bench_offload._fraction_device(torch.device("cuda")), int)


def test_rows_over_their_plan_print_the_gap_by_category():
    """Note [Where the peak went]: the GPU run's table says where a memsched row's extra memory went."""
    from gpu_scripts import load_gpu_script

    bench_offload = load_gpu_script("bench_offload")
    gib = 1 << 30
    rows = [{"method": "plain"},
            {"method": "memsched dp 50%", "peak_phase": "backward",
             "peak_gap": {"planned_bytes": 9 * gib, "measured_bytes": 12 * gib, "fragmentation_bytes": gib // 2,
                          "categories": {"late release": 2 * gib, "not in the profiled step": gib}}},
            {"method": "memsched dp 70%", "peak_phase": "forward",
             "peak_gap": {"planned_bytes": 9 * gib, "measured_bytes": 9 * gib, "fragmentation_bytes": None,
                          "categories": {}}}]
    lines = bench_offload.format_gaps(rows)
    assert len(lines) == 1, lines
    assert lines[0].startswith("peak gap, memsched dp 50%: +3.00 GiB over the plan's 9.00 GiB (peak in the backward)")
    assert "late release 2.00 GiB" in lines[0] and "not in the profiled step 1.00 GiB" in lines[0]
    assert "reserved beyond allocated 512.00 MiB" in lines[0]


def test_the_least_plan_is_set_against_checkpoints_peak():
    from gpu_scripts import load_gpu_script

    bench_offload = load_gpu_script("bench_offload")
    gib = 1 << 30
    assert bench_offload.floor_line([{"method": "plain", "peak_bytes": 16 * gib}]) is None
    line = bench_offload.floor_line([{"method": "checkpoint", "peak_bytes": 10 * gib},
                                     {"method": "memsched dp 50%", "least_plan_bytes": 9 * gib}])
    assert line.startswith("least budget any plan reaches (memsched dp 50%'s trace): 9.00 GiB, 0.900x per-block")
