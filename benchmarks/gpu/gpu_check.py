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
  cuda_tests      pytest -m requires_cuda tests/python  (one process; each test's outcome recorded as it ends,
                                                       so a test that crashes the process is recorded as
                                                       crashed, with its innermost Python frame, and the
                                                       tests after it run in a new process: Note [CUDA
                                                       tests that crash])
  copy            bench_copy_engine.py                (the CopyEngine's GB/s per direction and both at once,
                                                       beside torch's non_blocking copies)
  offload_gpt     bench_offload.py --models gpt       (rows in OFFLOAD_ORDER, then largest-batch searches,
                                                       under --time-budget; torch.compile only where the
                                                       budget holds its ~57 s)
  offload_resnet  bench_offload.py --models resnet
  ooo             bench_ooo_gpu.py                    (plain, ooo, ooo_fused, optim_in_bwd: PyTorch's recipe)
  allocator       bench_allocator_gpu.py              (step rounds first, every family's round 0 before round 1)
  trainer         bench_trainer_gpu.py                (Hugging Face Trainer: plain, gradient_checkpointing,
                                                       MemschedCallback dp/hybrid 50%)
  stress          tests/python/alloc_stress.py --ops 1000000   (only with --parts naming it: issue 14's 1M
                                                       operations; run it in a second device call with
                                                       --parts stress --budget 500)
Time: --budget (default 460 s, so under 9 minutes in all with the kill graces) is shared by the parts, in
proportion to fixed weights (WEIGHTS: sized from the H100 run's times); time a part leaves unused goes to the
parts after it. Each benchmark gets --time-budget a little under its timeout so it ends on its own with what
it measured; at the timeout its process group is killed and its JSON (rewritten after every row) is still
read. A benchmark row or CUDA test that kills its process (a segfault) is recorded as crashed, with the
Python frame faulthandler printed, and the rows or tests after it run in a new process.
Verdicts: gpu_check.md's "## Done when" table and gpu_check.json's "verdicts" list judge every GPU "Done
when" criterion of issues 10, 11, 12, 13, 14 and 17 from the parts' results: issue, criterion, measured,
goal, and "met", "NOT met" or "not measured: <why>" (part failed, row missing, a figure no bench records);
a CPU run judges nothing ("not measured (CPU run)"). See Note [Verdicts].
Output: DIR (--out, else $GPU_CHECK_OUT, else gpu_check_out/) gets gpu_check.md, gpu_check.json and
gpu_check.log (every part's whole output) -- three files, within the device tool's eight -- and,
when a process died of a signal, crash_inputs.tar.gz: the planning input it had in flight (Note [A crash's
planning input comes back]). The tree digest
(sha256 of the sources; `--digest` prints it here) ties a result to a checkout where .git did not travel.
Exit status 0 when every part ended ok or skipped, 1 otherwise (the files are written either way).
"""
import argparse
import collections
import datetime
import hashlib
import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "benchmarks", "gpu")
GIB = 2 ** 30

# Share of the budget per part, in seconds of the default 460 s budget (`env`'s 60 s timeout comes first and
# is not shared). Time a part leaves unused goes to the parts after it, in these proportions. Sized from the
# H100 run of 2026-11-28 (torch 2.11, bare machine): env 18 s; build 69 s (pip 65 s, import 4 s); cuda_tests
# ~120-150 s in one pytest process (collection ~20 s; test_alloc_install's fresh processes alone ~45 s);
# copy ~8 s once its sources are made on the GPU; offload_gpt ~12 s start-up + rows (plain 4.3, budget None
# 1.6, dp 70% 3.9, checkpoint 1.2, dp 50% 5.2, offload_all_prefetch 12.6, TRL 8.5, save_on_cpu 5.9 s;
# torch.compile 57 s, see OFFLOAD_EST_S); offload_resnet ~10 s start-up + ~2 s a row; ooo 16 s; allocator
# ~10 s per worker process (6 per round, so its --time-budget keeps round 0 of every family first);
# trainer ~15 s start-up + ~12 s a row (a GPT-2-medium built on the CPU per row). Everything wanted does
# not fit 460 s: the order below is the priority, and a part that runs out of time keeps what it wrote.
WEIGHTS = collections.OrderedDict([("build", 85), ("cuda_tests", 135), ("copy", 12), ("offload_gpt", 70),
                                   ("offload_resnet", 38), ("ooo", 18), ("allocator", 58), ("trainer", 44)])
DEFAULT_BUDGET_S = 460.0
# Parts run only when --parts names them (they take minutes): the 1M-operation allocator stress test of
# issue 14 (tests/python/alloc_stress.py; cuda_tests runs it at 20,000 operations).
OPTIONAL_WEIGHTS = collections.OrderedDict([("stress", 200)])
ALL_WEIGHTS = collections.OrderedDict(list(WEIGHTS.items()) + list(OPTIONAL_WEIGHTS.items()))
# Rows of the GPT table that run one more, untimed step recorded by the CUDA allocator, to name what the
# planned steps hold beyond their plan (Note [Where a planned step's extra memory was allocated] in
# peak_snapshot.py; the first H100 run's dp rows: ~650 MiB "not in the profiled step").
PEAK_SNAPSHOT_ROWS = ("memsched budget None", "memsched dp 70%")
# bench_offload rows in order of what the issues ask first, so a short budget drops the least wanted: plain
# and the overhead rows (issue 10), checkpoint (issue 12's reference), the hybrid rows (issue 12), dp 50%
# (issue 11's budget, issue 10's copy bound), then the slow peers: offload_all_prefetch and TRL (issue
# 10's prefetch-vs-TRL criterion, ~21 s together on the H100), dp 30% / greedy, save_on_cpu (no
# criterion), and torch.compile last (no criterion; ~57 s of compilation on the H100, which stalled both
# offload parts of the first run: see OFFLOAD_EST_S).
OFFLOAD_ORDER = ["plain", "memsched budget None", "memsched dp 70%", "checkpoint", "memsched hybrid 50%",
                 "memsched hybrid 30%", "memsched dp 50%", "offload_all_prefetch", "trl OffloadActivations",
                 "memsched dp 30%", "memsched greedy 50%", "save_on_cpu", "torch.compile budget 0.5"]
COMPILE_ROW = "torch.compile budget 0.5"
# Seconds per bench_offload row on the H100 (measured 2026-11-28 where given; the others are guesses of the
# same size as their neighbours), with "startup" the process's own (imports, measure_device). bench_offload
# checks its --time-budget only before a row starts, so a row that takes a minute started late runs past
# the part's timeout; gpu_check therefore passes the torch.compile row only when the bench's budget holds
# every row's estimate with it (a second device call with `--parts offload_gpt,offload_resnet --budget 400`
# runs it), and records it as skipped otherwise.
OFFLOAD_EST_S = {
    "gpt": {"startup": 12, "plain": 4.3, "memsched budget None": 1.6, "memsched dp 70%": 3.9, "checkpoint": 1.2,
            "memsched hybrid 50%": 6, "memsched hybrid 30%": 6, "memsched dp 50%": 5.2, "offload_all_prefetch": 12.6,
            "trl OffloadActivations": 8.5, "memsched dp 30%": 6, "memsched greedy 50%": 6, "save_on_cpu": 5.9,
            COMPILE_ROW: 57},
    "resnet": {"startup": 10, "plain": 1.7, "memsched budget None": 0.9, COMPILE_ROW: 50},  # others: 3 s each
    # --cpu-smoke's reduced sizes on a 2-core CPU: rows ~1 s; inductor took over 2 minutes for the compile row
    "cpu-smoke": {"startup": 5, "default": 1, COMPILE_ROW: 150},
}
# bench_trainer_gpu.py's rows, in the order they run (passed as --rows, so a resumed run knows the rest)
TRAINER_ROWS = ("plain", "checkpointing", "memsched-dp-50%", "memsched-hybrid-50%")
# pytest-timeout (where installed): a CUDA test that runs longer than this is ended (its stacks dumped) and
# counted as crashed, and the tests after it run on (Note [CUDA tests that crash]).
CUDA_TEST_TIMEOUT_S = 90

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

    def __init__(self, log, env, dump_root=None):
        self.log = log
        self.env = env
        self.dump_root = dump_root  # Note [A crash's planning input comes back]; None: no dumps
        self.calls = 0

    def __call__(self, name, cmd, timeout, extra_env=None):
        env = dict(self.env, **(extra_env or {}))
        self.calls += 1
        dumps = None
        if self.dump_root is not None:
            dumps = os.path.join(self.dump_root, "all", f"{name}.{self.calls}")
            env["MEMSCHED_PLAN_DUMP_DIR"] = dumps
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
        out = {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(wall, 1), "tail": list(tail)}
        if dumps is not None:
            kept = keep_crash_input(dumps, os.path.join(self.dump_root, "kept", f"{name}.{self.calls}"),
                                    proc.returncode)
            if kept:
                out["crash_input"] = kept
                self.log.write(f"(kept the planning input of the crashed process: {kept})\n")
        return out


# Note [A crash's planning input comes back]
#   The H100 run of 2026-11-28 crashed in the planner (SIGSEGV in _C.make_plan) on traces only a GPU makes;
#   no CPU trace reproduced it. Every process a part runs gets its own MEMSCHED_PLAN_DUMP_DIR (Note
#   [Planning inputs kept for a crash] in python/memsched/planning.py): plan() writes its inputs there
#   before planning. When the process dies of a signal the newest pair -- the call in flight, if the
#   crash was in the planner -- is kept; otherwise the folder goes. The kept inputs come back as one file,
#   crash_inputs.tar.gz, and `memsched.planning.replay_planning_input(path)` plans them again anywhere.
def keep_crash_input(dumps, keep, rc):
    """Move the newest planning input in `dumps` to `keep` if the process died of a signal (rc < 0);
    remove `dumps`. Returns the kept spec's path relative to the kept root, or None."""
    import shutil
    kept = None
    try:
        if rc is not None and rc < 0 and os.path.isdir(dumps):
            specs = sorted(f for f in os.listdir(dumps) if f.startswith("plan-") and f.endswith(".json")
                           and not f.endswith(".trace.json"))
            if specs:
                newest = max(specs, key=lambda f: os.path.getmtime(os.path.join(dumps, f)))
                os.makedirs(keep, exist_ok=True)
                for f in (newest, newest[:-len(".json")] + ".trace.json"):
                    if os.path.exists(os.path.join(dumps, f)):
                        shutil.copy2(os.path.join(dumps, f), os.path.join(keep, f))
                kept = os.path.join(os.path.basename(keep), newest)
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    return kept


def pack_crash_inputs(dump_root, out_dir, limit_bytes=15 << 20):
    """crash_inputs.tar.gz in out_dir from the kept planning inputs; returns its name, or why not."""
    import tarfile
    kept = os.path.join(dump_root, "kept")
    if not os.path.isdir(kept) or not os.listdir(kept):
        return None
    path = os.path.join(out_dir, "crash_inputs.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(kept, arcname="crash_inputs")
    if os.path.getsize(path) > limit_bytes:
        os.remove(path)
        return f"not written: the kept inputs compress to over {limit_bytes >> 20} MiB (the device tool's limit)"
    return "crash_inputs.tar.gz"


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# -- parts that keep going after a crash ------------------------------------------------------------
# Note [CUDA tests that crash]
#   The H100 run of 2026-11-28 ran `pytest -m requires_cuda tests/python` as one process; a planner
#   segfault in the 13th of 56 tests killed it, and pytest writes its JUnit file only at its end, so no
#   result came back at all. One process per test file would survive that, but pays Python's, torch's and
#   memsched's start-up (~4-5 s on that machine) per file: 295 s for all files, far over the part's share.
#   So the tests still run in one process, with a small plugin (RECORDER, written into the work folder and
#   loaded with -p) that appends each test's start and each phase's outcome to a JSON-lines file as they
#   happen, a line at a time: a crash loses nothing that ended. When the process ends with a test started
#   and not ended, that test is recorded as crashed, with the signal and faulthandler's innermost Python
#   frame (pytest enables faulthandler; PYTHONFAULTHANDLER is set too), and a new process runs the collected
#   tests that have no result yet: their files, the others deselected by exact node id through the same
#   plugin (pytest's --deselect matches prefixes: test_a would take test_ab with it). That repeats after
#   each crash while the part's time lasts. A test still running when the part's time ends, and every test
#   after it, is "not run". Where pytest-timeout is installed, a test that hangs past CUDA_TEST_TIMEOUT_S is
#   ended by it (thread method: it dumps the stacks and exits the process), which counts as that test's
#   crash, and the rest go on.
RECORDER = '''"""gpu_check.py's pytest plugin (Note [CUDA tests that crash] in benchmarks/gpu/gpu_check.py): each
test's start and each phase's outcome, one JSON line each, written as it happens."""
import json
import os

import pytest

_out = open(os.environ["GPU_CHECK_RECORD"], "a", buffering=1)
_skip = set()
if os.environ.get("GPU_CHECK_DESELECT"):
    with open(os.environ["GPU_CHECK_DESELECT"]) as f:
        _skip = set(json.load(f))


def _write(**kw):
    _out.write(json.dumps(kw) + "\\n")
    _out.flush()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    drop = [item for item in items if item.nodeid in _skip]
    if drop:
        items[:] = [item for item in items if item.nodeid not in _skip]
        config.hook.pytest_deselected(items=drop)


def pytest_collection_finish(session):
    _write(collected=[item.nodeid for item in session.items], rootdir=str(session.config.rootpath))


def pytest_runtest_logstart(nodeid, location):
    _write(start=nodeid)


def _message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:  # a skip: (path, line, reason)
        return str(report.longrepr[2])
    text = str(report.longrepr or "").strip().splitlines()
    return text[-1] if text else ""


def pytest_runtest_logreport(report):
    _write(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
           message="" if report.outcome == "passed" else _message(report)[:500])


def pytest_runtest_logfinish(nodeid, location):
    _write(finish=nodeid)
'''
RECORDER_MODULE = "gpu_check_recorder"


def offload_methods(model, budget_s, smoke=False):
    """OFFLOAD_ORDER for bench_offload's --methods, less the torch.compile row where the bench's budget
    cannot hold it after the other rows' estimates (OFFLOAD_EST_S: the H100's, or --cpu-smoke's). Returns
    (methods, [(method, why)] of the rows left out), the latter recorded as skipped rows."""
    est = OFFLOAD_EST_S["cpu-smoke"] if smoke else OFFLOAD_EST_S.get(model, {})
    others = est.get("startup", 10) + sum(est.get(m, est.get("default", 3)) for m in OFFLOAD_ORDER if m != COMPILE_ROW)
    compile_s = est.get(COMPILE_ROW, 60)
    if budget_s >= others + compile_s:
        return list(OFFLOAD_ORDER), []
    why = (f"skipped: not started: its compilation takes ~{compile_s} s {'on this CPU' if smoke else 'on an H100'}, "
           f"past this part's {budget_s:.0f} s once the other rows (~{others:.0f} s) ran; "
           f"`gpu_check.py --parts offload_{model} --budget {max(400, int(2 * (others + compile_s)) + 60)}` runs it")
    return [m for m in OFFLOAD_ORDER if m != COMPILE_ROW], [(COMPILE_ROW, why)]


def keep_all_fidelity(rows):
    """bench_offload.py's keep_all_fidelity (issue 11's first figure), for rows whose process did not reach
    its end (killed at the timeout, or resumed after a crash): keep_all's simulated peak from a memsched
    row's trace against plain's measured max_memory_allocated; None without both."""
    plain = next((r for r in rows if r.get("method") == "plain" and r.get("peak_bytes")), None)
    traced = next((r for r in rows if r.get("keep_all_sim_peak_bytes")), None)
    if plain is None or traced is None:
        return None
    sim, measured = traced["keep_all_sim_peak_bytes"], plain["peak_bytes"]
    return {"sim_peak_bytes": sim, "plain_peak_bytes": measured, "ratio": sim / measured, "trace_of": traced["method"],
            "line": f"keep_all simulated peak ({traced['method']}'s trace) {fmt_bytes(sim)} vs plain's measured "
                    f"{fmt_bytes(measured)}: {sim / measured:.3f}x (goal within 3%; computed by gpu_check)"}


def read_jsonl(path):
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line cut by the crash
                    pass
    except OSError:
        pass
    return out


def short_test_name(nodeid):
    """'tests/python/x/test_mod.py::test_f[p]' -> 'test_mod::test_f[p]'; in a class: 'TestC::test_f' (the
    names the JUnit file's classname gave before: its last dotted part, then the test)."""
    parts = nodeid.split("::")
    if len(parts) > 2:
        return f"{parts[-2]}::{parts[-1]}"
    return f"{os.path.splitext(os.path.basename(parts[0]))[0]}::{parts[-1]}"


def describe_exit(rc):
    if rc is None:
        return "did not start"
    if rc < 0:
        try:
            return f"rc {rc}, {signal.Signals(-rc).name}"
        except ValueError:
            return f"rc {rc}"
    return f"rc {rc}"


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')


def crash_frame(tail):
    """The innermost Python frame of the last crash in a log tail: faulthandler's first frame under "Current
    thread ... (most recent call first)", else pytest-timeout's last frame of the main thread's stack;
    'python/memsched/planning.py:262 in plan' (paths under the checkout relative to it), or None."""
    def fmt(m):
        path = m.group("path")
        if path.startswith(ROOT + os.sep):
            path = os.path.relpath(path, ROOT)
        return f"{path}:{m.group('line')} in {m.group('func')}"

    for i in range(len(tail) - 1, -1, -1):
        if tail[i].startswith("Current thread") and "most recent call first" in tail[i]:
            for line in tail[i + 1:]:
                m = _FRAME.search(line)
                if m:
                    return fmt(m)
                if not line.strip():
                    break
            return None
    for i in range(len(tail) - 1, -1, -1):  # pytest-timeout: "~~~ Stack of MainThread (...) ~~~", innermost last
        if "Stack of MainThread" in tail[i]:
            found = None
            for line in tail[i + 1:]:
                if line.startswith(("~", "+")):
                    break
                found = _FRAME.search(line) or found
            return fmt(found) if found else None
    return None


def crash_summary(tail, rc):
    """'Fatal Python error: Segmentation fault; rc -11, SIGSEGV in python/memsched/planning.py:262 in plan'."""
    what = describe_exit(rc)
    if any("+ Timeout +" in x for x in tail):
        what += ", ended by pytest-timeout"
    # pytest -v prints the test's name first, on the same line
    fatal = next((x[x.index("Fatal Python error"):].strip() for x in reversed(tail) if "Fatal Python error" in x), None)
    frame = crash_frame(tail)
    return (f"{fatal}; " if fatal else "") + what + (f" in {frame}" if frame else "")


def _test_outcome(phases):
    """(kind, message) of one test from its phases' reports [(when, outcome, message)], counted as the
    JUnit file counted them: a failed call 'failed', a failed setup or teardown 'errors', a skip or an
    xfail 'skipped'."""
    for when, outcome, message in phases:
        if outcome == "failed":
            return ("failed", message) if when == "call" else ("errors", f"{when}: {message}")
    for when, outcome, message in phases:
        if outcome == "skipped":
            return "skipped", message
    return "passed", ""


def summarize_tests(order, results, crashes, processes, not_run_why):
    """The cuda_tests result: counts, failures (failed, errors, crashed), each test's outcome, the crashes
    and the processes."""
    out = {"tests": len(order), "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "crashed": 0, "not_run": 0,
           "failures": [], "outcomes": {}, "crashes": crashes, "processes": processes}
    for nodeid in order:
        name = short_test_name(nodeid)
        kind, message = results.get(nodeid, ("not run", ""))
        out[kind.replace(" ", "_")] += 1
        out["outcomes"][name] = kind
        if kind in ("failed", "errors", "crashed"):
            out["failures"].append({"test": name, "kind": {"failed": "failure", "errors": "error"}.get(kind, kind),
                                    "message": message[:300]})
    if out["not_run"]:
        out["not_run_why"] = not_run_why or "not reached"
    return out


# Note [A crash's C++ frames]
#   faulthandler names the Python frame of a segfault (planning.py:262 in plan, on the H100), not the C++
#   one; the GPU image has no gdb, but cuda-gdb debugs host code too. The first test that crashes is run
#   once more, alone, under `cuda-gdb -batch` (when it is on PATH and the part has 90 s left), and the
#   native backtrace of the faulting thread (and the first frames of every thread) goes into the part's
#   crash record and gpu_check.md. A test that does not crash again under the debugger says so.
_GDB_FRAME = re.compile(r"^#\d+\s")


def native_backtrace(run, name, py, nodeid, left, pythonpath, needed_s=90.0):
    """The C++ backtrace of `nodeid` crashing again under cuda-gdb: a list of frame lines, or a one-line
    reason in a list when there is none (no debugger, no time, no crash)."""
    import shutil
    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return ["no backtrace: cuda-gdb is not on PATH"]
    if left < needed_s:
        return [f"no backtrace: {left:.0f} s left in the part, under the {needed_s:.0f} s a debugger run takes"]
    cmd = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "set print thread-events off",
           "-ex", "set cuda break_on_launch none", "-ex", "run", "-ex", "bt 40", "-ex", "thread apply all bt 6",
           "--args", py, "-m", "pytest", nodeid, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    r = run(f"{name}-gdb", cmd, min(left - 10.0, 150.0), {"PYTHONPATH": pythonpath})
    tail = r["tail"]
    signalled = next((i for i, x in enumerate(tail) if "received signal" in x), None)
    if signalled is None:
        return [f"no backtrace: the test did not crash again under cuda-gdb (rc {r['rc']}"
                + (", timed out" if r["timed_out"] else "") + ")"]
    frames = [x for x in tail[signalled:] if _GDB_FRAME.match(x)]
    return [tail[signalled].strip()] + frames[:60]


def run_pytest_part(run, name, py, targets, timeout, work, marker="requires_cuda", test_timeout=None):
    """Run `pytest [-m marker] targets` so that a test that kills its process costs that test only (Note
    [CUDA tests that crash]). Returns (result or None when nothing was collected, part fields: status,
    wall_s, commands, log_tail)."""
    started = time.monotonic()
    plugin_dir = os.path.join(work, "pytest_plugin")
    os.makedirs(plugin_dir, exist_ok=True)
    with open(os.path.join(plugin_dir, RECORDER_MODULE + ".py"), "w") as f:
        f.write(RECORDER)
    pythonpath = os.pathsep.join(x for x in (plugin_dir, run.env.get("PYTHONPATH")) if x)
    order, rootdir, results, crashes, processes, commands, tails = None, None, {}, [], [], [], []
    args, deselect, status, not_run_why = list(targets), [], "ok", None
    for k in itertools.count():
        left = timeout - (time.monotonic() - started)
        if left < 5:
            status = f"timeout after {timeout:.0f} s (the tests that ended are kept)"
            not_run_why = "the part's time ran out before they started"
            break
        record = os.path.join(work, f"{name}.{k}.jsonl")
        extra = {"GPU_CHECK_RECORD": record, "PYTHONPATH": pythonpath, "PYTHONFAULTHANDLER": "1"}
        if deselect:
            extra["GPU_CHECK_DESELECT"] = os.path.join(work, f"{name}.{k}.deselect.json")
            with open(extra["GPU_CHECK_DESELECT"], "w") as f:
                json.dump(deselect, f)
        cmd = ([py, "-m", "pytest", *args, "-v", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", RECORDER_MODULE]
               + (["-m", marker] if marker else [])
               + ([f"--timeout={test_timeout:.0f}", "--timeout-method=thread"] if test_timeout else []))
        r = run(name, cmd, left, extra)
        tails += r["tail"]
        processes.append({"command": " ".join(cmd) + (f" ({len(deselect)} deselected by node id)" if deselect else ""),
                          "env": {}, "rc": r["rc"], "wall_s": r["wall_s"]})
        phases, running = collections.defaultdict(list), []
        for ev in read_jsonl(record):
            if "collected" in ev:
                if k == 0:
                    order, rootdir = ev["collected"], ev.get("rootdir")
            elif "start" in ev:
                running.append(ev["start"])
            elif "finish" in ev:
                if ev["finish"] in running:
                    running.remove(ev["finish"])
                results[ev["finish"]] = _test_outcome(phases.pop(ev["finish"], []))
            elif "nodeid" in ev:
                phases[ev["nodeid"]].append((ev["when"], ev["outcome"], ev.get("message", "")))
        if order is None:
            status = (f"timeout after {timeout:.0f} s" if r["timed_out"] else f"failed ({describe_exit(r['rc'])})") \
                + ": pytest ended before its collection did" \
                + (f" ({crash_summary(r['tail'], r['rc'])})" if (r["rc"] or 0) < 0 else "")
            break
        if r["timed_out"]:
            status = f"timeout after {timeout:.0f} s (the tests that ended are kept)"
            not_run_why = (f"the part's time ran out while {short_test_name(running[-1])} ran" if running
                           else "the part's time ran out")
            break
        if not running:  # pytest ended on its own: 0 all passed, 1 some failed, 5 none selected
            if r["rc"] not in (0, 1, 5):
                where = "after its last test" if any(ev.get("start") for ev in read_jsonl(record)) else \
                    "before its first test"
                status = f"failed ({describe_exit(r['rc'])}" + (
                    f": {crash_summary(r['tail'], r['rc'])}, {where})" if (r["rc"] or 0) < 0 else ")")
            break
        nodeid = running[-1]
        why = crash_summary(r["tail"], r["rc"])
        ended = [w for w, _, _ in phases.get(nodeid, [])]  # the phases that reported before the crash
        during = "teardown" if "call" in ended else "call" if "setup" in ended else "setup"
        results[nodeid] = ("crashed", f"the test process died in the test's {during} ({why})")
        crash = {"test": short_test_name(nodeid), "nodeid": nodeid, "rc": r["rc"], "frame": crash_frame(r["tail"]),
                 "summary": why, "input": r.get("crash_input")}
        if not crashes:  # the first crash only: a debugger run costs a minute (Note [A crash's C++ frames])
            left = timeout - (time.monotonic() - started)
            crash["backtrace"] = native_backtrace(run, name, py, os.path.join(rootdir, nodeid) if rootdir else nodeid,
                                                  left, pythonpath)
        crashes.append(crash)
        rest = [n for n in order if n not in results]
        say(f"{name}: {short_test_name(nodeid)} crashed ({why})"
            + (f"; the {len(rest)} tests without a result run in a new process" if rest else ""))
        if not rest:
            break
        files = list(collections.OrderedDict.fromkeys(n.split("::")[0] for n in rest))
        args = [os.path.join(rootdir, f) if rootdir else f for f in files]
        deselect = [n for n in order if n in results and n.split("::")[0] in files]
    result = summarize_tests(order, results, crashes, processes, not_run_why) if order is not None else None
    if result and status == "ok" and (result["failed"] or result["errors"] or result["crashed"]):
        status = "failed (" + ", ".join(f"{result[k]} {k}" for k in ("failed", "errors", "crashed") if result[k]) + ")"
    part = {"status": status, "wall_s": round(time.monotonic() - started, 1), "commands": processes,
            "log_tail": tails[-60:]}
    return result, part


def run_resumable(run, name, items, make_cmd, result_file, rows_of, key, timeout, empty, min_restart_s=20.0):
    """Run a benchmark that rewrites its JSON after every row (bench_offload, bench_trainer_gpu) so that a row
    that kills its process (a signal: a segfault in the extension) costs that row only: the row it was running
    (the first of `items` with no row written) is recorded with the error 'crashed: ...' and faulthandler's
    innermost frame, and a new process runs the rows after it while at least min_restart_s of the part's
    time is left. make_cmd(items, out_file, seconds_left) -> argv; rows_of(result) -> its list of rows (dicts
    keyed by `key`), which later processes' rows are appended to; empty() -> a result with no rows, for a
    process that died before it wrote one. Returns (merged result or None, part fields: status, wall_s,
    commands, log_tail)."""
    started = time.monotonic()
    todo, merged, commands, tails, crashed, status = list(items), None, [], [], [], None
    for k in itertools.count():
        left = timeout - (time.monotonic() - started)
        out = result_file if k == 0 else f"{result_file}.{k}"
        if os.path.exists(out):  # never read an earlier run's rows as this one's
            os.remove(out)
        cmd = make_cmd(todo, out, left)
        r = run(name, cmd, left)
        tails += r["tail"]
        commands.append({"command": " ".join(cmd), "env": {}, "rc": r["rc"], "wall_s": r["wall_s"]})
        res = read_json(out)
        done = {row.get(key) for row in (rows_of(res) if res else [])}
        if merged is None:
            merged = res
        elif res is not None:
            rows_of(merged).extend(rows_of(res))
        if r["timed_out"]:
            status = f"timeout after {timeout:.0f} s (what it wrote is kept)"
            break
        if r["rc"] is None or r["rc"] >= 0:
            status = None if r["rc"] == 0 else f"failed ({describe_exit(r['rc'])})"
            break
        why = crash_summary(r["tail"], r["rc"])
        rest = [m for m in todo if m not in done]
        if not rest:  # after its last row: in a largest-batch search, or at the exit
            status = f"failed ({why}, after its last row)"
            break
        if merged is None:  # before it wrote its first row
            merged = empty()
        row, todo = rest[0], rest[1:]
        rows_of(merged).append({key: row, "error": f"crashed: the process died ({why})"})
        crashed.append(f"{describe_exit(r['rc'])} in row '{row}'")
        if not todo:
            break
        if timeout - (time.monotonic() - started) < min_restart_s:
            for m in todo:
                rows_of(merged).append({key: m, "skipped": f"skipped: not run, the process crashed in '{row}' "
                                                           "with too little time left to start another"})
            break
        say(f"{name}: row '{row}' crashed ({why}); the rows after it run in a new process")
    if crashed:
        status = f"failed ({'; '.join(crashed)}" + (f"; then {status}" if status else "") + ")"
    part = {"status": status or "ok", "wall_s": round(time.monotonic() - started, 1), "commands": commands,
            "log_tail": tails[-60:]}
    return merged, part


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
    extra = "".join(f"\n\n{title}:\n\n" + "\n".join(f"- {cell(x.splitlines()[0] if x else x)[:300]}" for x in res[key])
                    for key, title in (("errors", "Workers that failed"), ("skipped", "Workers not started (time budget)"))
                    if res.get(key))
    return ("Training step\n\n" + md_table(["family", "allocator", "median ms", "min-max ms", "vs native",
                                               "reserved"], steps) +
            "\n\nReplay (2 steps)\n\n" + md_table(["family", "allocator", "trace live", "reserved", "reserved/live",
                                                    "allocated", "us/alloc"], rep) + extra)


def trainer_md(res):
    if not res:
        return "(no results)"
    out = []
    plain = next((r for r in res.get("rows", []) if r["row"] == "plain" and "median_ms" in r), None)
    for r in res.get("rows", []):
        if "median_ms" not in r:
            out.append([r["row"], r.get("error") or r.get("skipped", ""), "", "", "", "", ""])
            continue
        ms = (f"{r.get('offloaded_bytes_per_step', 0) / GIB:.2f} / {r.get('recomputed_bytes_per_step', 0) / GIB:.2f} GiB"
              if "steps_planned" in r else "")
        # the bench adds vs_plain at its end, which a crashed or resumed run does not reach
        vs = r.get("vs_plain", r["median_ms"] / plain["median_ms"] if plain else None)
        out.append([r["row"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}-{r['max_ms']:.1f}",
                    f"{vs:.2f}x" if vs is not None else "-", fmt_bytes(r.get("peak_allocated_bytes")),
                    f"{r['loss']:.4f}" if r.get("loss") is not None else "-", ms])
    return (f"{res.get('model')}, batch {res.get('batch')}, seq {res.get('seq')}\n\n" +
            md_table(["row", "median ms", "min-max ms", "vs plain", "peak alloc", "loss",
                      "offloaded / recomputed per step"], out))


def tests_md(t):
    if not t:
        return "(no test results)"
    s = (f"{t['tests']} selected: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
         f"{t['skipped']} skipped" + (f", {t['crashed']} crashed" if t.get("crashed") else "")
         + (f", {t['not_run']} not run ({t.get('not_run_why', '')})" if t.get("not_run") else ""))
    if len(t.get("processes") or []) > 1:
        s += f"; {len(t['processes'])} pytest processes (a new one after each crash)"
    if t.get("crashes"):
        s += "\n\nCrashed (the test that was running when its process died):\n\n" + md_table(
            ["test", "how", "innermost Python frame", "planning input in flight"],
            [[c["test"], describe_exit(c.get("rc")), c.get("frame") or "-", c.get("input") or "-"]
             for c in t["crashes"]])
        for c in t["crashes"]:
            if c.get("backtrace"):  # Note [A crash's C++ frames]
                s += (f"\n\nNative backtrace of {c['test']} (cuda-gdb):\n\n```\n" + "\n".join(c["backtrace"])
                      + "\n```")
    if t["failures"]:
        s += "\n\n" + md_table(["test", "kind", "message"],
                               [[f["test"], f["kind"], f["message"][:200]] for f in t["failures"]])
    return s


# -- verdicts: the issues' GPU "Done when" criteria, judged from the parts' results ---------------------
# Note [Verdicts]
#   Every value comes from what the parts wrote (bench JSONs, the tests' recorder); nothing is estimated. A
#   criterion is "met" or "NOT met" only when the figures settle it; otherwise "not measured: <why>" (part
#   failed or skipped, row missing or failed, a figure no bench records). A CUDA test that crashed its
#   process counts as failed (Note [CUDA tests that crash]); tests the part's time did not reach leave "all
#   pass" open. A CPU run (--cpu-smoke, or no CUDA device) judges nothing: every verdict is "not measured
#   (CPU run)". A lower bound settles a criterion only in the direction it bounds (max_batch ">= N (time
#   budget)"; copy bytes / whole step time).
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


def _tests(report):
    t = report.get("results", {}).get("cuda_tests")
    return t, (None if t else _part_why(report, "cuda_tests") + ": no test results")


def v_cuda_tests_pass(report, must_pass=()):
    t, why = _tests(report)
    if t is None:
        return "-", _nm(why)
    m = (f"{t['tests']} selected: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
         + (f", {t['crashed']} crashed" if t.get("crashed") else "") + (f", {t['not_run']} not run" if t.get("not_run") else ""))
    outcomes = t.get("outcomes", {})
    named = []
    for name in must_pass:
        got = [o for k, o in outcomes.items() if k.split("::")[-1].split("[")[0] == name]
        named.append((name, got))
        m += f"; {name}: {', '.join(got) or 'not run'}"
    bad_kinds = ("failed", "errors", "crashed")
    if t["failed"] or t["errors"] or t.get("crashed") or any(g and any(o in bad_kinds for o in g) for _, g in named):
        bad = ", ".join(f["test"] + (" (crashed)" if f["kind"] == "crashed" else "") for f in t.get("failures", [])[:5])
        return m + (f" ({bad})" if bad else ""), NOT_MET
    if t["tests"] == 0:
        return m, _nm("no test selected")
    if t.get("not_run"):
        return m, _nm(f"{t['not_run']} not run ({t.get('not_run_why') or 'not reached'})")
    for name, got in named:
        if not got or any(o != "passed" for o in got):
            return m, _nm(f"{name} not passed ({', '.join(got) or 'not in the test results'})")
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
    t, why = _tests(report)
    got = "-"
    if t is not None:
        got = ", ".join(o for k, o in t.get("outcomes", {}).items()
                        if k.endswith("test_memsched_never_hands_out_a_block_a_stream_may_still_touch")) or "not run"
        got = f"20,000-op pytest run: {got}"
    return got, _nm("the cuda_tests part runs the stress test at 20,000 operations; the 1M-operation run is "
                    "the optional part `stress` (gpu_check.py --parts stress)")


ALLOCATOR_FAMILIES = ("transformer", "cnn", "mlp")  # bench_allocator_gpu.py's, where its JSON does not list them


def _allocator(report):
    res = report.get("results", {}).get("allocator")
    if not res or not res.get("step_ratio"):
        return None, _part_why(report, "allocator") + (": no step ratios" if res else "")
    return res["step_ratio"], None


def _allocator_missing(report, ratios):
    """[(family, '', not measured)] for each family with no paired step round (time budget, failed worker)."""
    res = report.get("results", {}).get("allocator") or {}
    families = (res.get("env") or {}).get("families") or ALLOCATOR_FAMILIES
    return [(fam, "", _nm(f"no paired native/memsched step round ({_part_why(report, 'allocator')})"))
            for fam in families if fam not in ratios]


def v14_step_time(report):
    ratios, why = _allocator(report)
    if ratios is None:
        return "-", _nm(why)
    return _combine([(fam, f"{r['median']:.3f}x [{r['min']:.3f}-{r['max']:.3f}]" + (
        f" over {r['rounds']} rounds" if "rounds" in r else ""), MET if r["median"] <= 1.02 else NOT_MET)
        for fam, r in ratios.items()] + _allocator_missing(report, ratios))


def v14_fragmentation(report):
    ratios, why = _allocator(report)
    if ratios is None:
        return "-", _nm(why)
    pieces = _allocator_missing(report, ratios)
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
    if report.get("crash_inputs"):  # Note [A crash's planning input comes back]
        head.append(["planning inputs of crashed processes", report["crash_inputs"]])
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
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for all parts, `env` included (default {DEFAULT_BUDGET_S:.0f}: with the kill grace "
                         "and start-up the whole run stays within a device call's 10 minutes)")
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
    # PYTHONFAULTHANDLER: a part's Python process that dies of a signal prints its Python frames (its log tail
    # and the part's note then name them: crash_summary)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.path.join(ROOT, "python") + (os.pathsep + os.environ["PYTHONPATH"]
                                                          if os.environ.get("PYTHONPATH") else ""))
    if "CUDA_HOME" not in env and os.path.isdir("/usr/local/cuda"):
        env["CUDA_HOME"] = "/usr/local/cuda"
    log = open(os.path.join(out_dir, "gpu_check.log"), "w")
    run = Runner(log, env, dump_root=os.path.join(work, "plan_dumps"))
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

    def bench_budget(timeout, strict=False):
        """The benchmark's own --time-budget, so that it ends before it is killed: bench_offload and
        bench_trainer_gpu check theirs only before a row starts, so a row started just before it runs on
        (their slowest rows but torch.compile's take ~13 s on the H100: 15 s, or 15% of a longer timeout);
        bench_allocator_gpu stops its worker at its budget and bench_copy_engine's rounds take a second, so
        those (strict) end within a few seconds of theirs (6 s)."""
        return max(5.0, timeout - (6.0 if strict else max(15.0, 0.15 * timeout)))

    while pending:
        name = pending[0]
        timeout = timeout_for(name)
        part = {"timeout_s": round(timeout, 1)}
        result_file = os.path.join(work, f"{name}.json")
        cmds, note, ran = [], "", None
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
            # See Note [CUDA tests that crash]: one process, a crashed test recorded and the rest resumed.
            has_timeout_plugin = importlib.util.find_spec("pytest_timeout") is not None
            results, ran = run_pytest_part(run, name, py, ["tests/python"], timeout, work,
                                           test_timeout=CUDA_TEST_TIMEOUT_S if has_timeout_plugin else None)
            report["results"]["cuda_tests"] = results
            if results:
                part["note"] = (f"{results['passed']} passed, {results['failed']} failed, {results['errors']} errors, "
                                f"{results['skipped']} skipped" + (f", {results['crashed']} crashed" if results["crashed"] else "")
                                + (f", {results['not_run']} not run" if results["not_run"] else "")
                                + (f" ({len(ran['commands'])} pytest processes)" if len(ran["commands"]) > 1 else ""))
        elif name in ("offload_gpt", "offload_resnet"):
            model = name.split("_")[1]
            methods, dropped = offload_methods(model, bench_budget(timeout), smoke)
            fixed = (small + ["--steps", "1", "--warmup", "2"] + (["--compile-on-cpu"] if model == "gpt" else [])
                     if smoke else ["--steps", "5", "--warmup", "3"])
            res, ran = run_resumable(
                run, name, methods,
                lambda todo, out, left: [py, os.path.join(GPU_DIR, "bench_offload.py"), "--models", model,
                                         "--methods", ",".join(todo), "--out", out,
                                         "--time-budget", f"{bench_budget(left):.0f}"] + fixed
                + (["--peak-snapshot", ",".join(m for m in PEAK_SNAPSHOT_ROWS if m in todo)]
                   if model == "gpt" and any(m in todo for m in PEAK_SNAPSHOT_ROWS) else []),
                result_file, lambda r: r["models"][model]["rows"] if "rows" in r.get("models", {}).get(model, {})
                else [], "method", timeout,
                empty=lambda: {"models": {model: {"title": f"{model} (its process died before its first row)",
                                                  "batch": "?", "rows": []}}})
            mres = (res or {}).get("models", {}).get(model)
            if mres is not None and "rows" in mres:
                mres["rows"] += [{"method": m, "skipped": why} for m, why in dropped]
                if not mres.get("keep_all_fidelity"):  # the bench computes it at its end, which a kill never reaches
                    fid = keep_all_fidelity(mres["rows"])
                    if fid:
                        mres["keep_all_fidelity"] = fid
            if res:
                report["results"].setdefault("offload", {})[model] = mres
                report["results"].setdefault("offload_env", res.get("environment"))
                rows = (mres or {}).get("rows", [])
                bad = sum(1 for x in rows if "error" in x)
                skipped = sum(1 for x in rows if "skipped" in x)
                part["note"] = f"{len(rows)} rows: {bad} failed, {skipped} skipped"
                if "skipped" in (mres or {}):
                    part["note"] = mres["skipped"]
        elif name == "trainer":
            rows = list(TRAINER_ROWS)
            fixed = small + ["--steps", "2", "--warmup", "2"] if smoke else ["--steps", "6", "--warmup", "3"]
            res, ran = run_resumable(
                run, name, rows,
                lambda todo, out, left: [py, os.path.join(GPU_DIR, "bench_trainer_gpu.py"), "--rows", ",".join(todo),
                                         "--out", out, "--time-budget", f"{bench_budget(left):.0f}"] + fixed,
                result_file, lambda r: r.setdefault("rows", []), "row", timeout, empty=lambda: {"rows": []})
            report["results"]["trainer"] = res
            if res is None and ran["status"] == "ok" and any("transformers is not installed" in x for x in ran["log_tail"]):
                ran["status"], part["note"] = "skipped", "transformers is not installed"
        elif name == "stress":
            cmds = [([py, os.path.join(ROOT, "tests", "python", "alloc_stress.py"), "--ops",
                      "10" if smoke else "1000000"], {})]
        elif name == "copy":
            cmds = [([py, os.path.join(GPU_DIR, "bench_copy_engine.py"), "--out", result_file,
                      "--time-budget", f"{bench_budget(timeout, strict=True):.0f}"] + (["--small"] if smoke else []), {})]
        elif name == "ooo":
            cmds = [([py, os.path.join(GPU_DIR, "bench_ooo_gpu.py"), "--out", result_file] +
                     (small + ["--steps", "3", "--warmup", "1", "--batch", "4"] if smoke
                      else ["--steps", "20", "--warmup", "5"]), {})]
        elif name == "allocator":
            cmds = [([py, os.path.join(GPU_DIR, "bench_allocator_gpu.py"), "--out", result_file, "--steps", "10",
                      "--warmup", "3", "--rounds", "2", "--time-budget", f"{bench_budget(timeout, strict=True):.0f}"], {})]
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
                status = f"failed ({describe_exit(r['rc'])})"
                if r["rc"] is not None and r["rc"] < 0:
                    part["note"] = crash_summary(r["tail"], r["rc"])
                break
        if cmds:
            part.update(status=status, wall_s=round(wall, 1), log_tail=tails[-60:])
        if ran is not None:
            tails, status = ran["log_tail"], ran["status"]
            part.update(ran)
        if note:
            part["note"] = note
        # results
        if name == "stress":
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
        elif name == "allocator":
            res = read_json(result_file)
            report["results"]["allocator"] = res
            if res is None and status == "ok":
                part["status"] = "skipped"
                part["note"] = tails[-1] if tails else "no output"
            elif res:
                part["note"] = (f"step ratios for {len(res.get('step_ratio', {}))} families"
                                + (f"; {len(res['errors'])} workers failed" if res.get("errors") else "")
                                + (f"; {len(res['skipped'])} not started (time budget)" if res.get("skipped") else ""))
        if name in ("ooo", "trainer", "copy") and part["status"] == "ok" and report["results"].get(name) is None:
            part["status"] = "failed (no JSON)"
        report["parts"][name] = part
        say(f"{name}: {part['status']}" + (f" -- {part['note']}" if part.get("note") else "")
            + f" ({part.get('wall_s', 0):.0f} s)")
        pending.pop(0)
        write()

    packed = pack_crash_inputs(run.dump_root, out_dir)
    if packed:
        report["crash_inputs"] = packed  # Note [A crash's planning input comes back]
        say(f"planning inputs of crashed processes: {packed}")
    md = write()
    log.close()
    print("\n" + md, flush=True)
    say(f"wrote {out_dir}/gpu_check.md, gpu_check.json, gpu_check.log in {report['wall_s']:.0f} s")
    ok = all(p["status"] in ("ok", "skipped") for p in report["parts"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
