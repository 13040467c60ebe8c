"""bench_trainer_gpu.py -- memsched inside the Hugging Face Trainer, beside what Trainer users pick instead.

    python benchmarks/gpu/bench_trainer_gpu.py                        # GPU: GPT-2-medium-sized decoder, b8, bf16
    python benchmarks/gpu/bench_trainer_gpu.py --small --device cpu   # reduced sizes on CPU (smoke test only)
    options: --rows plain,checkpointing,memsched-dp-50%,memsched-hybrid-50%  --batch 8  --seq 1024
             --steps 10 --warmup 3  --out FILE.json  --time-budget SECONDS

Model: transformers' GPT2LMHeadModel built from a config (no weights, no download): GPT-2-medium's shape
(24 layers, d=1024, 16 heads, vocab 50257) at sequence 1024, batch 8, bf16 autocast (TrainingArguments
bf16=True), AdamW, random tokens. --small: 2 layers, d=64, sequence 64, batch 4, fp32, on CPU.
Rows, each a fresh model from the same seed trained by the same Trainer arguments:
  plain                   Trainer as is
  checkpointing           TrainingArguments(gradient_checkpointing=True): the flag Trainer users reach for
  memsched-<planner>-<P>  callbacks=[memsched.integrations.transformers.MemschedCallback(budget=P/100,
                          planner=<planner>)]: the first step is profiled, later steps run the plan
Columns: median step time [min-max] over --steps after --warmup (a timing callback synchronises the GPU
at each step's start and end, the same for every row), its ratio to plain, peak allocated memory over the
timed steps (torch.cuda.max_memory_allocated, reset after the warmup), the last logged loss, and for the
memsched rows the run's planned/measured figures (steps planned, mismatches, bytes offloaded and recomputed
per step, the budget with optimizer state, and keep_all's simulated peak on the run's trace). Rows run
one after another in one process; a row that fails (out of memory) is recorded with its error and the
next runs. A CPU run prints CPU numbers and says so.
"""
import argparse
import faulthandler
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

faulthandler.enable()  # a crash (a segfault in the extension) names its Python frame in the log
ROWS = ("plain", "checkpointing", "memsched-dp-50%", "memsched-hybrid-50%")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _config(transformers, small, seq):
    if small:
        return transformers.GPT2Config(vocab_size=512, n_positions=seq, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(vocab_size=50257, n_positions=seq, n_embd=1024, n_layer=24, n_head=16,
                                   bos_token_id=0, eos_token_id=0)


def _step_timer(transformers, device):
    class StepTimer(transformers.TrainerCallback):
        """Wall time of each optimizer step, the GPU synchronised at its start and end."""

        def __init__(self):
            self.times, self.t0 = [], None

        def _sync(self):
            if device == "cuda":
                torch.cuda.synchronize()

        def on_step_begin(self, args, state, control, **kw):
            self._sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self._sync()
            self.times.append(time.perf_counter() - self.t0)

    return StepTimer()


def _peak_reset(transformers, device, warmup):
    class PeakReset(transformers.TrainerCallback):
        """Reset the peak-memory counter once the warmup steps are done."""

        def on_step_begin(self, args, state, control, **kw):
            if device == "cuda" and state.global_step == warmup:
                torch.cuda.reset_peak_memory_stats()

    return PeakReset()


def run_row(row, args, transformers):
    import memsched
    from memsched.integrations.transformers import MemschedCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config(transformers, args.small, args.seq))
    if args.device == "cuda":
        model = model.cuda()
    steps = args.warmup + args.steps
    targs = dict(output_dir=os.path.join(args.tmp, row), per_device_train_batch_size=args.batch, max_steps=steps,
                 learning_rate=1e-4, weight_decay=0.1, report_to=[], logging_steps=steps, save_strategy="no", seed=0,
                 disable_tqdm=True, dataloader_num_workers=0, use_cpu=args.device == "cpu",
                 bf16=args.device == "cuda" and not args.small)
    if row == "checkpointing":
        targs["gradient_checkpointing"] = True
    timer = _step_timer(transformers, args.device)
    callbacks = [timer, _peak_reset(transformers, args.device, args.warmup)]
    ms_cb = None
    if row.startswith("memsched-"):
        _, planner, pct = row.split("-")
        ms_cb = MemschedCallback(budget=float(pct.rstrip("%")) / 100, planner=planner)
        callbacks.insert(0, ms_cb)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**targs),
                                   train_dataset=Tokens(args.batch * steps, args.seq, model.config.vocab_size),
                                   callbacks=callbacks)
    trainer.train()
    timed = timer.times[args.warmup:]
    out = {"row": row, "median_ms": statistics.median(timed) * 1e3, "min_ms": min(timed) * 1e3,
           "max_ms": max(timed) * 1e3, "steps_timed": len(timed),
           "loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None)}
    if args.device == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if ms_cb is not None and ms_cb.run is not None:
        run = ms_cb.run
        planned = [s for s in run.step_stats if s.mode == "planned"]
        out.update(steps_planned=len(planned), mismatches=sum(1 for s in run.step_stats if s.mode == "diverged"),
                   offloaded_bytes_per_step=statistics.median(s.offloaded_bytes for s in planned) if planned else 0,
                   recomputed_bytes_per_step=statistics.median(s.recomputed_bytes for s in planned) if planned else 0,
                   planned=run.planned_figures())
        # issue 11 on a transformers decoder: the budget the measured peak is held to (with the optimizer
        # state the profiled step did not hold), and keep_all's simulated peak on this run's trace, to set
        # against plain Trainer's measured peak
        out["budget_with_state_bytes"] = run._budget_with_state()
        if run.trace is not None:
            keep_all = memsched.simulate(run.trace, memsched.plan(run.trace, planner="keep_all"))
            out["keep_all_sim_peak_bytes"] = keep_all.peak_bytes + run.optimizer_state_extra_
    del trainer, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true", help="reduced sizes (CPU smoke test)")
    ap.add_argument("--batch", type=int, default=None, help="per-device batch (default 8; --small 4)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; --small 64)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the profiled step among them)")
    ap.add_argument("--out", default=None, help="JSON file for the results (rewritten after every row)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: rows not started when it is spent are recorded as skipped")
    ap.add_argument("--tmp", default=None, help="Trainer output_dir root (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible; use --device cpu (with --small)")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ROWS and not (r.startswith("memsched-") and len(r.split("-")) == 3 and r.endswith("%")):
            ap.error(f"--rows: unknown row {r!r}; choose from {', '.join(ROWS)} or memsched-<planner>-<P>%")
    if args.warmup < 2:
        ap.error("--warmup: at least 2 (memsched profiles the first step and plans at its end)")
    args.batch = args.batch or (4 if args.small else 8)
    args.seq = args.seq or (64 if args.small else 1024)
    try:
        import transformers
    except ImportError:
        print("bench_trainer_gpu: transformers is not installed; nothing to measure")
        return 0
    import tempfile
    args.tmp = args.tmp or tempfile.mkdtemp(prefix="bench_trainer_")
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (not GPU numbers)",
           "cuda": torch.version.cuda}
    result = {"environment": env, "model": "GPT-2-medium-sized decoder" if not args.small else "tiny GPT-2",
              "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "rows": []}
    started = time.monotonic()

    def write():
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=2, default=str)
            os.replace(args.out + ".tmp", args.out)

    for row in rows:
        if args.time_budget is not None and time.monotonic() - started > args.time_budget:
            result["rows"].append({"row": row, "skipped": "time budget spent"})
            write()
            continue
        try:
            r = run_row(row, args, transformers)
        except Exception as e:  # noqa: BLE001 -- recorded per row (out of memory, a refusal), the next runs
            r = {"row": row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        result["rows"].append(r)
        write()
    plain = next((r for r in result["rows"] if r["row"] == "plain" and "median_ms" in r), None)
    print(f"Trainer, {result['model']}, batch {args.batch}, seq {args.seq}, {env['device']}, torch {env['torch']}")
    for r in result["rows"]:
        if "median_ms" not in r:
            print(f"  {r['row']:24s} {r.get('error') or r.get('skipped')}")
            continue
        if plain is not None:
            r["vs_plain"] = r["median_ms"] / plain["median_ms"]
        peak = f"{r['peak_allocated_bytes'] / 2**30:.2f} GiB" if "peak_allocated_bytes" in r else "-"
        ratio = f"{r['vs_plain']:.2f}x" if "vs_plain" in r else "-"
        print(f"  {r['row']:24s} {r['median_ms']:9.1f} ms [{r['min_ms']:.1f}-{r['max_ms']:.1f}] {ratio:>7s}  "
              f"peak {peak:>10s}  loss {r['loss']}")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
