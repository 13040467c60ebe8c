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
  offload_gpt     bench_offload.py --models gpt       (rows, then largest-batch searches, under --time-budget)
  offload_resnet  bench_offload.py --models resnet
  ooo             bench_ooo_gpu.py                    (plain, ooo, ooo_fused, optim_in_bwd: PyTorch's recipe)
  allocator       bench_allocator_gpu.py
  trainer         bench_trainer_gpu.py                (Hugging Face Trainer: plain, gradient_checkpointing,
                                                       MemschedCallback dp/hybrid 50%)
Time: --budget (default 500 s, so under 9 minutes in all) is shared by the parts, in proportion to fixed
weights; time a part leaves unused goes to the parts after it. Each benchmark gets --time-budget a little
under its timeout so it ends on its own with what it measured; at the timeout its process group is killed
and its JSON (rewritten after every row) is still read.
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
WEIGHTS = collections.OrderedDict([("build", 110), ("cuda_tests", 120), ("offload_gpt", 140),
                                   ("offload_resnet", 55), ("ooo", 45), ("allocator", 65), ("trainer", 50)])
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
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        out["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}".split(".")[-1]
        bad = [c for c in case if c.tag in ("failure", "error")]
        if bad:
            kind = "failed" if bad[0].tag == "failure" else "errors"
            out[kind] += 1
            msg = (bad[0].get("message") or (bad[0].text or "")).strip().splitlines()
            out["failures"].append({"test": name, "kind": bad[0].tag, "message": (msg[0] if msg else "")[:300]})
        elif any(c.tag == "skipped" for c in case):
            out["skipped"] += 1
        else:
            out["passed"] += 1
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
            out.append([r["method"], r.get("error") or r.get("skipped") or "?", "", "", "", "", "", ""])
            continue
        ratio = f"{r['step_ms'] / plain['step_ms']:.2f}x" if plain else "-"
        lo, hi = r.get("step_ms_spread") or (None, None)
        step = f"{r['step_ms']:.2f}" + (f" [{lo:.1f}-{hi:.1f}]" if lo is not None else "")
        if r.get("first_step_s") is not None:
            step += f" (first step {r['first_step_s']:.1f} s)"
        out.append([r["method"], step, ratio, fmt_bytes(r.get("peak_bytes")) if gpu else "n/a (CPU)",
                    fmt_bytes(r.get("bytes_moved")),
                    f"{r['sim_step_ms']:.2f}" if r.get("sim_step_ms") is not None else "-",
                    fmt_bytes(r.get("sim_peak_bytes")), r.get("max_batch", "-")])
    title = f"{model_res.get('title', '')}, batch {model_res.get('batch', '?')}"
    return title + "\n\n" + md_table(["method", "step ms [min-max]", "vs plain", "peak alloc", "moved",
                                      "sim step ms", "sim peak", "max batch"], out)


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
            out.append([label, mode, f"{r['median_ms']:.2f}", f"{r['iqr_ms']:.2f}", sp,
                        fmt_bytes(r.get("peak_allocated_bytes")), fmt_bytes(r.get("step_peak_above_resident_bytes")),
                        f"{r['max_abs_param_diff_vs_plain']:.2e}"])
    return md_table(["model", "variant", "median ms", "IQR ms", "speedup vs plain", "peak alloc",
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
          "## Parts", "", md_table(["part", "status", "time", "timeout", "note / log tail"], parts), "",
          "## CUDA tests (`pytest -m requires_cuda tests/python`)", "", tests_md(r.get("cuda_tests")), "",
          "## bench_offload.py: GPT", "", offload_md(r.get("offload", {}).get("gpt"), gpu), "",
          "## bench_offload.py: ResNet-50", "", offload_md(r.get("offload", {}).get("resnet"), gpu), "",
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default: $GPU_CHECK_OUT, else gpu_check_out)")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds for all parts, `env` included (default 500: with the kill grace and start-up "
                         "the whole run stays under 9 minutes)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: same parts with --small sizes on CPU; skips the build unless --build")
    ap.add_argument("--build", action="store_true", help="build even with --cpu-smoke")
    ap.add_argument("--skip-build", action="store_true", help="use the extension already built")
    ap.add_argument("--parts", default=",".join(WEIGHTS), help="comma-separated subset of " + ",".join(WEIGHTS))
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
    unknown = [p for p in parts_wanted if p not in WEIGHTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {list(WEIGHTS)}")
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

    pending = [p for p in WEIGHTS if p in parts_wanted]
    small = ["--small", "--device", "cpu"] if smoke else []

    def timeout_for(name):
        left = deadline - time.monotonic()
        share = left * WEIGHTS[name] / sum(WEIGHTS[p] for p in pending)
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
