"""bench_offload.py -- memsched's activation offload against PyTorch's own answers, side by side, one run.

    python benchmarks/gpu/bench_offload.py                      # GPU: GPT-2-medium-sized decoder + ResNet-50
    python benchmarks/gpu/bench_offload.py --small              # reduced sizes; runs on CPU (CI smoke)
    options: --models gpt,resnet  --steps 10 --warmup 3  --fit-budget 16GiB  --no-fit  --out FILE.json
             --time-budget SECONDS  --compile-on-cpu  --trl-wheel PATH

Models: a GPT-2-medium-sized decoder (24 layers, d=1024, 16 heads, sequence 1024, vocab 50257; plain
torch.nn, random init) and ResNet-50 (torchvision; skipped with a message when it is not installed);
bf16 autocast, AdamW.
Rows: plain PyTorch; memsched.optimize(model, opt, budget=None) ("memsched budget None": the runtime's
hooks with nothing offloaded when the step fits the device -- issue 10's overhead row);
torch.autograd.graph.save_on_cpu(pin_memory=True); offload-all with one-step
prefetch (memsched planner offload_all_prefetch, torchtune's OffloadActivations behaviour);
torch.utils.checkpoint per block; memsched dp keeping 30%, 50% and 70% of plain's activation memory
(budget = the step's peak with saved activations capped at f of theirs: profiled peak - (1 - f) *
activation peak where the step peaks at the activation peak; See Note [Budget forms] in planning.py), and memsched
greedy at 50% (the planner that reaches the least budget; dp's model can need more); what users pick
instead: torch.compile with torch._functorch.config.activation_memory_budget = 0.5 (skipped on CPU unless
--compile-on-cpu: inductor takes ~50 s there), and TRL's OffloadActivations(use_streams=True)
(trl/models/activation_offloading.py read straight out of a TRL wheel -- --trl-wheel, $MEMSCHED_TRL_WHEEL or
.whl/trl-*.whl, see `make gpu-check-deps` -- so none of TRL's own dependencies are imported; skipped with a
message when no wheel is found; accelerator tensors only, so skipped on CPU after loading the file).
A budget no plan of that planner meets is a row "infeasible: needs at least N B" (full text in the JSON).
Columns: median step time and its ratio to plain, peak allocated memory, bytes moved; for memsched rows
the simulator's prediction; and per method the largest batch that fits --fit-budget (GPU only: found by
doubling then bisection under torch.cuda.set_per_process_memory_fraction; searched after every row is
measured, and not for the torch.compile row, which recompiles per batch size, nor for "memsched budget
None", which keeps everything where plain fits).
The JSON also carries, per memsched row, budget_with_state_bytes (the budget plus the optimizer state the
profiled step did not hold: what the measured peak is held to), d2h_bytes / h2d_bytes per step, and per
searched row max_batch_step_ms / max_batch_ms_per_sample (the step at the largest batch); gpu_check.py's
verdicts read them.
Models are built directly on the device (parameter init on the GPU is seconds faster per build).
--time-budget S: rows not started within S seconds, and largest-batch searches that would likely not end
within them, are recorded as skipped; with --out the JSON is rewritten after every row, so a run killed
from outside keeps what it measured.
Timing: torch.cuda.synchronize() before each clock read; median over --steps after --warmup (memsched's
warmup includes its profiled first step). Results go to stdout and, with --out, to JSON with the GPU
model, torch and CUDA versions. CPU numbers are printed as CPU numbers and say so.
"""
import argparse
import contextlib
import gc
import glob
import importlib.util
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import types
import zipfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from peak_snapshot import format_summary, record_step  # benchmarks/gpu/peak_snapshot.py

import memsched

GIB = 2 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
COMPILE = "torch.compile budget 0.5"
TRL = "trl OffloadActivations"
BUDGET_NONE = "memsched budget None"
METHODS = ["plain", BUDGET_NONE, "save_on_cpu", "offload_all_prefetch", "checkpoint", "memsched dp 30%", "memsched dp 50%",
           "memsched dp 70%", "memsched greedy 50%", "memsched hybrid 50%", "memsched hybrid 30%", COMPILE, TRL]
COMPILE_BUDGET = 0.5


class Skipped(Exception):
    """A row that cannot run here; the message says why."""


# -- TRL's OffloadActivations, read out of its wheel -----------------------------------------------
TRL_FILE = "trl/models/activation_offloading.py"


def find_trl_wheel(explicit=None):
    """The TRL wheel to read: explicit path, $MEMSCHED_TRL_WHEEL, else the newest .whl/trl-*.whl."""
    path = explicit or os.environ.get("MEMSCHED_TRL_WHEEL")
    if path:
        return path if os.path.exists(path) else None
    found = sorted(glob.glob(os.path.join(ROOT, ".whl", "trl-*.whl")))
    return found[-1] if found else None


def _stub_modules():
    """Stand-ins for the three imports of TRL's file that a machine may lack (psutil, accelerate,
    transformers); the GPU machine has all three, so there these stay unused."""
    def is_torch_version(op, version):
        cur = tuple(int(x) for x in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])
        want = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
        return {">=": cur >= want, ">": cur > want, "<=": cur <= want, "<": cur < want, "==": cur == want,
                "!=": cur != want}[op]

    def virtual_memory():
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0])
        return types.SimpleNamespace(percent=100.0 * (1 - info["MemAvailable"] / info["MemTotal"]))

    mods = {
        "psutil": {"virtual_memory": virtual_memory},
        "accelerate": {}, "accelerate.utils": {},
        "accelerate.logging": {"get_logger": logging.getLogger},
        "accelerate.utils.versions": {"is_torch_version": is_torch_version},
        "transformers": {"is_torch_npu_available": lambda: False},
    }
    out = {}
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        out[name] = m
    return out


def load_trl_offload(wheel):
    """(module, stubbed names) -- TRL's activation_offloading.py, executed from a copy of the file in the
    wheel; the imports it needs that are missing here are stubbed (see _stub_modules)."""
    src = zipfile.ZipFile(wheel).read(TRL_FILE)
    path = os.path.join(tempfile.mkdtemp(prefix="memsched_trl_"), "trl_activation_offloading.py")
    with open(path, "wb") as f:
        f.write(src)
    stubbed = []
    for top, names in (("psutil", ["psutil"]), ("accelerate", ["accelerate", "accelerate.utils", "accelerate.logging",
                                                                "accelerate.utils.versions"]),
                       ("transformers", ["transformers"])):
        if importlib.util.find_spec(top) is None:
            stubbed += names
    stubs = _stub_modules()
    saved = {n: sys.modules.get(n) for n in stubbed}
    try:
        for n in stubbed:
            sys.modules[n] = stubs[n]
        spec = importlib.util.spec_from_file_location("trl_activation_offloading", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return mod, sorted({n.split(".")[0] for n in stubbed})


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


def _fraction_device(device):
    """The device index torch.cuda.set_per_process_memory_fraction needs ("cuda" alone has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _snapshot_into(row, step, device):
    """row["peak_snapshot"] from one recorded step; a failure there costs the snapshot, not the row's figures."""
    try:
        row["peak_snapshot"] = record_step(step, device)
    except Exception as e:  # (an allocator API this torch lacks, out of memory in the extra step)
        row["peak_snapshot_error"] = f"{type(e).__name__}: {e}"


def run_method(spec, method, batch, device, steps, warmup, device_model=None, budget_bytes=None, extra=None,
               snapshot=False):
    """Train `steps + warmup` steps with `method`; returns a dict of measurements.

    extra: {"compile_on_cpu": bool, "trl": (module, stubbed) or a message why TRL is absent}.
    snapshot: on CUDA, one more step after the timed ones, recorded by the allocator: row["peak_snapshot"]
    (Note [Where a planned step's extra memory was allocated] in peak_snapshot.py); not in any figure.
    Raises Skipped when the method cannot run here.
    """
    extra = extra or {}
    if method == COMPILE and device.type == "cpu" and not extra.get("compile_on_cpu"):
        raise Skipped("skipped on CPU: inductor compiles for ~50 s there (--compile-on-cpu runs it)")
    if method == TRL:
        trl = extra.get("trl")
        if not isinstance(trl, tuple):
            raise Skipped(str(trl or "skipped: TRL not loaded"))
        if device.type != "cuda":
            raise Skipped("skipped on CPU: TRL's OffloadActivations offloads accelerator tensors only "
                          "(its file loaded from the wheel)")
    torch.manual_seed(0)
    with torch.device(device):  # init on the device: a GPT-2-medium build takes seconds on the CPU
        model = spec.build(per_block_checkpoint=(method == "checkpoint")).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = spec.data(batch, device)
    row = {"method": method, "batch": batch}
    times = []
    host_times = []  # seconds until the step was enqueued (before the synchronisation)
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
        elif method == BUDGET_NONE:  # issue 10: hooks on, nothing offloaded where the step fits the device
            budget, planner = None, "dp"
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
                host = time.perf_counter() - t0  # enqueued: what the host spent (no wait for the GPU)
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    host_times.append(host)
            timed_stats = list(run.step_stats)
            timed_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            if snapshot and device.type == "cuda":
                _snapshot_into(row, lambda: (fwd_bwd(), run.step()), device)
        executed = [s for s in timed_stats if s.mode == "planned"][-steps:]
        moved = [s.d2h_bytes + s.h2d_bytes for s in executed]
        row["stall_ms"] = statistics.median(s.stall_s for s in executed) * 1e3 if executed else None
        row["plain_steps"] = sum(1 for s in timed_stats if s.mode != "planned")
        if run.simulation is not None:
            row["sim_step_ms"] = run.simulation.step_time_us / 1e3
            row["sim_peak_bytes"] = run.simulation.peak_bytes
        row["budget_bytes"] = run.budget_bytes
        # what the measured peak is held to (issue 11: at most this + 2%): the budget plus the optimizer
        # state the profiled step did not hold (Note [Optimizer state the profiled step did not see])
        row["budget_with_state_bytes"] = run._budget_with_state()
        # per direction, for issue 10's copy-throughput figure (a lower bound: bytes / whole step time)
        row["d2h_bytes"] = statistics.median(s.d2h_bytes for s in executed) if executed else 0
        row["h2d_bytes"] = statistics.median(s.h2d_bytes for s in executed) if executed else 0
        # issue 11: keep_all's simulated peak on this row's trace (plus the optimizer state the profiled
        # step did not hold yet), to set against plain's measured max_memory_allocated
        keep_all = memsched.simulate(run.trace, memsched.plan(run.trace, planner="keep_all"))
        row["keep_all_sim_peak_bytes"] = keep_all.peak_bytes + run.optimizer_state_extra_
        row["unmodeled_bytes"] = run.unmodeled_bytes_
        # the least budget any offload/recompute plan reaches on this trace (what no plan can go below:
        # what ops hold while they run, the loss's logits, parameters, gradients, state), beside
        # per-block checkpoint's measured peak: how far a largest-batch search can get past checkpointing
        row["least_plan_bytes"] = memsched._C.least_budget_bytes(run.trace) + run.optimizer_state_extra_
        row["offloaded"] = executed[-1].offloaded if executed else 0
        # Note [Memory guard]: compute-stream waits per step that kept the allocator within the budget
        row["guard_waits"] = statistics.median(s.guard_waits for s in executed) if executed else None
        row["activation_bytes"] = run.trace.activation_bytes()
        # Note [Where the peak went]: the highest timed step's peak against the plan, by category (CUDA)
        gap = run._peak_gap()
        if gap is not None:
            row["peak_phase"] = gap.peak_phase
            row["peak_gap"] = {"planned_bytes": gap.planned_bytes, "measured_bytes": gap.measured_bytes,
                               "categories": dict(gap.categories), "fragmentation_bytes": gap.fragmentation_bytes}
    else:
        hooks = CountingSaveOnCpu(device.type == "cuda") if method == "save_on_cpu" else None
        forward_model = model
        settings = contextlib.nullcontext()
        if method == COMPILE:
            import torch._functorch.config as functorch_config

            # The budget is read when the graph is compiled, at the first step: hold it for the whole loop.
            settings = functorch_config.patch(activation_memory_budget=COMPILE_BUDGET)
            torch._dynamo.reset()
            forward_model = torch.compile(model)
            row["activation_memory_budget"] = COMPILE_BUDGET
        if method == TRL:
            trl_module, stubbed = extra["trl"]
            row["trl_wheel"] = os.path.basename(extra.get("trl_wheel") or "")
            if stubbed:
                row["trl_stubbed_imports"] = stubbed
        first_step_s = None

        def one_step():
            if hooks is not None:
                hooks.bytes = 0
            ctx = hooks if hooks is not None else \
                trl_module.OffloadActivations(use_streams=True) if method == TRL else contextlib.nullcontext()
            with ctx:
                with _autocast(device):
                    loss = spec.loss(forward_model, data)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with settings:
            for i in range(warmup + steps):
                if i == warmup and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t0 = time.perf_counter()
                one_step()
                host = time.perf_counter() - t0  # enqueued: what the host spent (no wait for the GPU)
                _sync(device)
                if i == 0:
                    first_step_s = time.perf_counter() - t0
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    host_times.append(host)
                    moved.append(2 * hooks.bytes if hooks is not None else (None if method == TRL else 0))
            timed_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            if snapshot and device.type == "cuda":
                _snapshot_into(row, one_step, device)
        if method == COMPILE:
            row["first_step_s"] = first_step_s  # includes compilation
            torch._dynamo.reset()
    row["step_ms"] = statistics.median(times) * 1e3
    # the host's share: near step_ms, the step is host-bound (launches, hooks, Python); well below it,
    # the GPU sets the pace and host overhead is hidden
    row["host_ms"] = statistics.median(host_times) * 1e3
    row["step_ms_spread"] = (min(times) * 1e3, max(times) * 1e3)
    # TRL's offloader does not say what it moved: None ("-"), not 0.
    row["bytes_moved"] = statistics.median(moved) if moved and None not in moved else (0 if not moved else None)
    row["peak_bytes"] = timed_peak  # (before a snapshot step)
    if row["peak_bytes"] is not None and method.startswith(("memsched", "offload_all")):
        # The executor starts a new peak at each step's first forward: the counter above covers the
        # last step only, where plain rows cover every timed step; take the timed steps' own peaks too.
        row["peak_bytes"] = max([row["peak_bytes"]] + [s.peak_bytes for s in executed])
    return row


def largest_batch(spec, method, device, fit_bytes, device_model, start, extra=None, deadline=None):
    """Largest batch that trains 3 steps under a fit_bytes allocator cap (doubling, then bisection).
    Past `deadline` (time.monotonic()) the search stops and returns the largest batch seen to fit, as
    (batch, True, step_ms); otherwise (batch, False, step_ms). step_ms: the (single timed) step time at
    that batch, None when no batch fit."""
    index = _fraction_device(device)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, fit_bytes / total), index)
    budget = int(0.9 * fit_bytes) if method.startswith("memsched") else None

    step_ms = {}

    def fits(b):
        try:
            step_ms[b] = run_method(spec, method, b, device, steps=1, warmup=2, device_model=device_model,
                                    budget_bytes=budget, extra=extra)["step_ms"]
            return True
        except (torch.cuda.OutOfMemoryError, memsched.MemschedError):
            return False
        finally:
            gc.collect()
            torch.cuda.empty_cache()

    def late():
        return deadline is not None and time.monotonic() > deadline

    try:
        lo, hi = 0, max(1, start)
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 4096:
                return lo, False, step_ms.get(lo)
            if late():
                return lo, True, step_ms.get(lo)
        while hi - lo > 1:
            if late():
                return lo, True, step_ms.get(lo)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo, False, step_ms.get(lo)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


# -- table -----------------------------------------------------------------------------------------
def _fmt_bytes(n):
    return "-" if n is None else memsched.format_bytes(n)


def keep_all_fidelity(rows):
    """Issue 11's first figure: keep_all's simulated peak (from a memsched row's trace, which carries
    the memory the trace does not model) against plain's measured max_memory_allocated."""
    plain = next((r for r in rows if r["method"] == "plain" and r.get("peak_bytes")), None)
    traced = next((r for r in rows if r.get("keep_all_sim_peak_bytes")), None)
    if plain is None or traced is None:
        return None
    sim, measured = traced["keep_all_sim_peak_bytes"], plain["peak_bytes"]
    return {"sim_peak_bytes": sim, "plain_peak_bytes": measured, "ratio": sim / measured, "trace_of": traced["method"],
            "line": f"keep_all simulated peak ({traced['method']}'s trace, {_fmt_bytes(traced.get('unmodeled_bytes'))} "
                    f"of it unmodeled device memory) {_fmt_bytes(sim)} vs plain's measured {_fmt_bytes(measured)}: "
                    f"{sim / measured:.3f}x (goal within 3%)"}


def floor_line(rows):
    """The least budget any plan reaches on a memsched row's trace, against per-block checkpoint's
    measured peak at the same batch; None without both."""
    traced = next((r for r in rows if r.get("least_plan_bytes")), None)
    ckpt = next((r for r in rows if r["method"] == "checkpoint" and r.get("peak_bytes")), None)
    if traced is None or ckpt is None:
        return None
    return (f"least budget any plan reaches ({traced['method']}'s trace): {_fmt_bytes(traced['least_plan_bytes'])}, "
            f"{traced['least_plan_bytes'] / ckpt['peak_bytes']:.3f}x per-block checkpoint's measured peak "
            f"({_fmt_bytes(ckpt['peak_bytes'])}) at this batch")


def format_gaps(rows):
    """One line per memsched row whose measured peak is over its plan by more than 2%, with the gap by
    category (Note [Where the peak went] in python/memsched/offload/peak_gap.py); [] when none is."""
    lines = []
    for r in rows:
        gap = r.get("peak_gap")
        if not gap or not gap["categories"]:
            continue
        over = gap["measured_bytes"] - gap["planned_bytes"]
        parts = ", ".join(f"{name} {_fmt_bytes(n)}" for name, n in gap["categories"].items())
        frag = gap.get("fragmentation_bytes")
        lines.append(f"peak gap, {r['method']}: +{_fmt_bytes(over)} over the plan's {_fmt_bytes(gap['planned_bytes'])}"
                     f" (peak in the {r.get('peak_phase') or '?'}): {parts}"
                     + (f"; reserved beyond allocated {_fmt_bytes(frag)}" if frag is not None else ""))
    return lines


def format_rows(rows, device):
    plain = next((r for r in rows if r["method"] == "plain"), None)
    head = ["method", "step (ms)", "host (ms)", "vs plain", "peak alloc", "budget", "bytes moved", "sim step (ms)",
            "sim peak", "guard waits", "max batch"]
    lines = []
    for r in rows:
        if "error" in r or "skipped" in r:
            msg = r.get("error") or r["skipped"]
            if "needs at least" in msg:  # the planner's infeasible-budget message: keep the number
                msg = "infeasible: needs at least " + msg.split("needs at least ")[1].split(" ")[0] + " B"
            lines.append([r["method"], msg[:60]] + [""] * (len(head) - 2))
            continue
        ratio = r["step_ms"] / plain["step_ms"] if plain and plain.get("step_ms") else math.nan
        lines.append([r["method"], f"{r['step_ms']:.2f}", f"{r['host_ms']:.2f}" if r.get("host_ms") is not None else "-",
                      f"{ratio:.3f}x",
                      _fmt_bytes(r["peak_bytes"]) if device.type == "cuda" else "n/a (CPU)",
                      _fmt_bytes(r.get("budget_bytes")),
                      _fmt_bytes(r["bytes_moved"]),
                      f"{r['sim_step_ms']:.2f}" if r.get("sim_step_ms") is not None else "-",
                      _fmt_bytes(r.get("sim_peak_bytes")),
                      f"{r['guard_waits']:g}" if r.get("guard_waits") is not None else "-",
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
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: rows not started by then, and largest-batch searches unlikely to end by then, "
                        "are recorded as skipped")
    p.add_argument("--peak-snapshot", default="",
                   help="comma-separated rows that run one more step recorded by the CUDA allocator, whose "
                        "peak is then split by where its blocks were allocated (CUDA only; not timed)")
    p.add_argument("--compile-on-cpu", action="store_true", help="run the torch.compile row on CPU too (slow)")
    p.add_argument("--trl-wheel", default=None,
                   help="TRL wheel to read trl/models/activation_offloading.py from "
                        "(default: $MEMSCHED_TRL_WHEEL, else .whl/trl-*.whl)")
    args = p.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.time_budget if args.time_budget else None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # OpenMP's spinning threads make small CPU steps erratic
    steps = args.steps or (2 if args.small else 10)
    warmup = max(args.warmup, 2)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    snapshot_rows = {m.strip() for m in args.peak_snapshot.split(",") if m.strip()}
    if snapshot_rows - set(METHODS):
        p.error(f"--peak-snapshot: unknown {sorted(snapshot_rows - set(METHODS))}; choose from {METHODS}")
    device_model = "cpu" if device.type == "cpu" else None
    if device.type == "cuda" and hasattr(memsched, "measure_device"):
        device_model = memsched.measure_device(str(device))
    extra = {"compile_on_cpu": args.compile_on_cpu}
    if TRL in methods:
        wheel = find_trl_wheel(args.trl_wheel)
        if wheel is None:
            extra["trl"] = ("skipped: no TRL wheel (run `make gpu-check-deps`, which downloads it into .whl/, "
                            "and carry .whl; or pass --trl-wheel)")
        else:
            extra["trl_wheel"] = wheel
            try:
                extra["trl"] = load_trl_offload(wheel)
            except Exception as e:  # a wheel without the file, or a file that no longer imports
                extra["trl"] = f"skipped: could not load {TRL_FILE} from {os.path.basename(wheel)}: " \
                               f"{type(e).__name__}: {e}"
    env = environment(device)
    print(f"# bench_offload on {env['gpu'] or 'CPU (not a GPU number)'}; torch {env['torch']}, CUDA {env['cuda']}"
          + (f"; {env['cpu_threads']} CPU thread(s)" if device.type == "cpu" else ""), flush=True)
    results = {"environment": env, "small": args.small, "steps": steps, "warmup": warmup,
               "time_budget_s": args.time_budget, "models": {}}

    def dump():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(results, f, indent=2, default=str)
            os.replace(tmp, args.out)

    def remaining():
        return math.inf if deadline is None else deadline - time.monotonic()

    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            spec = {"gpt": GPTSpec, "resnet": ResNetSpec}[name](args.small)
        except KeyError:
            p.error(f"--models: unknown model {name!r}; choose gpt, resnet")
        except ImportError as e:
            print(f"\n## {name}: skipped -- {e} (install torchvision to benchmark ResNet-50)", flush=True)
            results["models"][name] = {"skipped": str(e)}
            dump()
            continue
        batch = args.batch or spec.batch
        print(f"\n## {spec.title}, batch {batch}, bf16 autocast, AdamW, {device}", flush=True)
        rows = []
        results["models"][name] = {"title": spec.title, "batch": batch, "rows": rows}
        for method in methods:  # every row first; the largest-batch searches after them
            t0 = time.monotonic()
            if remaining() <= 0:
                row = {"method": method, "skipped": f"skipped: time budget ({args.time_budget:g} s) spent"}
            else:
                try:
                    row = run_method(spec, method, batch, device, steps, warmup, device_model, extra=extra,
                                     snapshot=method in snapshot_rows)
                except Skipped as e:
                    row = {"method": method, "skipped": str(e)}
                except Exception as e:  # keep going: the row says what failed
                    row = {"method": method, "error": f"{type(e).__name__}: {e}"}
                finally:
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            row["wall_s"] = time.monotonic() - t0
            rows.append(row)
            dump()
            print(f"  {method}: " + (row.get("error") or row.get("skipped") or f"{row['step_ms']:.2f} ms"),
                  flush=True)
        for row in rows:
            method = row["method"]
            if "error" in row or "skipped" in row:
                continue
            if device.type != "cuda":
                row["max_batch"] = "n/a (CPU)"
            elif args.no_fit:
                row["max_batch"] = "-"
            elif method == COMPILE:
                row["max_batch"] = "n/a (recompiles per batch)"
            elif method == BUDGET_NONE:  # keeps everything where the step fits: plain's batch, searched there
                row["max_batch"] = "n/a (keeps all: plain's)"
            elif remaining() < 4 * row["wall_s"]:
                row["max_batch"] = "skipped (time budget)"
            else:
                try:
                    found, cut, found_ms = largest_batch(spec, method, device, memsched.parse_bytes(args.fit_budget),
                                               device_model, batch, extra=extra,
                                               deadline=None if deadline is None else deadline)
                    row["max_batch"] = f">= {found} (time budget)" if cut else found
                    if found_ms is not None:  # issue 11: step time per sample at the largest batch
                        row["max_batch_step_ms"] = found_ms
                        row["max_batch_ms_per_sample"] = found_ms / found
                except Exception as e:
                    row["max_batch"] = f"error: {type(e).__name__}"
                    row["max_batch_error"] = f"{type(e).__name__}: {e}"
                print(f"  {method}: largest batch in {args.fit_budget}: {row['max_batch']}", flush=True)
            dump()
        print()
        print(format_rows(rows, device))
        for line in format_gaps(rows):
            print(line)
        for row in rows:  # Note [Where a planned step's extra memory was allocated] (peak_snapshot.py)
            if row.get("peak_snapshot"):
                for line in format_summary(row["method"], row["peak_snapshot"], _fmt_bytes):
                    print(line)
        floor = floor_line(rows)
        if floor:
            print(floor)
        fidelity = keep_all_fidelity(rows)
        if fidelity:
            results["models"][name]["keep_all_fidelity"] = fidelity
            print(fidelity["line"])
        if device.type == "cpu":
            print("(CPU run: times are CPU wall clock, copies are host memcpy; GPU figures are pending a GPU run)")
        dump()
    results["wall_s"] = time.monotonic() - started
    dump()
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
