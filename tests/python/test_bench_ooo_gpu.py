"""benchmarks/gpu/bench_ooo_gpu.py runs on CPU in its reduced size, with PyTorch's optimizer-in-backward
recipe (issue 13) as a row beside plain, ooo and ooo_fused."""
import json
import os
import subprocess
import sys

import torch

from gpu_scripts import load_gpu_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "bench_ooo_gpu.py")


def _load():
    return load_gpu_script("bench_ooo_gpu")


def test_small_run_on_cpu_has_the_optimizer_in_backward_row(tmp_path):
    out = tmp_path / "ooo.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, "--small", "--device", "cpu", "--models", "transformer",
                           "--steps", "2", "--warmup", "1", "--batch", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU NUMBERS" in proc.stdout and "optim_in_bwd" in proc.stdout
    (rows,) = json.loads(out.read_text())["models"].values()
    assert list(rows) == ["plain", "ooo", "ooo_fused", "optim_in_bwd"]
    r = rows["optim_in_bwd"]
    assert r["median_ms"] > 0 and r["speedup_vs_plain"] > 0
    assert r["max_abs_param_diff_vs_plain"] < 1e-5, r  # the same AdamW, stepped per parameter in backward
    assert r["peak_allocated_bytes"] is None  # CPU: no allocator figure
    assert r["param_grad_bytes"] == rows["plain"]["param_grad_bytes"] > 0


def test_optimizer_in_backward_trains_as_plain_and_frees_grads():
    b = _load()
    base, x, y, loss_fn, _ = b.build("transformer", True, 4, torch.device("cpu"))
    plain, oib = b.Variant("plain", base, x, y, loss_fn), b.Variant("optim_in_bwd", base, x, y, loss_fn)
    try:
        for _ in range(3):
            plain.step()
            oib.step()
        assert all(p.grad is None for p in oib.model.parameters())  # zeroed in the hook, set to None
        moved = False
        for (n, p), q, p0 in zip(plain.model.named_parameters(), oib.model.parameters(), base.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=n)
            moved |= not torch.equal(q, p0)
        assert moved  # the hooks did step
        assert all(o.defaults["lr"] == plain.opt.defaults["lr"] for o in oib.per_param.values())
    finally:
        plain.close()
        oib.close()
    assert not any(p._post_accumulate_grad_hooks for p in oib.model.parameters())
