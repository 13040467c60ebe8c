"""benchmarks/gpu/peak_snapshot.py (Note [Where a planned step's extra memory was allocated]): the
allocator trace of one step is replayed to its highest allocated count, and the blocks the step
allocated that are live there are summed by where they were allocated. The trace is CUDA-only: here
it is a synthetic one in torch.cuda.memory._snapshot()'s format."""
import subprocess
import sys

import pytest

from gpu_scripts import GPU_DIR, ROOT, load_gpu_script

MiB = 1 << 20


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


TORCH = "/site/torch/nn/modules/linear.py"
MODEL = "/work/model.py"
MEMSCHED = "/work/memsched/offload/executor.py"


def _snapshot():
    ev = []

    def alloc(addr, size, frames=(), stream=0):
        ev.append({"action": "alloc", "addr": addr, "size": size, "stream": stream, "frames": list(frames)})

    def free(addr, size):
        ev.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []})
        ev.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": []})

    free(0x100, 4 * MiB)  # a block from before the recording goes: the count starts 4 MiB down
    alloc(0x1, 8 * MiB, _frames((TORCH, 125, "forward"), (MODEL, 10, "forward")))
    alloc(0x2, 8 * MiB, _frames((TORCH, 125, "forward"), (MODEL, 10, "forward")))
    alloc(0x3, 2 * MiB, _frames((MEMSCHED, 40, "fetch"), (MODEL, 30, "train")), stream=7)
    free(0x1, 8 * MiB)  # before the peak
    alloc(0x4, 16 * MiB)  # backward: the autograd thread, no Python frame
    ev.append({"action": "segment_alloc", "addr": 0x9000, "size": 64 * MiB, "stream": 0, "frames": []})
    alloc(0x5, 1 * MiB, _frames((TORCH, 200, "inner")))  # peak here: 8 + 2 + 16 + 1 - 4 = 23 MiB
    free(0x2, 8 * MiB)
    free(0x5, 1 * MiB)
    alloc(0x6, 3 * MiB, _frames((MODEL, 50, "loss")))  # after the peak: not live there
    return {"segments": [], "device_traces": [[], ev]}


def test_the_peak_is_split_by_where_its_live_blocks_were_allocated():
    ps = load_gpu_script("peak_snapshot")
    s = ps.attribute_peak(_snapshot(), device_index=1, skip_prefixes=("/site/torch",))
    assert s["peak_over_start_bytes"] == 23 * MiB
    assert s["live_at_peak_blocks"] == 4 and s["live_at_peak_bytes"] == 27 * MiB  # 0x2, 0x3, 0x4, 0x5
    where = {w: (b, n) for w, b, n in s["by_where"]}
    assert where == {ps.AUTOGRAD_THREAD: (16 * MiB, 1), "model.py:10 forward": (8 * MiB, 1),
                     "executor.py:40 fetch": (2 * MiB, 1), "torch internals": (1 * MiB, 1)}
    assert [w for w, _, _ in s["by_where"]][0] == ps.AUTOGRAD_THREAD  # largest first
    assert s["by_stream"] == {"0": 25 * MiB, "7": 2 * MiB}
    assert s["by_size"][0] == [16 * MiB, 1, 16 * MiB]
    lines = ps.format_summary("memsched dp 70%", dict(s, allocated_before_bytes=100 * MiB),
                              lambda n: f"{n / MiB:.0f} MiB")
    assert lines[0].startswith("peak snapshot, memsched dp 70%: +23 MiB over the step's start (100 MiB before it)")
    assert any("16 MiB in     1 blocks  " + ps.AUTOGRAD_THREAD in line for line in lines)


def test_an_empty_trace_has_no_peak():
    ps = load_gpu_script("peak_snapshot")
    s = ps.attribute_peak({"segments": [], "device_traces": [[]]}, device_index=0, skip_prefixes=())
    assert s["peak_over_start_bytes"] == 0 and s["live_at_peak_blocks"] == 0 and s["by_where"] == []


def test_bench_offload_refuses_an_unknown_snapshot_row():
    r = subprocess.run([sys.executable, f"{GPU_DIR}/bench_offload.py", "--small", "--device", "cpu",
                        "--methods", "plain", "--peak-snapshot", "memsched dp 71%"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "--peak-snapshot: unknown ['memsched dp 71%']" in r.stderr, r.stderr[-2000:]
