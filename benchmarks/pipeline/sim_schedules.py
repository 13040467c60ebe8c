"""sim_schedules.py -- simulated throughput of pipeline schedules and weight policies against data
parallelism for the GPT-2-medium-sized decoder at 4 and 8 stages (one GPU per stage), one table.

    python benchmarks/pipeline/sim_schedules.py [--out sim.json] [--small]

Every figure is a simulation (csrc/core/pipeline_sim.h, Note [Pipeline schedule model]); none is
measured. Per-stage op times come from a profile: memsched.profile() of the decoder at its real width
(d=1024, 16 heads, sequence 1024, vocab 50257) with PROFILED_BLOCKS blocks, one sequence, on this CPU;
each op's time is then the h100-sxm preset's roofline (FP32, 67 TFLOP/s, 3.35 TB/s), not the CPU's
duration; the 24 blocks take the mean profiled block's costs. See Note [Per-stage op times from a
profile] in python/memsched/pipeline/simulate.py. --small profiles a reduced decoder (CI smoke).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.models import Block
from memsched.pipeline import simulate as psim

PROFILED_BLOCKS = 2
LINKS = {  # name: (GB/s per direction, latency us, source)
    "NVLink4": (300.0, 5.0, "H100 SXM NVLink 4: 450 GB/s per direction nominal; 300 GB/s effective assumed"),
    "PCIe5": (53.6, 10.0, "PCIe Gen5 x16: 63 GB/s per direction; 85% (53.6 GB/s) and 10 us assumed, as the "
                          "h100 presets"),
}


class Embed(nn.Module):
    def __init__(self, vocab, d, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.unembed = nn.Linear(d, vocab, bias=False)  # untied: a pipeline cannot tie across stages

    def forward(self, x):
        return self.unembed(self.ln(x))


def decoder(layers, d, heads, seq, vocab):
    return nn.Sequential(Embed(vocab, d, seq), *[Block(d, heads) for _ in range(layers)], Head(vocab, d))


def profile_units(d, heads, seq, vocab, device):
    """{unit: (F, I, W) us} for 'embed', 'block' (mean), 'head' (with the loss), on the device model."""
    torch.manual_seed(0)
    model = decoder(PROFILED_BLOCKS, d, heads, seq, vocab)
    x = torch.randint(0, vocab, (1, seq))
    y = torch.randint(0, vocab, (1, seq))

    def step():
        F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()

    trace = memsched.profile(step, model=model)
    units = [["0"]] + [[str(i)] for i in range(1, PROFILED_BLOCKS + 1)] + [[str(PROFILED_BLOCKS + 1)]]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    nb = [0] * len(units)
    costs = psim.stage_costs(trace, units, device, linear, nb, nb)
    blocks = costs[1:-1]
    mean = tuple(sum(getattr(c, a) for c in blocks) / len(blocks)
                 for a in ("forward_us", "backward_input_us", "backward_weight_us"))
    get = lambda c: (c.forward_us, c.backward_input_us, c.backward_weight_us)  # noqa: E731
    params = {"embed": sum(p.numel() for p in model[0].parameters()),
              "block": sum(p.numel() for p in model[1].parameters()),
              "head": sum(p.numel() for p in model[-1].parameters())}
    return {"embed": get(costs[0]), "block": mean, "head": get(costs[-1])}, params


def balanced_split(unit_times, k):
    """The user's split points for this benchmark: contiguous groups of units minimising the slowest
    stage (a small DP over 26 units). Returns the groups' sizes."""
    n = len(unit_times)
    pre = [0.0]
    for t in unit_times:
        pre.append(pre[-1] + t)
    best = [[math.inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, k) + 1):
            for s in range(j - 1, i):
                v = max(best[s][j - 1], pre[i] - pre[s])
                if v < best[i][j]:
                    best[i][j], cut[i][j] = v, s
    sizes, i = [], n
    for j in range(k, 0, -1):
        sizes.append(i - cut[i][j])
        i = cut[i][j]
    return sizes[::-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--small", action="store_true", help="reduced decoder (CI smoke; figures meaningless)")
    ap.add_argument("--stages", default="4,8")
    args = ap.parse_args(argv)
    layers, d, heads, seq, vocab = (4, 64, 2, 64, 128) if args.small else (24, 1024, 16, 1024, 50257)
    dev = memsched.load_device("h100-sxm")
    dev.use_measured_durations = False
    t0 = time.perf_counter()
    unit, params = profile_units(d, heads, seq, vocab, dev)
    profile_s = time.perf_counter() - t0
    names = ["embed"] + ["block"] * layers + ["head"]
    times = [sum(unit[n]) for n in names]
    pbytes = [4 * params[n] for n in names]
    act_bytes = 4 * seq * d  # one sequence's fp32 activation at a stage boundary
    total_params = sum(params[n] for n in names)
    rows = []
    for k in (int(s) for s in args.stages.split(",")):
        sizes = balanced_split(times, k)
        bounds = [sum(sizes[:i]) for i in range(k + 1)]
        groups = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
        m = 2 * k  # micro-batches (sequences) per synchronous step; DDP's global batch
        for link_name, (bw, lat, _) in LINKS.items():
            lk = psim.link(bw, lat)

            def costs(policy):
                out = []
                for g in groups:
                    c = memsched._C.PipelineStageCost()
                    c.forward_us = sum(unit[names[i]][0] for i in g)
                    c.backward_input_us = sum(unit[names[i]][1] for i in g)
                    c.backward_weight_us = sum(unit[names[i]][2] for i in g)
                    pb = sum(pbytes[i] for i in g)
                    c.update_us = psim.UPDATE_PASSES["adamw"] * pb / (dev.hbm_bw_gbps * 1e3)
                    c.policy_us = psim.POLICY_PASSES[policy] * pb / (dev.hbm_bw_gbps * 1e3)
                    c.send_bytes = act_bytes
                    out.append(c)
                out[-1].send_bytes = 0
                return out

            tot = psim.totals(costs("none"))
            ddp = psim.simulate_data_parallel(tot["forward_us"] + tot["backward_us"],
                                              tot["backward_us"],  # hidden behind one micro-batch's backward
                                              tot["update_us"], 4 * total_params, k, m, lk)
            entries = [("DDP", None, 1.0 / ddp.microbatches_per_s * 1e6 if ddp.microbatches_per_s else 0.0, None)]
            for sched in ("gpipe", "1f1b", "zero_bubble"):
                r = psim.simulate(costs("none"), lk, sched, microbatches=m)
                entries.append((sched, "-", r.time_per_microbatch_us, r.bubble_fraction))
            for policy in ("none", "stash", "predict"):
                r = psim.simulate(costs(policy), lk, "async_1f1b")
                entries.append(("async_1f1b", policy, r.time_per_microbatch_us, r.bubble_fraction))
            r = psim.simulate(costs("predict"), lk, "async_1f1b", split_backward=False)
            entries.append(("async_1f1b (dX after dW)", "predict", r.time_per_microbatch_us, r.bubble_fraction))
            base_1f1b = next(e[2] for e in entries if e[0] == "1f1b")
            base_ddp = entries[0][2]
            for name, policy, us, bubble in entries:
                rows.append({"stages": k, "link": link_name, "schedule": name, "policy": policy or "-",
                             "seq_per_s": 1e6 / us if us else 0.0, "vs_ddp": base_ddp / us, "vs_1f1b": base_1f1b / us,
                             "bubble": bubble, "stage_units": sizes, "microbatches": m if name != "DDP" else m})
    print(f"# Simulated throughput, GPT-2-medium-sized decoder ({layers} blocks, d={d}, seq {seq}, vocab {vocab}"
          f"{', --small' if args.small else ''}); {total_params / 1e6:.0f}M parameters, AdamW, fp32\n")
    print("| stages | link | schedule | policy | sequences/s | vs DDP | vs 1F1B | bubble |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        b = "-" if r["bubble"] is None else f"{100 * r['bubble']:.1f}%"
        print(f"| {r['stages']} | {r['link']} | {r['schedule']} | {r['policy']} | {r['seq_per_s']:.1f} | "
              f"{r['vs_ddp']:.2f}x | {r['vs_1f1b']:.2f}x | {b} |")
    print(f"\nAssumptions: one sequence ({seq} tokens) per micro-batch; synchronous schedules and DDP process a global "
          "batch of 2K sequences per step (one update), async_1f1b one sequence per step (one update per "
          "sequence, its optimizer pass counted); op times are the h100-sxm roofline of the profiled ops (FP32, "
          "no tensor cores, no kernel-launch overhead); dW is half of each Linear's backward matrix products; "
          f"stage boundaries carry a {act_bytes / 2**20:g} MiB fp32 activation; links: " +
          "; ".join(f"{n}: {v[2]}" for n, v in LINKS.items()) +
          "; each neighbouring pair has its own link, no contention; DDP: ring all-reduce of fp32 gradients "
          "overlapped with the backward of its micro-batches, every replica holds the whole model (it fits in "
          "80 GB); split points: contiguous units (embedding, 24 blocks, head) balanced by profiled time; "
          "no memory limit is modelled. "
          f"Profile: {PROFILED_BLOCKS} blocks on this CPU in {profile_s:.0f} s.")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "unit_us": unit, "params": params, "links": LINKS}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
