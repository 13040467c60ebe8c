"""bench_offload.py -- memsched's activation offload against PyTorch's own answers, side by side, one run.

    python benchmarks/gpu/bench_offload.py                      # GPU: GPT-2-medium-sized decoder + ResNet-50
    python benchmarks/gpu/bench_offload.py --small              # reduced sizes; runs on CPU (CI smoke)
    options: --models gpt,resnet  --steps 10 --warmup 3  --fit-budget 16GiB  --no-fit  --out FILE.json

Models: a GPT-2-medium-sized decoder (24 layers, d=1024, 16 heads, sequence 1024, vocab 50257; plain
torch.nn, random init) and ResNet-50 (torchvision; skipped with a message when it is not installed);
bf16 autocast, AdamW.
Rows: plain PyTorch; torch.autograd.graph.save_on_cpu(pin_memory=True); offload-all with one-step
prefetch (memsched planner offload_all_prefetch, torchtune's OffloadActivations behaviour);
torch.utils.checkpoint per block; memsched dp keeping 30%, 50% and 70% of plain's activation memory
(budget = the step's peak with saved activations capped at f of theirs: profiled peak - (1 - f) *
activation peak where the step peaks at the activation peak; See Note [Budget forms] in planning.py), and memsched
greedy at 50% (the planner that reaches the least budget; dp's model can need more).
A budget no plan of that planner meets is a row "infeasible: needs at least N B" (full text in the JSON).
Columns: median step time and its ratio to plain, peak allocated memory, bytes moved; for memsched rows
the simulator's prediction; and per method the largest batch that fits --fit-budget (GPU only: found by
doubling then bisection under torch.cuda.set_per_process_memory_fraction).
Timing: torch.cuda.synchronize() before each clock read; median over --steps after --warmup (memsched's
warmup includes its profiled first step). Results go to stdout and, with --out, to JSON with the GPU
model, torch and CUDA versions. CPU numbers are printed as CPU numbers and say so.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memsched

GIB = 2 ** 30


# -- models ----------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention + 4x GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, layers, d, heads, seq, vocab, per_block_checkpoint=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.per_block_checkpoint = per_block_checkpoint

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.per_block_checkpoint else block(x)
        return self.head(self.ln(x))


class GPTSpec:
    name = "gpt"

    def __init__(self, small):
        self.layers, self.d, self.heads, self.seq, self.vocab = (4, 32, 2, 64, 64) if small else \
            (24, 1024, 16, 1024, 50257)
        self.batch = 2 if small else 8
        self.title = (f"decoder {self.layers} layers, d={self.d}, seq {self.seq}, vocab {self.vocab}" +
                      (" (reduced: --small)" if small else " (GPT-2-medium-sized)"))

    def build(self, per_block_checkpoint):
        return Decoder(self.layers, self.d, self.heads, self.seq, self.vocab, per_block_checkpoint)

    def data(self, batch, device):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (batch, self.seq + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def loss(self, model, data):
        x, y = data
        logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class ResNetSpec:
    name = "resnet"

    def __init__(self, small):
        import torchvision  # noqa: F401 -- raises ImportError when missing
        self.small = small
        self.image = 32 if small else 224
        self.batch = 2 if small else 64
        self.title = f"ResNet-50, {self.image}x{self.image} images" + (" (reduced: --small)" if small else "")

    def build(self, per_block_checkpoint):
        import torchvision
        model = torchvision.models.resnet50(num_classes=1000)
        if per_block_checkpoint:
            for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
                for i, blk in enumerate(stage):
                    stage[i] = _Checkpointed(blk)
        return model

    def data(self, batch, device):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, 3, self.image, self.image, generator=g).to(device),
                torch.randint(0, 1000, (batch,), generator=g).to(device))

    def loss(self, model, data):
        x, y = data
        return F.cross_entropy(model(x).float(), y)


class _Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


# -- methods ---------------------------------------------------------------------------------------
METHODS = ["plain", "save_on_cpu", "offload_all_prefetch", "checkpoint", "memsched dp 30%", "memsched dp 50%",
           "memsched dp 70%", "memsched greedy 50%"]


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu, counting the bytes it packs (each goes out and comes back)."""

    def __init__(self, pin_memory):
        super().__init__(pin_memory=pin_memory)
        self.bytes = 0
        pack = self.pack_hook

        def counting_pack(t):
            self.bytes += t.untyped_storage().nbytes() if t.is_contiguous() else t.numel() * t.element_size()
            return pack(t)

        self.pack_hook = counting_pack


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def run_method(spec, method, batch, device, steps, warmup, device_model=None, budget_bytes=None):
    """Train `steps + warmup` steps with `method`; returns a dict of measurements."""
    torch.manual_seed(0)
    model = spec.build(per_block_checkpoint=(method == "checkpoint")).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = spec.data(batch, device)
    row = {"method": method, "batch": batch}
    times = []
    moved = []

    def fwd_bwd():
        with _autocast(device):
            loss = spec.loss(model, data)
        loss.backward()

    if device.type == "cuda":
        torch.cuda.empty_cache()
    if method.startswith("memsched") or method == "offload_all_prefetch":
        if method == "offload_all_prefetch":
            budget, planner = None, "offload_all_prefetch"
        else:
            _, planner, share = method.split()
            budget = float(share.rstrip("%")) / 100.0
        if budget_bytes is not None:
            budget = budget_bytes
        opts = {"device_model": device_model} if device_model is not None else {}
        if planner != "dp":
            budget = budget if budget is not None else 1.0  # offload-all ignores the budget's size
        with memsched.optimize(model, opt, budget=budget, planner=planner, **opts) as run:
            for i in range(warmup + steps):
                if i == warmup and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t0 = time.perf_counter()
                fwd_bwd()
                run.step()
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        executed = [s for s in run.step_stats if s.mode == "planned"][-steps:]
        moved = [s.d2h_bytes + s.h2d_bytes for s in executed]
        row["stall_ms"] = statistics.median(s.stall_s for s in executed) * 1e3 if executed else None
        row["plain_steps"] = sum(1 for s in run.step_stats if s.mode != "planned")
        if run.simulation is not None:
            row["sim_step_ms"] = run.simulation.step_time_us / 1e3
            row["sim_peak_bytes"] = run.simulation.peak_bytes
        row["budget_bytes"] = run.budget_bytes
        row["offloaded"] = executed[-1].offloaded if executed else 0
        row["activation_bytes"] = run.trace.activation_bytes()
    else:
        hooks = CountingSaveOnCpu(device.type == "cuda") if method == "save_on_cpu" else None
        for i in range(warmup + steps):
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            if hooks is not None:
                hooks.bytes = 0
            with hooks if hooks is not None else contextlib.nullcontext():
                with _autocast(device):
                    loss = spec.loss(model, data)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                moved.append(2 * hooks.bytes if hooks is not None else 0)
    row["step_ms"] = statistics.median(times) * 1e3
    row["step_ms_spread"] = (min(times) * 1e3, max(times) * 1e3)
    row["bytes_moved"] = statistics.median(moved) if moved else 0
    row["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return row


def largest_batch(spec, method, device, fit_bytes, device_model, start):
    """Largest batch that trains 3 steps under a fit_bytes allocator cap (doubling, then bisection)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, fit_bytes / total), device)
    budget = int(0.9 * fit_bytes) if method.startswith("memsched") else None

    def fits(b):
        try:
            run_method(spec, method, b, device, steps=1, warmup=2, device_model=device_model,
                       budget_bytes=budget)
            return True
        except (torch.cuda.OutOfMemoryError, memsched.MemschedError):
            return False
        finally:
            torch.cuda.empty_cache()

    try:
        lo, hi = 0, max(1, start)
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 4096:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


# -- table -----------------------------------------------------------------------------------------
def _fmt_bytes(n):
    return "-" if n is None else memsched.format_bytes(n)


def format_rows(rows, device):
    plain = next((r for r in rows if r["method"] == "plain"), None)
    head = ["method", "step (ms)", "vs plain", "peak alloc", "bytes moved", "sim step (ms)", "sim peak",
            "max batch"]
    lines = []
    for r in rows:
        if "error" in r:
            msg = r["error"]
            if "needs at least" in msg:  # the planner's infeasible-budget message: keep the number
                msg = "infeasible: needs at least " + msg.split("needs at least ")[1].split(" ")[0] + " B"
            lines.append([r["method"], msg[:60], "", "", "", "", "", ""])
            continue
        ratio = r["step_ms"] / plain["step_ms"] if plain and plain.get("step_ms") else math.nan
        lines.append([r["method"], f"{r['step_ms']:.2f}", f"{ratio:.3f}x",
                      _fmt_bytes(r["peak_bytes"]) if device.type == "cuda" else "n/a (CPU)",
                      _fmt_bytes(r["bytes_moved"]),
                      f"{r['sim_step_ms']:.2f}" if r.get("sim_step_ms") is not None else "-",
                      _fmt_bytes(r.get("sim_peak_bytes")),
                      str(r.get("max_batch", "-"))])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(x) for x in lines])


def environment(device):
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": str(device), "host": platform.node()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["gpu"] = None
        env["cpu_threads"] = torch.get_num_threads()
        env["cpu"] = platform.processor() or platform.machine()
    return env


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", "--cpu-smoke", dest="small", action="store_true",
                   help="reduced model sizes (runs on CPU in seconds)")
    p.add_argument("--models", default="gpt,resnet", help="comma-separated: gpt, resnet")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of the rows")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per method (default 10; 2 with --small)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (memsched's include profiling)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: 8 gpt / 64 resnet; 2 small)")
    p.add_argument("--fit-budget", default="16GiB", help="memory cap for the largest-batch column")
    p.add_argument("--no-fit", action="store_true", help="skip the largest-batch search")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads on --device cpu (default 1)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # OpenMP's spinning threads make small CPU steps erratic
    steps = args.steps or (2 if args.small else 10)
    warmup = max(args.warmup, 2)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    device_model = "cpu" if device.type == "cpu" else None
    if device.type == "cuda" and hasattr(memsched, "measure_device"):
        device_model = memsched.measure_device(str(device))
    env = environment(device)
    print(f"# bench_offload on {env['gpu'] or 'CPU (not a GPU number)'}; torch {env['torch']}, CUDA {env['cuda']}"
          + (f"; {env['cpu_threads']} CPU thread(s)" if device.type == "cpu" else ""))
    results = {"environment": env, "small": args.small, "steps": steps, "warmup": warmup, "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            spec = {"gpt": GPTSpec, "resnet": ResNetSpec}[name](args.small)
        except KeyError:
            p.error(f"--models: unknown model {name!r}; choose gpt, resnet")
        except ImportError as e:
            print(f"\n## {name}: skipped -- {e} (install torchvision to benchmark ResNet-50)")
            results["models"][name] = {"skipped": str(e)}
            continue
        batch = args.batch or spec.batch
        print(f"\n## {spec.title}, batch {batch}, bf16 autocast, AdamW, {device}")
        rows = []
        for method in methods:
            try:
                row = run_method(spec, method, batch, device, steps, warmup, device_model)
            except (RuntimeError, ValueError) as e:
                row = {"method": method, "error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda" and not args.no_fit and "error" not in row:
                row["max_batch"] = largest_batch(spec, method, device, memsched.parse_bytes(args.fit_budget),
                                                 device_model, batch)
            elif "error" not in row:
                row["max_batch"] = "n/a (CPU)" if device.type == "cpu" else "-"
            rows.append(row)
            print(f"  {method}: " + (row.get("error") or f"{row['step_ms']:.2f} ms"), flush=True)
        print()
        print(format_rows(rows, device))
        if device.type == "cpu":
            print("(CPU run: times are CPU wall clock, copies are host memcpy; GPU figures are pending a GPU run)")
        results["models"][name] = {"title": spec.title, "batch": batch, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
