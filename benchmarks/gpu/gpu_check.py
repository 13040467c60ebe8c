"""gpu_check.py -- the whole GPU table in one command: build memsched, run the CUDA tests and every GPU
benchmark, each part under its own timeout, and write one markdown file and one JSON.

    make gpu-check GPU_CHECK_OUT=$OUT                # on a bare GPU machine (see README: "On a GPU machine")
    make gpu-check GPU_CHECK_ARGS=--cpu-smoke        # here, without a GPU: same parts, reduced sizes
    python benchmarks/gpu/gpu_check.py [--out DIR] [--budget SECONDS] [--cpu-smoke] [--skip-build|--build]
                                       [--parts build,cuda_tests,...] [--digest]

Parts, in order (a part that fails or runs out of time is recorded with its log tail, and the next runs):
  env             GPU model, driver, torch, CUDA, nvcc, Python (a subprocess: this process never touches CUDA)
  build           MEMSCHED_CMAKE_ARGS=-DMEMSCHED_BUILD_TESTS=OFF MAX_JOBS=16
                  pip install --no-index --no-build-isolation --no-deps -e .   (then `import memsched._C`);
                  needs nlohmann_json: a system package, or the git-ignored third_party/include/nlohmann that
                  `make gpu-check-deps` fills and the device call carries. Skipped by --cpu-smoke (it uses
                  the extension already built here) unless --build.
  cuda_tests      pytest -m requires_cuda tests/python (JUnit XML parsed: counts, failed tests, messages)
  copy            bench_copy_engine.py                (the CopyEngine's GB/s per direction and both at once,
                                                       beside torch's non_blocking copies)
  offload_gpt     bench_offload.py --models gpt       (rows, then largest-batch searches, under --time-budget)
  offload_resnet  bench_offload.py --models resnet
  ooo             bench_ooo_gpu.py                    (plain, ooo, ooo_fused, optim_in_bwd: PyTorch's recipe)
  allocator       bench_allocator_gpu.py
  trainer         bench_trainer_gpu.py                (Hugging Face Trainer: plain, gradient_checkpointing,
                                                       MemschedCallback dp/hybrid 50%)
  stress          tests/python/alloc_stress.py --ops 1000000   (only with --parts naming it: issue 14's 1M
                                                       operations; run it in a second device call with
                                                       --parts stress --budget 500)
Time: --budget (default 500 s, so under 9 minutes in all) is shared by the parts, in proportion to fixed
weights; time a part leaves unused goes to the parts after it. Each benchmark gets --time-budget a little
under its timeout so it ends on its own with what it measured; at the timeout its process group is killed
and its JSON (rewritten after every row) is still read.
Verdicts: gpu_check.md's "## Done when" table and gpu_check.json's "verdicts" list judge every GPU "Done
when" criterion of issues 10, 11, 12, 13, 14 and 17 from the parts' results: issue, criterion, measured,
goal, and "met", "NOT met" or "not measured: <why>" (part failed, row missing, a figure no bench records);
a CPU run judges nothing ("not measured (CPU run)"). See Note [Verdicts].
Output: DIR (--out, else $GPU_CHECK_OUT, else gpu_check_out/) gets gpu_check.md, gpu_check.json and
gpu_check.log (every part's whole output) -- three files, within the device tool's eight. The tree digest
(sha256 of the sources; `--digest` prints it here) ties a result to a checkout where .git did not travel.
Exit status 0 when every part ended ok or skipped, 1 otherwise (the files are written either way).
"""
import argparse
import collections
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "benchmarks", "gpu")
GIB = 2 ** 30

# Share of the budget per part (seconds out of ~500 on an H100: build 31 s measured, the rest estimated
# from the first GPU run's figures; see ../shared/evidence in the project's history).
WEIGHTS = collections.OrderedDict([("build", 110), ("cuda_tests", 120), ("copy", 15), ("offload_gpt", 140),
                                   ("offload_resnet", 55), ("ooo", 45), ("allocator", 65), ("trainer", 50)])
# Parts run only when --parts names them (they take minutes): the 1M-operation allocator stress test of
# issue 14 (tests/python/alloc_stress.py; cuda_tests runs it at 20,000 operations).
OPTIONAL_WEIGHTS = collections.OrderedDict([("stress", 200)])
ALL_WEIGHTS = collections.OrderedDict(list(WEIGHTS.items()) + list(OPTIONAL_WEIGHTS.items()))
# bench_offload rows in order of what the issue asks first, so a short budget drops the least wanted.
OFFLOAD_ORDER = ["plain", "memsched budget None", "torch.compile budget 0.5", "trl OffloadActivations", "offload_all_prefetch",
                 "memsched dp 70%", "memsched dp 50%", "checkpoint", "save_on_cpu", "memsched hybrid 50%",
                 "memsched hybrid 30%", "memsched dp 30%", "memsched greedy 50%"]

PROBE = r"""
import json, os, platform, shutil, subprocess
info = {"python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
        "machine": platform.machine()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=p.total_memory,
                    capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count)
except Exception as e:
    info["torch_error"] = f"{type(e).__name__}: {e}"
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        return None
if shutil.which("nvidia-smi"):
    q = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver"] = q.splitlines()[0] if q else None
nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
if nvcc:
    v = run([nvcc, "--version"])
    info["nvcc"] = v.splitlines()[-2].strip() if v and len(v.splitlines()) >= 2 else v
for mod in ("torchvision", "triton", "psutil", "accelerate", "transformers"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception:
        info[mod] = None
print("PROBE " + json.dumps(info))
"""


# -- helpers ---------------------------------------------------------------------------------------
def say(msg):
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tree_digest(root=ROOT):
    """sha256 over the source files (path and content), the same here and on a copy without .git."""
    h = hashlib.sha256()
    picks = ["CMakeLists.txt", "setup.py", "pyproject.toml", "Makefile"]
    for top in ("csrc", "python/memsched", "benchmarks", "tests"):
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
            for f in sorted(files):
                if f.endswith((".so", ".pyc", ".tmp")) or f.startswith("."):
                    continue
                picks.append(os.path.relpath(os.path.join(d, f), root))
    for rel in picks:
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            h.update(rel.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()[:16]


def git_commit():
    try:
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        if r.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:
        return None


class Runner:
    """Runs one command at a time in its own process group, streaming its output with a prefix to
    stdout and to the log, keeping a tail, killing the group at the timeout."""

    def __init__(self, log, env):
        self.log = log
        self.env = env

    def __call__(self, name, cmd, timeout, extra_env=None):
        env = dict(self.env, **(extra_env or {}))
        tail = collections.deque(maxlen=400)
        shown = " ".join("<probe script>" if "\n" in c else c for c in cmd)
        self.log.write(f"\n===== {name}: {shown} (timeout {timeout:.0f} s)\n")
        self.log.flush()
        say(f"{name}: {shown}  [timeout {timeout:.0f} s]")
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                    errors="replace", bufsize=1)
        except OSError as e:
            return {"rc": None, "timed_out": False, "wall_s": 0.0, "tail": [f"could not start: {e}"]}

        def pump():
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                self.log.write(line + "\n")
                print(f"  [{name}] {line}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            say(f"{name}: timeout after {timeout:.0f} s -- stopping its process group")
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        reader.join(timeout=5)
        wall = time.monotonic() - t0
        self.log.flush()
        return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(wall, 1), "tail": list(tail)}


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def parse_junit(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "outcomes": {}}
    for case in root.iter("testcase"):
        out["tests"] += 1
        # module::test[params]; the split keeps dots inside the parameters ("[0.7-mlp]")
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name', '')}"
        bad = [c for c in case if c.tag in ("failure", "error")]
        if bad:
            kind = "failed" if bad[0].tag == "failure" else "errors"
            out[kind] += 1
            msg = (bad[0].get("message") or (bad[0].text or "")).strip().splitlines()
            out["failures"].append({"test": name, "kind": bad[0].tag, "message": (msg[0] if msg else "")[:300]})
            out["outcomes"][name] = kind
        elif any(c.tag == "skipped" for c in case):
            out["skipped"] += 1
            out["outcomes"][name] = "skipped"
        else:
            out["passed"] += 1
            out["outcomes"][name] = "passed"
    return out


# -- formatting ------------------------------------------------------------------------------------
def fmt_bytes(n):
    if n is None or isinstance(n, str):
        return "-" if n is None else n
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def cell(x):
    return str(x).replace("|", "\\|").replace("\n", " ")


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def offload_md(model_res, gpu):
    if model_res is None:
        return "(no results)"
    if "skipped" in model_res:
        return f"skipped: {model_res['skipped']}"
    rows = model_res.get("rows", [])
    plain = next((r for r in rows if r["method"] == "plain" and "step_ms" in r), None)
    out = []
    for r in rows:
        if "step_ms" not in r:
            out.append([r["method"], r.get("error") or r.get("skipped") or "?", "", "", "", "", "", "", ""])
            continue
        ratio = f"{r['step_ms'] / plain['step_ms']:.2f}x" if plain else "-"
        lo, hi = r.get("step_ms_spread") or (None, None)
        step = f"{r['step_ms']:.2f}" + (f" [{lo:.1f}-{hi:.1f}]" if lo is not None else "")
        if r.get("first_step_s") is not None:
            step += f" (first step {r['first_step_s']:.1f} s)"
        host = f"{r['host_ms']:.2f}" if r.get("host_ms") is not None else "-"
        out.append([r["method"], step, host, ratio, fmt_bytes(r.get("peak_bytes")) if gpu else "n/a (CPU)",
                    fmt_bytes(r.get("bytes_moved")),
                    f"{r['sim_step_ms']:.2f}" if r.get("sim_step_ms") is not None else "-",
                    fmt_bytes(r.get("sim_peak_bytes")), r.get("max_batch", "-")])
    title = f"{model_res.get('title', '')}, batch {model_res.get('batch', '?')}"
    return title + "\n\n" + md_table(["method", "step ms [min-max]", "host ms", "vs plain", "peak alloc", "moved",
                                      "sim step ms", "sim peak", "max batch"], out)


def copy_md(res):
    if not res:
        return "(no results)"
    rows = [[name, f"{r['gbps_median']:.2f}", " ".join(f"{x:.1f}" for x in r.get("gbps_rounds", []))]
            for name, r in res.get("rows", {}).items()]
    return (f"{res.get('count')} x {res.get('mib')} MiB per direction, median of {res.get('rounds')} rounds\n\n" +
            md_table(["copies", "GB/s (median)", "rounds"], rows))


def ooo_md(res):
    if not res:
        return "(no results)"
    out = []
    for label, rows in res.get("models", {}).items():
        for mode in ("plain", "ooo", "ooo_fused", "optim_in_bwd"):
            r = rows.get(mode)
            if r is None:
                continue
            sp = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else ""
            host = f"{r['host_ms']:.2f}" if r.get("host_ms") is not None else "-"
            out.append([label, mode, f"{r['median_ms']:.2f}", host, f"{r['iqr_ms']:.2f}", sp,
                        fmt_bytes(r.get("peak_allocated_bytes")), fmt_bytes(r.get("step_peak_above_resident_bytes")),
                        f"{r['max_abs_param_diff_vs_plain']:.2e}"])
    return md_table(["model", "variant", "median ms", "host ms", "IQR ms", "speedup vs plain", "peak alloc",
                     "step peak above resident", "max abs param diff"], out)


def allocator_md(res):
    if not res:
        return "(no results)"
    rep = [[k.split("/")[0], k.split("/")[1], fmt_bytes(r["live"]), fmt_bytes(r["reserved"]),
            f"{r['reserved'] / r['live']:.3f}" if r.get("live") else "-", fmt_bytes(r["allocated"]),
            f"{r['us_per_alloc']:.2f}"] for k, r in res.get("replay", {}).items()]
    steps = []
    for k, r in res.get("step", {}).items():
        fam, mode = k.split("/")
        native = res["step"].get(f"{fam}/native")
        steps.append([fam, mode, f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}-{r['max_ms']:.2f}",
                      f"{r['median_ms'] / native['median_ms']:.3f}" if native else "-", fmt_bytes(r["reserved"])])
    return ("Replay (2 steps)\n\n" + md_table(["family", "allocator", "trace live", "reserved", "reserved/live",
                                                "allocated", "us/alloc"], rep) +
            "\n\nTraining step\n\n" + md_table(["family", "allocator", "median ms", "min-max ms", "vs native",
                                                 "reserved"], steps))


def trainer_md(res):
    if not res:
        return "(no results)"
    out = []
    for r in res.get("rows", []):
        if "median_ms" not in r:
            out.append([r["row"], r.get("error") or r.get("skipped", ""), "", "", "", "", ""])
            continue
        ms = (f"{r.get('offloaded_bytes_per_step', 0) / GIB:.2f} / {r.get('recomputed_bytes_per_step', 0) / GIB:.2f} GiB"
              if "steps_planned" in r else "")
        out.append([r["row"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}-{r['max_ms']:.1f}",
                    f"{r['vs_plain']:.2f}x" if "vs_plain" in r else "-", fmt_bytes(r.get("peak_allocated_bytes")),
                    f"{r['loss']:.4f}" if r.get("loss") is not None else "-", ms])
    return (f"{res.get('model')}, batch {res.get('batch')}, seq {res.get('seq')}\n\n" +
            md_table(["row", "median ms", "min-max ms", "vs plain", "peak alloc", "loss",
                      "offloaded / recomputed per step"], out))


def tests_md(t):
    if not t:
        return "(no JUnit results)"
    s = (f"{t['tests']} selected: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
         f"{t['skipped']} skipped")
    if t["failures"]:
        s += "\n\n" + md_table(["test", "kind", "message"],
                               [[f["test"], f["kind"], f["message"][:200]] for f in t["failures"]])
    return s


# -- verdicts: the issues' GPU "Done when" criteria, judged from the parts' results ---------------------
# Note [Verdicts]
#   Every value comes from what the parts wrote (bench JSONs, JUnit); nothing is estimated. A criterion is
#   "met" or "NOT met" only when the figures settle it; otherwise "not measured: <why>" (part failed or
#   skipped, row missing or failed, a figure no bench records). A CPU run (--cpu-smoke, or no CUDA
#   device) judges nothing: every verdict is "not measured (CPU run)". A lower bound settles a criterion
#   only in the direction it bounds (max_batch ">= N (time budget)"; copy bytes / whole step time).
MET, NOT_MET = "met", "NOT met"
OFFLOAD_MODELS = ("gpt", "resnet")
PLANNED_PREFIXES = ("memsched", "offload_all_prefetch")  # rows run under memsched.optimize


def _nm(why):
    return "not measured: " + why


def _part_why(report, part):
    p = report.get("parts", {}).get(part)
    if p is None:
        return f"part {part} not run"
    if p.get("status") == "ok":
        return f"part {part} ok but wrote no result"
    return f"part {part} {p.get('status')}" + (f" ({p['note'][:80]})" if p.get("note") else "")


def _combine(pieces):
    """pieces: [(label, measured, verdict)] -> (measured, verdict). NOT met if any is; else not measured
    if any is; else met."""
    measured = "; ".join(f"{lab}: {m}" if lab else m for lab, m, _ in pieces if m) or "-"
    verdicts_ = [v for _, _, v in pieces]
    if any(v == NOT_MET for v in verdicts_):
        return measured, NOT_MET
    missing = [(lab + ": " if lab else "") + v[len("not measured: "):] for lab, _, v in pieces if v != MET]
    if missing or not pieces:
        return measured, _nm("; ".join(missing) or "nothing to judge")
    return measured, MET


def _offload(report, model):
    """({method: row}, None) or (None, why)."""
    res = report.get("results", {}).get("offload", {}).get(model)
    if res is None:
        return None, _part_why(report, "offload_" + model)
    if "skipped" in res:
        return None, f"{model} skipped ({res['skipped'][:80]})"
    return {r["method"]: r for r in res.get("rows", [])}, None


def _measured_row(report, rows, model, method):
    """(row, None) when the row has a step time, else (None, why)."""
    r = rows.get(method)
    if r is None:
        return None, f"row '{method}' missing ({_part_why(report, 'offload_' + model)})"
    if "step_ms" not in r:
        return None, f"row '{method}': {(r.get('error') or r.get('skipped') or 'no step time')[:100]}"
    return r, None


def _per_offload_model(report, judge):
    """judge(rows, model) -> (measured, verdict), for each bench_offload model, combined."""
    pieces = []
    for model in OFFLOAD_MODELS:
        rows, why = _offload(report, model)
        pieces.append((model, "", _nm(why)) if rows is None else (model, *judge(rows, model)))
    return _combine(pieces)


def _ratio_goal(report, method, limit):
    """step time of `method` over plain's, at most `limit`."""
    def judge(rows, model):
        plain, why = _measured_row(report, rows, model, "plain")
        row, why2 = _measured_row(report, rows, model, method)
        if plain is None or row is None:
            return "", _nm(why or why2)
        ratio = row["step_ms"] / plain["step_ms"]
        return f"{ratio:.3f}x ({row['step_ms']:.1f} / {plain['step_ms']:.1f} ms)", MET if ratio <= limit else NOT_MET
    return _per_offload_model(report, judge)


def _gib(n):
    return f"{n / GIB:.2f} GiB"


def _faster_at_no_more_peak(a, b):
    """a faster than b with peak at most b's (rows with step_ms and peak_bytes): (measured, verdict)."""
    if a.get("peak_bytes") is None or b.get("peak_bytes") is None:
        return "", _nm("no peak (not a GPU run)")
    m = (f"{a['step_ms']:.1f} vs {b['step_ms']:.1f} ms, peak {_gib(a['peak_bytes'])} vs {_gib(b['peak_bytes'])}")
    return m, MET if a["step_ms"] < b["step_ms"] and a["peak_bytes"] <= b["peak_bytes"] else NOT_MET


def v10_prefetch_vs_trl(report):
    def judge(rows, model):
        oap, why = _measured_row(report, rows, model, "offload_all_prefetch")
        trl, why2 = _measured_row(report, rows, model, "trl OffloadActivations")
        if oap is None or trl is None:
            return "", _nm(why or why2)
        return _faster_at_no_more_peak(oap, trl)
    return _per_offload_model(report, judge)


def v10_copy_throughput(report):
    """bench_copy_engine.py's medians (the CopyEngine alone, timed by its copies' own events); without
    them, a lower bound from bench_offload: each direction's bytes per step over the whole step's time,
    which settles 'met' when it reaches the goal and nothing below it."""
    copy = report.get("results", {}).get("copy")
    if copy and copy.get("rows"):
        rows = copy["rows"]
        d2h, h2d = rows.get("memsched d2h"), rows.get("memsched h2d")
        if d2h and h2d:
            both = rows.get("memsched both", {}).get("gbps_median")
            torch_d2h = rows.get("torch d2h", {}).get("gbps_median")
            m = (f"d2h {d2h['gbps_median']:.1f}, h2d {h2d['gbps_median']:.1f} GB/s"
                 + (f", both at once {both:.1f}" if both else "")
                 + (f" (torch's own d2h {torch_d2h:.1f})" if torch_d2h else "")
                 + f"; {copy.get('count')} x {copy.get('mib')} MiB")
            return m, MET if min(d2h["gbps_median"], h2d["gbps_median"]) >= 45 else NOT_MET

    def judge(rows, model):
        best = None
        for r in rows.values():
            if r["method"].startswith(PLANNED_PREFIXES) and "step_ms" in r and r.get("d2h_bytes"):
                gbs = min(r["d2h_bytes"], r.get("h2d_bytes") or 0) / (r["step_ms"] / 1e3) / 1e9
                if best is None or gbs > best[0]:
                    best = (gbs, r["method"])
        if best is None:
            return "", _nm("no offloading row with d2h/h2d bytes")
        m = f">= {best[0]:.1f} GB/s per direction ({best[1]}: bytes per step / whole step time)"
        if best[0] >= 45:
            return m, MET
        return m, _nm("that lower bound is under 45 GB/s; the copies' own durations are not recorded "
                      "(StepStats.copies needs optimize(timeline=True))")
    return _per_offload_model(report, judge)


def _junit(report):
    t = report.get("results", {}).get("cuda_tests")
    return t, (None if t else _part_why(report, "cuda_tests") + ": no JUnit results")


def v_cuda_tests_pass(report, must_pass=()):
    t, why = _junit(report)
    if t is None:
        return "-", _nm(why)
    m = f"{t['tests']} selected: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
    outcomes = t.get("outcomes", {})
    named = []
    for name in must_pass:
        got = [o for k, o in outcomes.items() if k.split("::")[-1].split("[")[0] == name]
        named.append((name, got))
        m += f"; {name}: {', '.join(got) or 'not run'}"
    if t["failed"] or t["errors"] or any(g and any(o in ("failed", "errors") for o in g) for _, g in named):
        bad = ", ".join(f["test"] for f in t.get("failures", [])[:5])
        return m + (f" ({bad})" if bad else ""), NOT_MET
    if t["tests"] == 0:
        return m, _nm("no test selected")
    for name, got in named:
        if not got or any(o != "passed" for o in got):
            return m, _nm(f"{name} not passed ({', '.join(got) or 'not in the JUnit results'})")
    if t["skipped"]:
        skipped = [k for k, o in outcomes.items() if o == "skipped"][:5]
        return m, _nm(f"{t['skipped']} skipped, so not every test ran" + (f" ({', '.join(skipped)})" if skipped else ""))
    return m, MET


def v11_keep_all(report):
    pieces = []
    for model in OFFLOAD_MODELS:
        res = report.get("results", {}).get("offload", {}).get(model)
        rows, why = _offload(report, model)
        fid = (res or {}).get("keep_all_fidelity")
        if rows is None:
            pieces.append((model, "", _nm(why)))
        elif not fid:
            pieces.append((model, "", _nm("no keep_all figure (needs plain's measured peak and a memsched row's "
                                          "trace)")))
        else:
            pieces.append((model, f"{fid['ratio']:.3f}x ({_gib(fid['sim_peak_bytes'])} sim vs "
                                  f"{_gib(fid['plain_peak_bytes'])})", MET if abs(fid["ratio"] - 1) <= 0.03 else NOT_MET))
    rows, why = _trainer_rows(report)
    if rows is None:
        pieces.append(("transformers", "", _nm(why)))
    else:
        plain = rows.get("plain")
        traced = next((r for r in rows.values() if r.get("keep_all_sim_peak_bytes")), None)
        if plain is None or plain.get("peak_allocated_bytes") is None or traced is None:
            pieces.append(("transformers", "", _nm("needs plain Trainer's measured peak and a memsched row's "
                                                   "keep_all_sim_peak_bytes")))
        else:
            ratio = traced["keep_all_sim_peak_bytes"] / plain["peak_allocated_bytes"]
            pieces.append(("transformers", f"{ratio:.3f}x", MET if abs(ratio - 1) <= 0.03 else NOT_MET))
    return _combine(pieces)


def _trainer_rows(report):
    res = report.get("results", {}).get("trainer")
    if not res:
        return None, _part_why(report, "trainer")
    return {r["row"]: r for r in res.get("rows", [])}, None


def _within_budget(rows):
    """[(method, peak, budget)] of the measured planned rows with a budget."""
    out = []
    for r in rows:
        name = r.get("method") or r.get("row")
        budget = r.get("budget_with_state_bytes", r.get("budget_bytes"))
        peak = r.get("peak_bytes", r.get("peak_allocated_bytes"))
        if name.startswith(PLANNED_PREFIXES) and budget is not None and peak is not None:
            out.append((name, peak, budget))
    return out


def _gap_summary(row):
    """" (peak in the backward: late release 2.0 GiB, ...)" from a bench row's peak_gap (Note [Where the
    peak went]); "" without one."""
    gap = row.get("peak_gap") or {}
    if not gap.get("categories"):
        return ""
    parts = ", ".join(f"{name} {_gib(n)}" for name, n in gap["categories"].items())
    return f" (peak in the {row.get('peak_phase') or '?'}: {parts})"


def v11_budget_held(report):
    pieces = []
    groups = []
    for model in OFFLOAD_MODELS:
        rows, why = _offload(report, model)
        groups.append((model, None if rows is None else list(rows.values()), why))
    rows, why = _trainer_rows(report)
    groups.append(("transformers", None if rows is None else list(rows.values()), why))
    for label, rows, why in groups:
        if rows is None:
            pieces.append((label, "", _nm(why)))
            continue
        held = _within_budget(rows)
        failed = sum(1 for r in rows if (r.get("method") or r.get("row")).startswith(PLANNED_PREFIXES)
                     and "error" in r)
        if not held:
            pieces.append((label, "", _nm("no planned row with a measured peak and a budget")))
            continue
        worst = max(held, key=lambda x: x[1] / x[2])
        why = {(r.get("method") or r.get("row")): _gap_summary(r) for r in rows}
        over = [n + why.get(n, "") for n, p, b in held if p > 1.02 * b]
        m = (f"{len(held)} rows, worst {worst[0]} {worst[1] / worst[2]:.3f}x its budget"
             + (f", over: {', '.join(over)}" if over else "") + (f" ({failed} planned rows failed)" if failed else ""))
        pieces.append((label, m, NOT_MET if over else MET))
    return _combine(pieces)


def _batch(x):
    """max_batch cell -> (n, exact) or None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x, True
    if isinstance(x, str):
        found = re.match(r">= (\d+)", x)
        if found:
            return int(found.group(1)), False
    return None


def _at_least(cands, ref, factor, strict):
    """cands: [(n, exact)]; ref: (n, exact). Whether some candidate is >= factor * ref (> when strict):
    MET, NOT_MET or None (a lower bound leaves it open)."""
    ok = lambda n: n > factor * ref[0] if strict else n >= factor * ref[0]
    if ref[1] and any(ok(n) for n, _ in cands):
        return MET
    if all(exact for _, exact in cands) and not any(ok(n) for n, _ in cands):
        return NOT_MET
    return None


def v11_largest_batch(report):
    def judge(rows, model):
        plain, ckpt = _batch((rows.get("plain") or {}).get("max_batch")), _batch((rows.get("checkpoint") or {}).get("max_batch"))
        ms = [(r["method"], _batch(r.get("max_batch")), r.get("max_batch_ms_per_sample"))
              for r in rows.values() if r["method"].startswith(PLANNED_PREFIXES)]
        cands = [(name, b, per) for name, b, per in ms if b is not None]
        if plain is None or ckpt is None or not cands:
            what = [n for n, v in (("plain", plain), ("checkpoint", ckpt)) if v is None] + ([] if cands else ["memsched"])
            return "", _nm("no largest batch for " + ", ".join(what))
        best = max(cands, key=lambda c: c[1][0])
        fmt = lambda b: f"{'' if b[1] else '>= '}{b[0]}"
        m = (f"memsched {fmt(best[1])} ({best[0]}" + (f", {best[2]:.1f} ms/sample" if best[2] else "") +
             f"), plain {fmt(plain)}, checkpoint {fmt(ckpt)}")
        a = _at_least([c[1] for c in cands], plain, 2.5, strict=False)
        b = _at_least([c[1] for c in cands], ckpt, 1.0, strict=True)
        if NOT_MET in (a, b):
            return m, NOT_MET
        if a is None or b is None:
            return m, _nm("a lower bound (search cut by the time budget) leaves it open")
        return m, MET
    return _per_offload_model(report, judge)


def v12_hybrid_vs_checkpoint(report):
    def judge(rows, model):
        ckpt, why = _measured_row(report, rows, model, "checkpoint")
        if ckpt is None:
            return "", _nm(why)
        if ckpt.get("peak_bytes") is None:
            return "", _nm("no peak (not a GPU run)")
        hybrids, missing = [], []
        for method in ("memsched hybrid 50%", "memsched hybrid 30%"):
            r, why = _measured_row(report, rows, model, method)
            (hybrids.append(r) if r is not None and r.get("peak_bytes") is not None else missing.append(why or method))
        m = f"checkpoint {ckpt['step_ms']:.1f} ms at {_gib(ckpt['peak_bytes'])}; " + ", ".join(
            f"{r['method'].split()[-1]} {r['step_ms']:.1f} ms at {_gib(r['peak_bytes'])}" for r in hybrids)
        if any(r["peak_bytes"] <= ckpt["peak_bytes"] and r["step_ms"] < ckpt["step_ms"] for r in hybrids):
            return m, MET
        return m, _nm("; ".join(missing)) if missing else NOT_MET
    return _per_offload_model(report, judge)


def _ooo_models(report):
    res = report.get("results", {}).get("ooo")
    if not res or not res.get("models"):
        return None, _part_why(report, "ooo")
    return res["models"], None


def _per_ooo_model(report, judge, only=None):
    models, why = _ooo_models(report)
    if models is None:
        return "-", _nm(why)
    pieces = []
    for label, rows in models.items():
        if only is not None and not only(label):
            continue
        short = label.split(" (")[0].split(" b")[0]
        missing = [m for m in ("plain", "ooo", "ooo_fused", "optim_in_bwd") if m not in rows]
        pieces.append((short, *judge(rows)) if not missing else (short, "", _nm("rows missing: " + ", ".join(missing))))
    return _combine(pieces)


def v13_ooo_speed(limit, only=None):
    def verdict(report):
        def judge(rows):
            s = rows["ooo"]["speedup_vs_plain"]
            return f"{s:.3f}x", MET if s >= limit else NOT_MET
        if only is not None:
            models, why = _ooo_models(report)
            if models is None:
                return "-", _nm(why)
            if not any(only(label) for label in models):
                return "-", _nm("no MobileNetV3-small (torchvision) b32 224px row (" + ", ".join(models) + ")")
        return _per_ooo_model(report, judge, only)
    return verdict


def v13_fused_time(report):
    def judge(rows):
        ratio = rows["ooo_fused"]["median_ms"] / rows["plain"]["median_ms"]
        return f"{ratio:.3f}x plain's time", MET if ratio <= 1.03 else NOT_MET
    return _per_ooo_model(report, judge)


def v13_fused_peak(report):
    def judge(rows):
        plain, fused = rows["plain"], rows["ooo_fused"]
        grads = fused.get("param_grad_bytes")
        if plain.get("step_peak_above_resident_bytes") is None or fused.get("step_peak_above_resident_bytes") is None:
            return "", _nm("no peak (not a GPU run)")
        if not grads:
            return "", _nm("param_grad_bytes not recorded")
        saved = plain["step_peak_above_resident_bytes"] - fused["step_peak_above_resident_bytes"]
        return f"{saved / grads:.2f} of the gradient bytes ({saved / 2**20:.1f} of {grads / 2**20:.1f} MiB)", \
            MET if saved >= 0.7 * grads else NOT_MET
    return _per_ooo_model(report, judge)


def v13_fused_vs_optim_in_bwd(report):
    def judge(rows):
        f, o = rows["ooo_fused"], rows["optim_in_bwd"]
        if f.get("step_peak_above_resident_bytes") is None or o.get("step_peak_above_resident_bytes") is None:
            return "", _nm("no peak (not a GPU run)")
        m = (f"{f['median_ms']:.2f} vs {o['median_ms']:.2f} ms, step peak {f['step_peak_above_resident_bytes'] / 2**20:.1f} "
             f"vs {o['step_peak_above_resident_bytes'] / 2**20:.1f} MiB")
        ok = f["median_ms"] < o["median_ms"] and f["step_peak_above_resident_bytes"] <= o["step_peak_above_resident_bytes"]
        return m, MET if ok else NOT_MET
    return _per_ooo_model(report, judge)


def v14_stress(report):
    s = report.get("results", {}).get("stress")
    if s:
        m = (f"{s.get('ops', 0):,} ops on {s.get('gpu')}: {s.get('busy_reuse', '?')} busy reuses, "
             f"{s.get('canary_errors', '?')} canary errors, {s.get('seconds', '?')} s")
        if s.get("busy_reuse") or s.get("canary_errors"):
            return m, NOT_MET
        if s.get("ops", 0) >= 1_000_000 and s.get("allocator") == "memsched" and not s.get("forget_record_stream"):
            return m, MET
        return m, _nm("fewer than 1,000,000 operations")
    t, why = _junit(report)
    got = "-"
    if t is not None:
        got = ", ".join(o for k, o in t.get("outcomes", {}).items()
                        if k.endswith("test_memsched_never_hands_out_a_block_a_stream_may_still_touch")) or "not run"
        got = f"20,000-op pytest run: {got}"
    return got, _nm("the cuda_tests part runs the stress test at 20,000 operations; the 1M-operation run is "
                    "the optional part `stress` (gpu_check.py --parts stress)")


def _allocator(report):
    res = report.get("results", {}).get("allocator")
    if not res or not res.get("step_ratio"):
        return None, _part_why(report, "allocator") + (": no step ratios" if res else "")
    return res["step_ratio"], None


def v14_step_time(report):
    ratios, why = _allocator(report)
    if ratios is None:
        return "-", _nm(why)
    return _combine([(fam, f"{r['median']:.3f}x [{r['min']:.3f}-{r['max']:.3f}]", MET if r["median"] <= 1.02 else NOT_MET)
                     for fam, r in ratios.items()])


def v14_fragmentation(report):
    ratios, why = _allocator(report)
    if ratios is None:
        return "-", _nm(why)
    pieces = []
    for fam, r in ratios.items():
        frag = r.get("fragmentation") or {}
        if "memsched" not in frag or "native" not in frag:
            pieces.append((fam, "", _nm("no fragmentation figure")))
            continue
        pieces.append((fam, f"{frag['memsched']:.3f} vs native {frag['native']:.3f}",
                       MET if frag["memsched"] <= frag["native"] else NOT_MET))
    return _combine(pieces)


def v17_trainer(report):
    rows, why = _trainer_rows(report)
    if rows is None:
        return "-", _nm(why)
    pieces = []
    for name in ["plain", "checkpointing"] + [n for n in rows if n.startswith("memsched-")]:
        r = rows.get(name)
        if r is None:
            pieces.append((name, "", _nm("row missing")))
        elif "median_ms" not in r:
            bad = r.get("error")
            pieces.append((name, (bad or "")[:80], NOT_MET if bad and name.startswith("memsched-") else
                           _nm((bad or r.get("skipped") or "no figures")[:80])))
        elif r.get("peak_allocated_bytes") is None:
            pieces.append((name, f"{r['median_ms']:.1f} ms", _nm("no peak (not a GPU run)")))
        else:
            extra = f", {r['mismatches']} mismatches" if "mismatches" in r else ""
            pieces.append((name, f"{r['median_ms']:.1f} ms, {_gib(r['peak_allocated_bytes'])}{extra}", MET))
    if not any(n.startswith("memsched-") for n in rows):
        pieces.append(("memsched", "", _nm("no MemschedCallback row")))
    return _combine(pieces)


# (issue, criterion, goal, judge(report) -> (measured, verdict))
CRITERIA = [
    (10, "step time, budget=None vs plain (bench_offload)", "<= 1.02x, every model",
     lambda rep: _ratio_goal(rep, "memsched budget None", 1.02)),
    (10, "step time, dp 70% vs plain", "<= 1.10x, every model", lambda rep: _ratio_goal(rep, "memsched dp 70%", 1.10)),
    (10, "offload_all_prefetch vs TRL OffloadActivations", "faster, at no more peak", v10_prefetch_vs_trl),
    (10, "copy throughput while copies are the bottleneck", ">= 45 GB/s per direction", v10_copy_throughput),
    (10, "CUDA tests pass, test_pinned_pool_on_gpu included", "all pass",
     lambda rep: v_cuda_tests_pass(rep, ("test_pinned_pool_on_gpu",))),
    (11, "keep_all simulated peak vs plain's max_memory_allocated (bench_offload; Trainer's transformers decoder)",
     "within 3%", v11_keep_all),
    (11, "every planned row's measured peak vs its budget (with optimizer state)", "<= budget + 2%", v11_budget_held),
    (11, "largest batch in 16 GiB: memsched vs plain and per-block checkpoint", ">= 2.5x plain's and > checkpoint's",
     v11_largest_batch),
    (12, "step time, hybrid 50% vs plain eager", "<= 1.05x, every model",
     lambda rep: _ratio_goal(rep, "memsched hybrid 50%", 1.05)),
    (12, "step time, hybrid 30% vs plain", "<= 1.20x, every model",
     lambda rep: _ratio_goal(rep, "memsched hybrid 30%", 1.20)),
    (12, "hybrid at <= per-block checkpoint's peak vs checkpoint", "faster", v12_hybrid_vs_checkpoint),
    (13, "ooo speedup vs plain (bench_ooo_gpu)", ">= 1.0x, every model", v13_ooo_speed(1.0)),
    (13, "ooo speedup on MobileNetV3-small b32", ">= 1.05x",
     v13_ooo_speed(1.05, only=lambda label: label.startswith("MobileNetV3-small (torchvision) b32 224px"))),
    (13, "ooo_fused step time vs plain", "<= 1.03x, every model", v13_fused_time),
    (13, "ooo_fused step peak (above resident) below plain's", ">= 0.7 x parameter-gradient bytes", v13_fused_peak),
    (13, "ooo_fused vs PyTorch's optimizer in backward (optim_in_bwd)", "faster, at equal or lower step peak",
     v13_fused_vs_optim_in_bwd),
    (14, "every pytest -m requires_cuda test passes", "all pass", lambda rep: v_cuda_tests_pass(rep)),
    (14, "allocator stress test, 1M operations", "no violation", v14_stress),
    (14, "whole-step time, memsched allocator vs native (bench_allocator_gpu)", "<= 1.02x, every family", v14_step_time),
    (14, "fragmentation (reserved / peak allocated) vs native", "no worse, every family", v14_fragmentation),
    (17, "Trainer + MemschedCallback beside plain and gradient_checkpointing (bench_trainer_gpu)",
     "step time and peak reported for each", v17_trainer),
]


def is_cpu_run(report):
    return str(report.get("mode", "")).startswith("cpu") or not report.get("environment", {}).get("cuda_available")


def verdicts(report):
    """One entry per GPU criterion of issues 10-14 and 17: issue, criterion, measured, goal, verdict.
    See Note [Verdicts]."""
    out = []
    cpu = is_cpu_run(report)
    for issue, criterion, goal, judge in CRITERIA:
        if cpu:
            measured, verdict = "-", "not measured (CPU run)"
        else:
            try:
                measured, verdict = judge(report)
            except Exception as e:  # a result of an unexpected shape: say so, judge the rest
                measured, verdict = "-", _nm(f"could not read the results ({type(e).__name__}: {e})"[:200])
        out.append({"issue": issue, "criterion": criterion, "measured": measured, "goal": goal, "verdict": verdict})
    return out


def verdicts_md(report):
    vs = report.get("verdicts") or verdicts(report)
    env = report.get("environment", {})
    lines = []
    if is_cpu_run(report):
        lines.append("CPU run: no figure here is a GPU figure, so no criterion is judged.")
    elif "H100" not in str(env.get("gpu") or ""):
        lines.append(f"Measured on {env.get('gpu')}; the issues state their goals for an H100.")
    n = collections.Counter("met" if v["verdict"] == MET else "NOT met" if v["verdict"] == NOT_MET
                            else "not measured" for v in vs)
    lines.append(f"{n['met']} met, {n['NOT met']} NOT met, {n['not measured']} not measured "
                 "(CPU criteria of these issues are judged by their own tests, not here).")
    return "\n\n".join(lines) + "\n\n" + md_table(["issue", "criterion", "measured", "goal", "verdict"],
                                                  [[v["issue"], v["criterion"], v["measured"], v["goal"], v["verdict"]]
                                                   for v in vs])


def render_md(report):
    env = report["environment"]
    gpu = bool(env.get("cuda_available"))
    head = [["mode", report["mode"]],
            ["GPU", f"{env.get('gpu') or 'none (CPU: not GPU numbers)'}"
                    + (f", {fmt_bytes(env['gpu_memory_bytes'])}, sm {env.get('capability')}" if gpu else "")],
            ["driver", env.get("driver") or "-"], ["torch", env.get("torch", "?")], ["CUDA (torch)", env.get("cuda")],
            ["nvcc", env.get("nvcc") or "-"], ["Python", env.get("python")],
            ["host", f"{env.get('host')}, {env.get('cpus')} CPUs"],
            ["tree digest", report["tree"]["digest"]], ["git", report["tree"]["git"] or "no .git here"],
            ["started", report["started"]],
            ["wall", f"{report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget"]]
    parts = []
    for name, p in report["parts"].items():
        note = p.get("note", "")
        if p["status"] not in ("ok", "skipped") and p.get("log_tail"):
            note = (note + " -- " if note else "") + " / ".join(x.strip() for x in p["log_tail"][-3:] if x.strip())
        parts.append([name, p["status"], f"{p.get('wall_s', 0):.0f} s",
                      f"{p['timeout_s']:.0f} s" if p.get("timeout_s") else "-", note[:400]])
    r = report["results"]
    md = ["# memsched gpu-check", "", md_table(["", ""], head), "",
          "## Done when", "", verdicts_md(report), "",
          "## Parts", "", md_table(["part", "status", "time", "timeout", "note / log tail"], parts), "",
          "## CUDA tests (`pytest -m requires_cuda tests/python`)", "", tests_md(r.get("cuda_tests")), "",
          "## bench_offload.py: GPT", "", offload_md(r.get("offload", {}).get("gpt"), gpu), "",
          "## bench_offload.py: ResNet-50", "", offload_md(r.get("offload", {}).get("resnet"), gpu), "",
          "## bench_copy_engine.py", "", copy_md(r.get("copy")), "",
          "## bench_ooo_gpu.py", "", ooo_md(r.get("ooo")), "",
          "## bench_allocator_gpu.py", "", allocator_md(r.get("allocator")), "",
          "## bench_trainer_gpu.py", "", trainer_md(r.get("trainer")), ""]
    failed = [(n, p) for n, p in report["parts"].items() if p["status"] not in ("ok", "skipped")]
    if failed:
        md += ["## Log tails of parts that did not end ok", ""]
        for n, p in failed:
            md += [f"### {n} ({p['status']})", "", "```", *p.get("log_tail", [])[-30:], "```", ""]
    return "\n".join(md)


# -- main ------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()) + " Its 'Done when' table "
                                 "judges each GPU criterion of issues 10-14 and 17 (the project's issue tracker): "
                                 "met, NOT met, or not measured with the reason.")
    ap.add_argument("--out", default=None, help="output folder (default: $GPU_CHECK_OUT, else gpu_check_out)")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds for all parts, `env` included (default 500: with the kill grace and start-up "
                         "the whole run stays under 9 minutes)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: same parts with --small sizes on CPU; skips the build unless --build")
    ap.add_argument("--build", action="store_true", help="build even with --cpu-smoke")
    ap.add_argument("--skip-build", action="store_true", help="use the extension already built")
    ap.add_argument("--parts", default=",".join(WEIGHTS),
                    help="comma-separated subset of " + ",".join(ALL_WEIGHTS) + " (default: all but "
                         + ",".join(OPTIONAL_WEIGHTS) + ")")
    ap.add_argument("--jobs", type=int, default=16, help="MAX_JOBS for the build (default 16)")
    ap.add_argument("--digest", action="store_true", help="print the tree digest and exit")
    args = ap.parse_args(argv)
    if args.digest:
        print(tree_digest())
        return 0
    started_wall = time.monotonic()
    out_dir = os.path.abspath(args.out or os.environ.get("GPU_CHECK_OUT") or os.path.join(ROOT, "gpu_check_out"))
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check_")  # part results; not under out_dir: the device tool returns 8 files
    parts_wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts_wanted if p not in ALL_WEIGHTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {list(ALL_WEIGHTS)}")
    smoke = args.cpu_smoke
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.path.join(ROOT, "python") + (os.pathsep + os.environ["PYTHONPATH"]
                                                          if os.environ.get("PYTHONPATH") else ""))
    if "CUDA_HOME" not in env and os.path.isdir("/usr/local/cuda"):
        env["CUDA_HOME"] = "/usr/local/cuda"
    log = open(os.path.join(out_dir, "gpu_check.log"), "w")
    run = Runner(log, env)
    report = {"tool": "memsched gpu-check", "mode": "cpu-smoke (reduced sizes; CPU numbers)" if smoke else "gpu",
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "budget_s": args.budget, "tree": {"digest": tree_digest(), "git": git_commit()},
              "environment": {}, "parts": collections.OrderedDict(), "results": {}}

    def write():
        report["wall_s"] = time.monotonic() - started_wall
        report["verdicts"] = verdicts(report)  # See Note [Verdicts]
        with open(os.path.join(out_dir, "gpu_check.json.tmp"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        os.replace(os.path.join(out_dir, "gpu_check.json.tmp"), os.path.join(out_dir, "gpu_check.json"))
        md = render_md(report)
        with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
            f.write(md + "\n")
        return md

    deadline = started_wall + args.budget
    r = run("env", [py, "-c", PROBE], 60)
    probe = next((json.loads(x[6:]) for x in reversed(r["tail"]) if x.startswith("PROBE ")), None)
    report["environment"] = probe or {"probe_error": " / ".join(r["tail"][-5:])}
    report["parts"]["env"] = {"status": "ok" if probe else "failed", "rc": r["rc"], "wall_s": r["wall_s"],
                              "timeout_s": 60, "log_tail": r["tail"][-60:]}
    gpu = bool(probe and probe.get("cuda_available"))
    if not smoke and not gpu:
        say("no CUDA device visible: the GPU parts will fail or skip; --cpu-smoke is the CPU mode")
    say(f"environment: {json.dumps(report['environment'])}")
    write()

    pending = [p for p in ALL_WEIGHTS if p in parts_wanted]
    small = ["--small", "--device", "cpu"] if smoke else []

    def timeout_for(name):
        left = deadline - time.monotonic()
        share = left * ALL_WEIGHTS[name] / sum(ALL_WEIGHTS[p] for p in pending)
        return max(5.0, share)

    def bench_budget(timeout):  # the benchmark's own budget, so it ends before it is killed
        return max(5.0, 0.85 * timeout - 10.0)

    while pending:
        name = pending[0]
        timeout = timeout_for(name)
        part = {"timeout_s": round(timeout, 1)}
        result_file = os.path.join(work, f"{name}.xml" if name == "cuda_tests" else f"{name}.json")
        cmds, note = [], ""
        if name == "build":
            header = os.path.join(ROOT, "third_party", "include", "nlohmann", "json.hpp")
            if (smoke and not args.build) or args.skip_build:
                part.update(status="skipped", wall_s=0.0,
                            note="uses the extension already built (python/memsched/_C*.so)")
            else:
                if not os.path.exists(header) and not os.path.exists("/usr/include/nlohmann/json.hpp"):
                    note = ("no nlohmann/json.hpp: run `make gpu-check-deps` where there is a network and carry "
                            "third_party")
                cmds = [([py, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps", "-e", "."],
                         {"MEMSCHED_CMAKE_ARGS": "-DMEMSCHED_BUILD_TESTS=OFF", "MAX_JOBS": str(args.jobs)}),
                        ([py, "-c", "import memsched, memsched._C as c; print('memsched._C', c.__file__)"], {})]
        elif name == "cuda_tests":
            # -v: each test's outcome reaches the log as it ends; pytest writes the JUnit file only at the
            # end, so a part stopped at its timeout still shows (log tail, gpu_check.log) what passed.
            cmds = [([py, "-m", "pytest", "-m", "requires_cuda", "tests/python", "-v", "-p", "no:cacheprovider",
                      "-o", "junit_family=xunit1", f"--junitxml={result_file}"], {})]
        elif name in ("offload_gpt", "offload_resnet"):
            model = name.split("_")[1]
            methods = ",".join(OFFLOAD_ORDER)
            cmds = [([py, os.path.join(GPU_DIR, "bench_offload.py"), "--models", model, "--methods", methods,
                      "--out", result_file, "--time-budget", f"{bench_budget(timeout):.0f}"] +
                     (small + ["--steps", "1", "--warmup", "2"] + (["--compile-on-cpu"] if model == "gpt" else [])
                      if smoke else ["--steps", "5", "--warmup", "3"]), {})]
        elif name == "stress":
            cmds = [([py, os.path.join(ROOT, "tests", "python", "alloc_stress.py"), "--ops",
                      "10" if smoke else "1000000"], {})]
        elif name == "copy":
            cmds = [([py, os.path.join(GPU_DIR, "bench_copy_engine.py"), "--out", result_file] +
                     (["--small"] if smoke else []), {})]
        elif name == "ooo":
            cmds = [([py, os.path.join(GPU_DIR, "bench_ooo_gpu.py"), "--out", result_file] +
                     (small + ["--steps", "3", "--warmup", "1", "--batch", "4"] if smoke
                      else ["--steps", "20", "--warmup", "5"]), {})]
        elif name == "allocator":
            cmds = [([py, os.path.join(GPU_DIR, "bench_allocator_gpu.py"), "--out", result_file, "--steps", "10",
                      "--warmup", "3", "--rounds", "2"], {})]
        elif name == "trainer":
            cmds = [([py, os.path.join(GPU_DIR, "bench_trainer_gpu.py"), "--out", result_file,
                      "--time-budget", f"{bench_budget(timeout):.0f}"] +
                     (small + ["--steps", "2", "--warmup", "2"] if smoke else ["--steps", "8", "--warmup", "3"]), {})]
        tails, wall, status = [], 0.0, "ok"
        for cmd, extra in cmds:
            r = run(name, cmd, max(1.0, timeout - wall), extra)
            tails += r["tail"]
            wall += r["wall_s"]
            part.setdefault("commands", []).append({"command": " ".join(cmd), "env": extra, "rc": r["rc"],
                                                    "wall_s": r["wall_s"]})
            if r["timed_out"]:
                status = f"timeout after {timeout:.0f} s (what it wrote is kept)"
                break
            if r["rc"] != 0:
                status = f"failed (rc {r['rc']})"
                break
        if cmds:
            part.update(status=status, wall_s=round(wall, 1), log_tail=tails[-60:])
        if note:
            part["note"] = note
        # results
        if name == "cuda_tests":
            t = parse_junit(result_file)
            report["results"]["cuda_tests"] = t
            if t:
                part["note"] = f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
        elif name.startswith("offload_"):
            res = read_json(result_file)
            model = name.split("_")[1]
            if res:
                report["results"].setdefault("offload", {})[model] = res.get("models", {}).get(model)
                report["results"].setdefault("offload_env", res.get("environment"))
                rows = (res.get("models", {}).get(model) or {}).get("rows", [])
                bad = sum(1 for x in rows if "error" in x)
                skipped = sum(1 for x in rows if "skipped" in x)
                part["note"] = f"{len(rows)} rows: {bad} failed, {skipped} skipped"
                if "skipped" in (res.get("models", {}).get(model) or {}):
                    part["note"] = res["models"][model]["skipped"]
        elif name == "stress":
            # alloc_stress.py prints its JSON summary as its last line (none without a GPU: exit 2)
            summary = next((x for x in reversed(tails) if x.strip().startswith("{")), None)
            try:
                report["results"]["stress"] = json.loads(summary) if summary else None
            except ValueError:
                report["results"]["stress"] = None
            if smoke and status != "ok":
                part.update(status="skipped", note="needs a CUDA device")
        elif name == "copy":
            report["results"]["copy"] = read_json(result_file)
        elif name == "ooo":
            report["results"]["ooo"] = read_json(result_file)
        elif name == "trainer":
            report["results"]["trainer"] = read_json(result_file)
        elif name == "allocator":
            res = read_json(result_file)
            report["results"]["allocator"] = res
            if res is None and status == "ok":
                part["status"] = "skipped"
                part["note"] = tails[-1] if tails else "no output"
        if name in ("ooo", "trainer") and status == "ok" and report["results"].get(name) is None:
            part["status"] = "failed (no JSON)"
        report["parts"][name] = part
        say(f"{name}: {part['status']}" + (f" -- {part['note']}" if part.get("note") else "")
            + f" ({part.get('wall_s', 0):.0f} s)")
        pending.pop(0)
        write()

    md = write()
    log.close()
    print("\n" + md, flush=True)
    say(f"wrote {out_dir}/gpu_check.md, gpu_check.json, gpu_check.log in {report['wall_s']:.0f} s")
    ok = all(p["status"] in ("ok", "skipped") for p in report["parts"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
