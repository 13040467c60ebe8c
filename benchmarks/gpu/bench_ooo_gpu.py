"""bench_ooo_gpu.py -- out-of-order backward on one GPU: plain vs ooo vs ooo+fused vs PyTorch's optimizer in
backward, side by side, one run.

    python benchmarks/gpu/bench_ooo_gpu.py                       # GPU: MobileNetV3-small b32 + transformer b32
    python benchmarks/gpu/bench_ooo_gpu.py --small --device cpu  # reduced sizes on CPU (smoke test only)
    options: --models mobilenet,transformer  --batch 32  --steps 30 --warmup 5  --out FILE.json

Models: torchvision's mobilenet_v3_small (224x224, 1000 classes; many small kernels -- depthwise and 1x1
convolutions -- where dW on a side stream can fill the GPU; when torchvision is missing a stand-in of
depthwise-separable blocks is used and the row says so), and memsched.models' "realistic" transformer
(4 layers, d=256, seq 128, vocab 2048, tied embedding). fp32, AdamW.
Rows: plain PyTorch (loss.backward(); optimizer.step()); ooo (memsched.ooo.OutOfOrderBackward, stream
executor: dW of Linear/Conv on a side CUDA stream, caller runs optimizer.step()); ooo+fused (each
parameter stepped by torch's AdamW on the side stream as soon as its gradient is final, no optimizer.step());
optim_in_bwd (PyTorch's optimizer-in-backward recipe, tutorial "How to save memory by fusing the optimizer
step into the backward pass": one AdamW per parameter, same hyper-parameters, foreach=False as there,
stepped and zeroed from Tensor.register_post_accumulate_grad_hook; loss.backward() is the whole step).
Columns: median step time [IQR] over --steps after --warmup, ratio to plain (source S4 reports 1.03-1.58x
single-GPU speedup; the goal is >= 1.1x on one model), peak allocated memory, and the largest
|parameter difference| to plain after the timed steps (no dropout anywhere, so it is memsched's: cuBLAS/cuDNN
may pick other algorithms for a separate dW call, rounding-level differences; bitwise on CPU). Every row also carries param_grad_bytes (the
bytes of one gradient per trainable parameter), the figure issue 13's fused-update peak goal is stated in.
Timing: the four variants run interleaved step by step on identical copies; torch.cuda.synchronize()
before each clock read. Results go to stdout and, with --out, to JSON with GPU model, torch and CUDA
versions. A CPU run prints CPU numbers and says so.
"""
import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from memsched import models
from memsched.ooo import OutOfOrderBackward

MODES = ("plain", "ooo", "ooo_fused", "optim_in_bwd")
LR = 1e-4  # AdamW's learning rate for every variant; the other hyper-parameters are torch's defaults


class _DwSeparable(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.dw = nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False)
        self.bn1 = nn.BatchNorm2d(c_in)
        self.pw = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.hardswish(self.bn2(self.pw(F.hardswish(self.bn1(self.dw(x))))))


class MobileNetStandIn(nn.Module):
    """Depthwise-separable stand-in for MobileNetV3-small when torchvision is absent."""

    def __init__(self, classes=1000, width=(16, 24, 40, 48, 96, 96, 576)):
        super().__init__()
        self.stem = nn.Conv2d(3, width[0], 3, 2, 1, bias=False)
        blocks, c = [], width[0]
        for i, w in enumerate(width[1:]):
            blocks.append(_DwSeparable(c, w, 2 if i < 4 else 1))
            c = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Linear(c, 1024), nn.Hardswish(), nn.Linear(1024, classes))

    def forward(self, x):
        return self.head(self.blocks(F.hardswish(self.stem(x))).mean((2, 3)))


def build(name, small, batch, device):
    """(model, x, y, loss_fn, label)."""
    g = torch.Generator().manual_seed(0)
    if name == "mobilenet":
        image, classes = (64, 100) if small else (224, 1000)
        try:
            import torchvision

            torch.manual_seed(0)
            # dropout=0: its classifier's Dropout drew each variant's own mask, so the parameter difference
            # column measured dropout (5e-3 on the H100; two plain copies differ as much), not memsched
            model = torchvision.models.mobilenet_v3_small(num_classes=classes, dropout=0.0)
            label = f"MobileNetV3-small (torchvision) b{batch} {image}px"
        except ImportError:
            torch.manual_seed(0)
            model = MobileNetStandIn(classes)
            label = f"MobileNetV3-small STAND-IN (no torchvision) b{batch} {image}px"
        x = torch.randn(batch, 3, image, image, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return model.to(device), x.to(device), y.to(device), F.cross_entropy, label
    if name == "transformer":
        size = "small" if small else "realistic"
        model = models.build_model("transformer", size, seed=0)
        x, y = models.example_batch("transformer", batch, size, seed=0)
        return (model.to(device), x.to(device), y.to(device), lambda out, t: models.loss_fn("transformer", out, t),
                f"memsched transformer ({size}) b{batch}")
    raise SystemExit(f"unknown model {name!r}; expected mobilenet or transformer")


class Variant:
    def __init__(self, mode, base, x, y, loss_fn):
        self.mode = mode
        self.model = copy.deepcopy(base)
        self.x, self.y, self.loss_fn = x, y, loss_fn
        self.ooo = None
        self.handles = []
        if mode == "optim_in_bwd":
            # PyTorch's recipe: an optimizer per parameter, stepped as soon as its gradient is accumulated.
            self.opt = None
            per_param = {p: torch.optim.AdamW([p], lr=LR, foreach=False)
                         for p in self.model.parameters() if p.requires_grad}

            def hook(p):
                per_param[p].step()
                per_param[p].zero_grad(set_to_none=True)

            self.handles = [p.register_post_accumulate_grad_hook(hook) for p in per_param]
            self.per_param = per_param
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        if mode in ("ooo", "ooo_fused"):
            self.ooo = OutOfOrderBackward(self.model, optimizer=self.opt, fuse_optimizer=(mode == "ooo_fused"))
            self.ooo.install()
        self.times = []
        self.host_times = []  # until the step was enqueued: near times, the step is host-bound

    def step(self):
        loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        if self.mode == "optim_in_bwd":
            return  # stepped and zeroed inside backward
        if self.ooo is None or self.ooo.step():
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def close(self):
        if self.ooo is not None:
            self.ooo.remove()
        for h in self.handles:
            h.remove()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_model(name, args, device):
    base, x, y, loss_fn, label = build(name, args.small, args.batch, device)
    variants = [Variant(m, base, x, y, loss_fn) for m in MODES]
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    try:
        for r in range(args.warmup + args.steps):
            for v in variants:
                _sync(device)
                t0 = time.perf_counter()
                v.step()
                host = time.perf_counter() - t0
                _sync(device)
                if r >= args.warmup:
                    v.times.append(time.perf_counter() - t0)
                    v.host_times.append(host)
        rows = {}
        ref = dict(variants[0].model.named_parameters())
        for v in variants:
            peak = step_peak = None
            if device.type == "cuda":
                _sync(device)
                before = torch.cuda.memory_allocated(device)  # every variant's model and optimizer state
                torch.cuda.reset_peak_memory_stats(device)
                v.step()
                _sync(device)
                peak = torch.cuda.max_memory_allocated(device)
                step_peak = peak - before  # what this variant's step adds (the others' models excluded)
            diff = max(((p - ref[n]).abs().max().item() for n, p in v.model.named_parameters()), default=0.0)
            q = statistics.quantiles(v.times, n=4)
            rows[v.mode] = {"median_ms": statistics.median(v.times) * 1e3, "iqr_ms": (q[2] - q[0]) * 1e3,
                            "host_ms": statistics.median(v.host_times) * 1e3,
                            "peak_allocated_bytes": peak, "step_peak_above_resident_bytes": step_peak,
                            "max_abs_param_diff_vs_plain": diff, "param_grad_bytes": grad_bytes,
                            "report": v.ooo.report() if v.ooo is not None else None}
        for m in MODES[1:]:
            rows[m]["speedup_vs_plain"] = rows["plain"]["median_ms"] / rows[m]["median_ms"]
        return label, rows
    finally:
        for v in variants:
            v.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description="out-of-order backward on one GPU")
    ap.add_argument("--models", default="mobilenet,transformer")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="reduced sizes (CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --small --device cpu for a smoke test")
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()})",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    print(f"{env['device']}  torch {env['torch']}  CUDA {env['cuda']}"
          + ("" if device.type == "cuda" else "   -- CPU NUMBERS, NOT GPU NUMBERS"))
    results = {"env": env, "models": {}}
    for name in args.models.split(","):
        label, rows = run_model(name.strip(), args, device)
        results["models"][label] = rows
        if args.out:  # after every model, so a run stopped from outside keeps what it measured
            with open(args.out + ".tmp", "w") as f:
                json.dump(results, f, indent=2)
            os.replace(args.out + ".tmp", args.out)
        print(f"\n{label}")
        print(f"  {'variant':12s} {'median ms':>10s} {'host ms':>8s} {'IQR':>8s} {'speedup':>8s} {'peak MiB':>9s} "
              f"{'step +MiB':>9s} {'max|dp|':>9s}")
        for m in MODES:
            r = rows[m]
            peak = "-" if r["peak_allocated_bytes"] is None else f"{r['peak_allocated_bytes'] / 2**20:9.1f}"
            above = r.get("step_peak_above_resident_bytes")
            above = "-" if above is None else f"{above / 2**20:9.1f}"
            sp = f"x{r['speedup_vs_plain']:.3f}" if "speedup_vs_plain" in r else ""
            print(f"  {m:12s} {r['median_ms']:10.2f} {r['host_ms']:8.2f} {r['iqr_ms']:8.2f} {sp:>8s} {peak:>9s} {above:>9s} "
                  f"{r['max_abs_param_diff_vs_plain']:9.2e}", flush=True)
        for m in MODES:
            rep = rows[m]["report"]
            if rep and rep.get("fused_calls_in_cpp") and rep.get("iterations"):
                print(f"  {m}: {rep['fused_calls_in_cpp'] / rep['iterations']:.1f} C++ update calls per backward "
                      f"pass (update_batch_bytes {rep['update_batch_bytes'] / 2**20:.1f} MiB; Note [Update batches])")


if __name__ == "__main__":
    sys.exit(main())
