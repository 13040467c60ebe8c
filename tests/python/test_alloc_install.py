"""memsched.allocator.install(): each case runs in a fresh subprocess, because
installing a process-wide CUDA allocator cannot be undone.

On a CPU-only machine: the shim library loads and exports its entry points,
install() refuses with a clear error, and the "too late" message names the fix.
With a GPU (requires_cuda): CUDA tensors come from memsched, statistics track
them, record_stream delays reuse, empty_cache reaches memsched, snapshots load.
"""
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import memsched
from memsched import allocator


def run_python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_shim_loads_and_exports_its_entry_points():
    lib = ctypes.CDLL(allocator.shim_path())
    for name in ("memsched_malloc", "memsched_free", "memsched_record_stream", "memsched_empty_cache",
                 "memsched_state_json", "memsched_record_history", "memsched_reset_peak_stats",
                 "memsched_num_devices_used", "memsched_last_error", "memsched_check_invariants",
                 "memsched_hook_calls", "memsched_last_error_is_oom",
                 "memsched_report_malloc_errors_to_stderr"):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value, name
    lib.memsched_built_with_cuda.restype = ctypes.c_int
    assert lib.memsched_built_with_cuda() == int(memsched._C.built_with_cuda)


def test_shim_malloc_without_gpu_returns_null_and_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = run_python("""
        import ctypes
        from memsched import allocator
        lib = allocator._load_shim()
        assert lib.memsched_malloc(4096, 0, None) is None
        print(lib.memsched_last_error().decode())
        assert lib.memsched_state_json(0, 0, None, 0) == 0   # no pool was created
    """)
    assert r.returncode == 0, r.stderr
    assert "device 0 does not exist (0 CUDA devices visible)" in r.stdout, r.stdout


def test_install_without_cuda_raises_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = run_python("""
        import memsched
        try:
            memsched.allocator.install()
        except memsched.MemschedError as e:
            print("ERR", e)
        else:
            print("installed")
        import torch
        assert not memsched.allocator.is_installed()
        assert not torch.cuda.is_initialized()
    """)
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "no CUDA device is available" in r.stdout, r.stdout
    assert "HostTensorPool" in r.stdout


def test_hooks_are_wired_into_a_real_pluggable_allocator():
    # What install() does after change_current_allocator, done by hand so it
    # also runs without a GPU: torch's allocator object gets memsched's
    # record_stream and empty_cache hooks, and torch's emptyCache reaches them.
    if not memsched._C._pluggable_hooks_supported():
        pytest.skip("built without torch's CUDA libraries")
    r = run_python("""
        import ctypes, torch, memsched
        from memsched import allocator, _C
        try:
            _C._install_pluggable_hooks(1, 1)
        except memsched.MemschedError as e:
            print("BEFORE", e)
        a = torch.cuda.memory.CUDAPluggableAllocator(allocator.shim_path(), "memsched_malloc", "memsched_free")
        torch.cuda.memory.change_current_allocator(a)
        shim = allocator._load_shim()
        addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
        _C._install_pluggable_hooks(addr(shim.memsched_record_stream), addr(shim.memsched_empty_cache))
        assert allocator.hook_calls() == {"record_stream": 0, "empty_cache": 0}
        torch._C._cuda_emptyCache()
        torch._C._cuda_emptyCache()
        print("CALLS", allocator.hook_calls())
    """)
    assert r.returncode == 0, r.stderr
    assert "BEFORE" in r.stdout and "call torch.cuda.memory.change_current_allocator first" in r.stdout
    assert "CALLS {'record_stream': 0, 'empty_cache': 2}" in r.stdout, r.stdout


def test_install_after_cuda_init_says_too_late_and_how_to_fix():
    # Without a GPU, CUDA cannot really be initialised: pretend it was, to check
    # the message a user gets (the real case runs in test_install_too_late_on_gpu).
    r = run_python("""
        import torch, memsched
        torch.cuda.is_initialized = lambda: True
        try:
            memsched.allocator.install()
        except memsched.MemschedError as e:
            print("ERR", e)
    """)
    assert r.returncode == 0, r.stderr
    if "built without CUDA" in r.stdout:
        pytest.skip("memsched built without CUDA")
    assert "after CUDA was initialised" in r.stdout, r.stdout
    assert "fresh process" in r.stdout and "first thing" in r.stdout


@pytest.mark.requires_cuda
def test_install_too_late_on_gpu():
    r = run_python("""
        import torch, memsched
        torch.zeros(1, device="cuda")
        try:
            memsched.allocator.install()
        except memsched.MemschedError as e:
            print("ERR", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "after CUDA was initialised" in r.stdout, r.stdout


@pytest.mark.requires_cuda
def test_install_routes_cuda_tensors_through_memsched(tmp_path):
    path = tmp_path / "snap.pickle"
    r = run_python(f"""
        import pickle, torch, memsched
        memsched.allocator.install(record_history=True)
        assert memsched.allocator.is_installed()
        assert memsched.allocator.record_stream_is_honoured()
        x = torch.empty(1000, device="cuda", dtype=torch.float32)      # 4000 B -> 4096
        y = torch.empty(3 << 20, device="cuda", dtype=torch.uint8)     # 3 MiB
        s = memsched.memory_stats()
        assert s["allocation.all.current"] == 2, s["allocation.all.current"]
        assert s["requested_bytes.all.current"] == 4000 + (3 << 20)
        assert s["allocated_bytes.all.current"] == 4096 + (3 << 20)
        ptr = y.data_ptr()
        # record_stream: y is read on a side stream, so its block must not be reused yet.
        side = torch.cuda.Stream()
        # Warm the kernels up first: with lazy module loading a kernel's first launch may
        # synchronise the context, so the side stream would be done before the free below.
        with torch.cuda.stream(side):
            torch.cuda._sleep(10)
            y.float().sum()
        side.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)   # ~0.1 s: keep the side stream busy
            z = y.float().sum()
        y.record_stream(side)
        assert memsched.allocator.hook_calls()["record_stream"] == 1
        del y
        w = torch.empty(3 << 20, device="cuda", dtype=torch.uint8)
        assert not side.query(), "the side stream finished before the check: it proved nothing"
        assert w.data_ptr() != ptr, "block reused while the side stream may read it"
        side.synchronize()
        del w
        v = torch.empty(3 << 20, device="cuda", dtype=torch.uint8)
        assert memsched.memory_stats()["active.all.current"] >= 2
        memsched.allocator.check_invariants()
        del v, x
        torch.cuda.empty_cache()      # reaches memsched through the reset hook
        memsched.dump_snapshot("{path}")
        snap = pickle.load(open("{path}", "rb"))
        from torch.cuda import _memory_viz as viz
        viz.segsum(snap)
        print("OK", memsched.memory_stats()["reserved_bytes.all.current"])
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


@pytest.mark.requires_cuda
def test_pinned_host_tensors_are_pinned_in_a_fresh_process():
    # The H100 failure: is_pinned() was False when no CUDA tensor existed yet in the process
    # (See Note [Pinned tensors need torch's CUDA initialised]).
    r = run_python("""
        import torch, memsched
        pool = memsched.allocator.HostTensorPool(pinned=True)
        t = pool.empty([1 << 20], torch.float32)
        print("PINNED", t.is_pinned(), t[17:].is_pinned())
        t.fill_(3.0)
        g = t.to("cuda", non_blocking=True)
        pool.record_stream(t, torch.cuda.current_stream().cuda_stream)
        print("SUM", float(g.sum()))
    """)
    assert r.returncode == 0, r.stderr
    assert "PINNED True True" in r.stdout, r.stdout
    assert f"SUM {3.0 * (1 << 20)}" in r.stdout, r.stdout


@pytest.mark.requires_cuda
def test_training_step_matches_native_allocator():
    code = """
        import sys, torch, memsched
        from memsched import models
        if sys.argv[1] == "memsched":
            memsched.allocator.install()
        torch.use_deterministic_algorithms(True)  # so that only the allocator differs
        torch.manual_seed(0)
        model = models.build_model("transformer", "small", device="cuda")
        step = models.make_step_fn(model, "transformer", batch=4, device="cuda")
        loss = step()
        print(repr(float(loss)), float(sum(p.grad.double().sum() for p in model.parameters())))
    """
    out = []
    for mode in ("native", "memsched"):
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), mode], capture_output=True,
                           text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        out.append(r.stdout.strip())
    assert out[0] == out[1]


def test_install_from_cpp_wires_allocator_and_hooks_and_refuses_a_second_swap():
    # install()'s C++ path (Note [Installing from C++]) up to the first CUDA allocation, which
    # also runs without a GPU: torch's current allocator becomes the pluggable one over the shim,
    # empty_cache reaches memsched, and a second swap is refused with torch's reason.
    if not memsched._C._pluggable_hooks_supported():
        pytest.skip("built without torch's CUDA libraries")
    r = run_python("""
        import ctypes, torch, memsched
        from memsched import allocator, _C
        shim = allocator._load_shim()
        addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
        fns = [addr(shim.memsched_malloc), addr(shim.memsched_free), addr(shim.memsched_last_error),
               addr(shim.memsched_last_error_is_oom), addr(shim.memsched_record_stream),
               addr(shim.memsched_empty_cache)]
        _C._install_memsched_allocator(*fns)
        torch._C._cuda_emptyCache()
        print("CALLS", allocator.hook_calls())
        try:
            _C._install_memsched_allocator(*fns)
        except memsched.MemschedError as e:
            print("SECOND", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "CALLS {'record_stream': 0, 'empty_cache': 1}" in r.stdout, r.stdout
    assert "SECOND" in r.stdout and "initialized" in r.stdout, r.stdout


def test_failed_malloc_becomes_a_torch_error_with_the_shims_reason():
    # The malloc torch gets from install(): a null pointer from the shim is thrown as
    # c10::OutOfMemoryError (torch.OutOfMemoryError in Python) when the shim says it was an
    # out-of-memory, as c10::Error otherwise -- never handed to torch as a storage.
    if not memsched._C._pluggable_hooks_supported():
        pytest.skip("built without torch's CUDA libraries")
    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    malloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    text_t = ctypes.CFUNCTYPE(ctypes.c_void_p)  # a char* that stays valid (as the shim's thread-local)
    flag_t = ctypes.CFUNCTYPE(ctypes.c_int)
    refuse = malloc_t(lambda size, device, stream: None)
    message = ctypes.create_string_buffer(b"memsched: out of memory: tried to allocate 2.00 GiB")
    oom_text = text_t(lambda: ctypes.addressof(message))
    yes, no = flag_t(lambda: 1), flag_t(lambda: 0)
    got = memsched._C._memsched_malloc_or_throw(addr(refuse), addr(oom_text), addr(yes), 1 << 31, 0)
    assert got[:2] == (0, "OutOfMemoryError") and "tried to allocate 2.00 GiB" in got[2], got
    got = memsched._C._memsched_malloc_or_throw(addr(refuse), addr(oom_text), addr(no), 1 << 31, 0)
    assert got[:2] == (0, "Error") and "tried to allocate 2.00 GiB" in got[2], got
    assert memsched._C._memsched_malloc_or_throw(addr(refuse), addr(oom_text), addr(yes), 0, 0)[:2] == (0, "ok")
    give = malloc_t(lambda size, device, stream: 4096)
    assert memsched._C._memsched_malloc_or_throw(addr(give), addr(oom_text), addr(yes), 16, 0) == (4096, "ok", "")
    if not torch.cuda.is_available():  # the real shim without a device: a plain error naming the cause
        shim = allocator._load_shim()
        got = memsched._C._memsched_malloc_or_throw(addr(shim.memsched_malloc), addr(shim.memsched_last_error),
                                                    addr(shim.memsched_last_error_is_oom), 4096, 0)
        assert got[:2] == (0, "Error") and "device 0 does not exist" in got[2], got


@pytest.mark.requires_cuda
def test_out_of_memory_under_memsched_raises_torch_out_of_memory_error():
    r = run_python("""
        import torch, memsched
        memsched.allocator.install()
        x = torch.ones(4, device="cuda")
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")   # 1 PiB
        except torch.OutOfMemoryError as e:
            print("OOM", "memsched: out of memory" in str(e))
        print("STILL", float((x * 2).sum()), memsched.memory_stats()["num_ooms"])
    """)
    assert r.returncode == 0, r.stderr
    assert "OOM True" in r.stdout and "STILL 8.0 1" in r.stdout, r.stdout


def test_device_counters_read_memscheds_pool_when_it_is_installed(monkeypatch):
    """See Note [Device memory counters under the installed allocator]: torch's pluggable-allocator
    interface refuses its statistics calls, so memsched's own readers go to memsched's pool -- its C
    counters, not memory_stats(), which builds the whole JSON state (read at every step's end)."""
    import types
    reads, resets = [], []
    monkeypatch.setattr(allocator, "is_installed", lambda: True)
    shim = types.SimpleNamespace(memsched_allocated_bytes=lambda i: reads.append(("now", i)) or 123,
                                 memsched_allocated_peak_bytes=lambda i: reads.append(("peak", i)) or 456)
    monkeypatch.setattr(allocator, "_load_shim", lambda: shim)
    monkeypatch.setattr(allocator, "memory_stats", lambda *a, **k: pytest.fail("the JSON statistics were built"))
    monkeypatch.setattr(allocator, "reset_peak_stats", lambda device=None, **_: resets.append(device))
    for fn in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, **k: pytest.fail("torch's counter was read"))
    dev = torch.device("cuda", 1)
    assert allocator.cuda_memory_allocated(dev) == 123
    assert allocator.cuda_max_memory_allocated(dev) == 456
    allocator.reset_cuda_peak(dev)
    assert reads == [("now", 1), ("peak", 1)] and resets == [dev]


@pytest.mark.requires_cuda
def test_optimize_trains_under_the_installed_allocator():
    """A Run's executor and report read the device counters through memsched's pool (torch's
    memory_allocated raises under a pluggable allocator)."""
    r = run_python("""
        import torch, memsched
        memsched.allocator.install()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 256, device="cuda")
        with memsched.optimize(model, opt, budget=1.0, planner="offload_all_prefetch") as run:  # offloads all
            for _ in range(3):
                model(x).square().mean().backward()
                run.step()
            print(run.steps_planned, run.step_stats[-1].peak_bytes > 0)
            run.report()
    """, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["2", "True"], r.stdout
