"""memsched.allocator -- memsched's caching allocator from Python.

    import memsched
    memsched.allocator.install()          # first thing: before any CUDA tensor exists
    ... train ...
    memsched.memory_stats()["allocated_bytes.all.peak"]
    memsched.dump_snapshot("snap.pickle")  # open in https://pytorch.org/memory_viz

What is here:
  install() / is_installed()   route every CUDA allocation of the process through
                               memsched's block pools (torch's pluggable-allocator
                               API, libmemsched_alloc.so); Tensor.record_stream and
                               torch.cuda.empty_cache reach memsched too.
  memory_stats(), memory_snapshot(), dump_snapshot(), record_history(), empty_cache()
                               for the installed CUDA pools or for any pool passed as
                               ``pool=`` (a BlockPool or HostTensorPool; works on CPU).
  BlockPool, HostTensorPool    pools Python drives directly (see memsched._C).
  plan_placement(trace)        fixed offsets for a step's tensors in one arena.
  replay_trace(trace)          what the block pool would reserve for a trace.

Statistics keys are torch.cuda.memory_stats()'s: "allocated_bytes.all.current",
"reserved_bytes.large_pool.peak", "num_alloc_retries", ...; snapshots have the
layout of torch.cuda.memory._snapshot(), so torch.cuda._memory_viz reads them.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Optional, Union

import torch

from memsched import _C
from memsched._C import BlockPool, HostTensorPool, MemschedError, OutOfMemoryError, Placement

__all__ = [
    "BlockPool",
    "HostTensorPool",
    "OutOfMemoryError",
    "Placement",
    "check_invariants",
    "dump_snapshot",
    "empty_cache",
    "hook_calls",
    "install",
    "is_installed",
    "memory_snapshot",
    "memory_stats",
    "plan_placement",
    "record_history",
    "record_stream_is_honoured",
    "replay_trace",
    "reset_peak_stats",
    "shim_path",
]

SHIM_NAME = "libmemsched_alloc.so"
_ALLOC_FN = "memsched_malloc"
_FREE_FN = "memsched_free"

_lock = threading.Lock()
_installed: Optional[Any] = None  # torch's allocator object (a CUDAPluggableAllocator), once installed
_shim: Optional[ctypes.CDLL] = None
_record_stream_hooked = False

Pool = Union[BlockPool, HostTensorPool]


def shim_path() -> str:
    """Path of libmemsched_alloc.so: $MEMSCHED_ALLOC_LIB, else next to this package."""
    override = os.environ.get("MEMSCHED_ALLOC_LIB")
    path = Path(override) if override else Path(__file__).resolve().parent / SHIM_NAME
    if not path.is_file():
        raise MemschedError(
            f"memsched allocator library not found at {path}; build the package "
            "(`make build`) so that libmemsched_alloc.so is copied next to memsched/_C, "
            "or set MEMSCHED_ALLOC_LIB to its path")
    return str(path)


def _load_shim() -> ctypes.CDLL:
    """The shim, loaded once (dlopen returns the same handle torch's loader gets)."""
    global _shim
    if _shim is None:
        lib = ctypes.CDLL(shim_path())
        lib.memsched_malloc.restype = ctypes.c_void_p
        lib.memsched_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.memsched_free.restype = None
        lib.memsched_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.memsched_record_stream.restype = None
        lib.memsched_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.memsched_empty_cache.restype = None
        lib.memsched_num_devices_used.restype = ctypes.c_int
        lib.memsched_state_json.restype = ctypes.c_size_t
        lib.memsched_state_json.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.memsched_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.memsched_reset_peak_stats.argtypes = [ctypes.c_int]
        lib.memsched_check_invariants.argtypes = [ctypes.c_int]
        lib.memsched_check_invariants.restype = ctypes.c_int
        lib.memsched_last_error.restype = ctypes.c_char_p
        lib.memsched_last_error_is_oom.restype = ctypes.c_int
        lib.memsched_report_malloc_errors_to_stderr.argtypes = [ctypes.c_int]
        lib.memsched_built_with_cuda.restype = ctypes.c_int
        lib.memsched_hook_calls.restype = ctypes.c_int64
        lib.memsched_hook_calls.argtypes = [ctypes.c_int]
        lib.memsched_allocated_bytes.restype = ctypes.c_int64
        lib.memsched_allocated_bytes.argtypes = [ctypes.c_int]
        lib.memsched_allocated_peak_bytes.restype = ctypes.c_int64
        lib.memsched_allocated_peak_bytes.argtypes = [ctypes.c_int]
        lib.memsched_reserved_peak_bytes.restype = ctypes.c_int64
        lib.memsched_reserved_peak_bytes.argtypes = [ctypes.c_int]
        _shim = lib
    return _shim


_TOO_LATE = (
    "memsched.allocator.install() was called after CUDA was initialised in this process, "
    "so PyTorch's own caching allocator already serves CUDA memory and cannot be swapped. "
    "Call memsched.allocator.install() first thing -- right after `import memsched`, before "
    "any CUDA tensor, .cuda()/.to('cuda'), torch.cuda.init() or CUDA stream -- or run the "
    "code in a fresh process.")


def install(*, record_history: bool = False, history_entries: int = 100000) -> None:
    """Route every CUDA allocation of this process through memsched's block pools.

    Must run before CUDA is initialised (see the error text for the fix if not).
    Idempotent. Tensor.record_stream(s) and torch.cuda.empty_cache() are routed
    to memsched as well (See Note [Wiring record_stream]), and an allocation
    memsched cannot serve raises torch.OutOfMemoryError with memsched's figures
    (See Note [Installing from C++]).
    """
    global _installed, _record_stream_hooked
    with _lock:
        if _installed is not None:
            return
        if not _C.built_with_cuda:
            raise MemschedError(
                "memsched.allocator.install(): this memsched was built without CUDA "
                "(MEMSCHED_WITH_CUDA=OFF); rebuild with the CUDA toolkit present")
        if torch.cuda.is_initialized():
            raise MemschedError(_TOO_LATE)
        if not torch.cuda.is_available():
            raise MemschedError(
                "memsched.allocator.install(): no CUDA device is available, and the installed "
                "allocator only serves CUDA memory. On a CPU-only machine use "
                "memsched.allocator.HostTensorPool or BlockPool(backend='host') directly.")
        shim = _load_shim()
        hooks = _C._pluggable_hooks_supported()
        try:
            if hooks:  # See Note [Installing from C++] in csrc/torch/pluggable_hooks.cpp
                addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
                _C._install_memsched_allocator(
                    addr(shim.memsched_malloc), addr(shim.memsched_free), addr(shim.memsched_last_error),
                    addr(shim.memsched_last_error_is_oom), addr(shim.memsched_record_stream),
                    addr(shim.memsched_empty_cache))
                shim.memsched_report_malloc_errors_to_stderr(0)  # they arrive as torch errors
            else:
                torch.cuda.memory.change_current_allocator(
                    torch.cuda.memory.CUDAPluggableAllocator(shim_path(), _ALLOC_FN, _FREE_FN))
        except RuntimeError as e:
            if "initialized" in str(e):
                raise MemschedError(_TOO_LATE) from e
            raise
        _installed = torch.cuda.memory._get_current_allocator()
        _record_stream_hooked = hooks
        if record_history:
            shim.memsched_record_history(1, history_entries)
        if not hooks:
            import warnings

            warnings.warn(
                "memsched.allocator.install(): this build could not link torch's CUDA libraries, "
                "so Tensor.record_stream() is NOT routed to memsched (torch's pluggable allocator "
                "ignores it without a C++ hook): a tensor used on a side stream may be reused "
                "early. Rebuild memsched against a CUDA build of torch.", RuntimeWarning)


def is_installed() -> bool:
    """True once install() has routed CUDA allocations through memsched."""
    return _installed is not None


def record_stream_is_honoured() -> bool:
    """True when Tensor.record_stream reaches memsched's pools (after install())."""
    return _record_stream_hooked


def hook_calls() -> dict:
    """How often torch's hooks reached memsched in this process:
    {"record_stream": n, "empty_cache": n} (Tensor.record_stream, torch.cuda.empty_cache)."""
    shim = _load_shim()
    return {"record_stream": shim.memsched_hook_calls(0), "empty_cache": shim.memsched_hook_calls(1)}


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def _require_installed(what: str) -> ctypes.CDLL:
    if _installed is None:
        raise MemschedError(
            f"memsched.{what}(): memsched's CUDA allocator is not installed in this process; "
            "call memsched.allocator.install() first, or pass pool=<a BlockPool or "
            "HostTensorPool> to read a pool you drive yourself")
    return _load_shim()


def _device_state(device: int, include_history: bool) -> Optional[dict]:
    shim = _load_shim()
    needed = shim.memsched_state_json(device, int(include_history), None, 0)
    if needed == 0:
        return None
    while True:
        buf = ctypes.create_string_buffer(needed)
        got = shim.memsched_state_json(device, int(include_history), buf, needed)
        if got <= needed:
            return json.loads(buf.value.decode())
        needed = got  # the pool grew between the two calls


def _pool_state(pool: Pool, include_history: bool) -> dict:
    return json.loads(pool.state_json(include_history))


def memory_stats(device=None, *, pool: Optional[Pool] = None) -> "collections.OrderedDict[str, int]":
    """Statistics with torch.cuda.memory_stats()'s keys, sorted by key.

    With ``pool``: that pool's. Otherwise the installed CUDA allocator's for
    ``device`` (default: current device); all zeros if it has not allocated yet.
    """
    if pool is not None:
        stats = pool.stats()
    else:
        _require_installed("memory_stats")
        state = _device_state(_device_index(device), False)
        stats = state["stats"] if state else BlockPool("virtual").stats()
    return collections.OrderedDict(sorted(stats.items()))


def memory_snapshot(*, pool: Optional[Pool] = None, include_history: bool = True) -> dict:
    """{"segments": [...], "device_traces": [[...], ...]} in torch.cuda.memory._snapshot()'s
    layout (pytorch.org/memory_viz and torch.cuda._memory_viz read it)."""
    if pool is not None:
        state = _pool_state(pool, include_history)
        return {"segments": state["segments"], "device_traces": state["device_traces"]}
    shim = _require_installed("memory_snapshot")
    n = shim.memsched_num_devices_used()
    segments: list = []
    traces: list = [[] for _ in range(max(n, 1))]
    for d in range(n):
        state = _device_state(d, include_history)
        if state is None:
            continue
        segments.extend(state["segments"])
        traces[d] = state["device_traces"][d]
    return {"segments": segments, "device_traces": traces}


def dump_snapshot(path: Union[str, os.PathLike], *, pool: Optional[Pool] = None) -> None:
    """Write memory_snapshot() as a pickle, the file format of
    torch.cuda.memory._dump_snapshot(): drag it into https://pytorch.org/memory_viz."""
    if pool is None:
        _require_installed("dump_snapshot")  # the error names the call the user made
    snapshot = memory_snapshot(pool=pool)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def record_history(enabled: bool = True, max_entries: int = 100000, *,
                   pool: Optional[Pool] = None) -> None:
    """Record alloc/free/segment events for the snapshot's device_traces."""
    if pool is not None:
        pool.record_history(enabled, max_entries)
    else:
        _require_installed("allocator.record_history").memsched_record_history(int(enabled), max_entries)


def empty_cache(*, pool: Optional[Pool] = None) -> None:
    """Wait for outstanding stream events, then return unused cached segments."""
    if pool is not None:
        pool.empty_cache()
    else:
        _require_installed("allocator.empty_cache").memsched_empty_cache()


def reset_peak_stats(device=None, *, pool: Optional[Pool] = None) -> None:
    if pool is not None:
        pool.reset_peak_stats()
    else:
        _require_installed("allocator.reset_peak_stats").memsched_reset_peak_stats(_device_index(device))


# Note [Device memory counters under the installed allocator]
#   torch routes CUDA allocations to memsched once install() ran, through its pluggable-allocator
#   interface, which refuses the statistics calls (getDeviceStats, resetPeakStats): with memsched's
#   allocator installed, torch.cuda.memory_allocated / max_memory_allocated /
#   reset_peak_memory_stats raise. memsched's own readers of the device counters (the executor, the
#   Run, compare) go through these three, which read memsched's pool when it is installed and
#   torch's allocator otherwise.
def cuda_memory_allocated(device) -> int:
    """Bytes allocated on the CUDA `device` now (See Note [Device memory counters under the installed allocator])."""
    if is_installed():  # the shim's C counter: memory_stats() would build the whole JSON state
        return int(_load_shim().memsched_allocated_bytes(_device_index(device)))
    return torch.cuda.memory_allocated(device)


def allocated_bytes_fn() -> int:
    """Address of the installed allocator's C counter `int64_t memsched_allocated_bytes(int device)`,
    or 0 when torch's own allocator is in use (the memory guard then reads its statistics; Note
    [Memory guard] in csrc/torch/saved_tensor_offload.cpp)."""
    if not is_installed():
        return 0
    return ctypes.cast(_load_shim().memsched_allocated_bytes, ctypes.c_void_p).value or 0


def cuda_max_memory_allocated(device) -> int:
    """Peak bytes allocated on the CUDA `device` since the last reset_cuda_peak()."""
    if is_installed():  # the shim's C counter, as cuda_memory_allocated
        return int(_load_shim().memsched_allocated_peak_bytes(_device_index(device)))
    return torch.cuda.max_memory_allocated(device)


def reset_cuda_peak(device) -> None:
    """Start a new peak on the CUDA `device` (memsched's pool when installed, else torch's)."""
    if is_installed():
        reset_peak_stats(device)
    else:
        torch.cuda.reset_peak_memory_stats(device)


def check_invariants(device=None) -> None:
    """Check the installed device pool's invariants; raises MemschedError on a violation."""
    shim = _require_installed("allocator.check_invariants")
    if not shim.memsched_check_invariants(_device_index(device)):
        raise MemschedError(shim.memsched_last_error().decode())


def plan_placement(trace: "_C.Trace", alignment_bytes: int = 512) -> Placement:
    """Fixed arena offsets for the trace's tensors (greedy interval packing).

    Returns a Placement with .offsets (per tensor id), .arena_bytes,
    .lower_bound_bytes (the trace's peak live bytes) and .ratio.
    """
    return _C.plan_placement(trace, alignment_bytes)


def replay_trace(trace: "_C.Trace", split_blocks: bool = True, steps: int = 2) -> dict:
    """Peak live / allocated / reserved bytes of the trace replayed on a fresh block pool
    (virtual memory: nothing is allocated for real)."""
    return _C.replay_trace(trace, split_blocks, steps)
