"""memsched._C.CopyEngine: the offload executor's copies, their holds and their step log.

Note [Offload copy ordering] and [Draining completions in order] in csrc/torch/copy_engine.h. The
`device` fixture runs each test on CPU and, where a GPU is present, on CUDA (side streams,
pinned host blocks, events read one step later).
"""
import pytest
import torch

from memsched import _C


def _engine(device, limit=-1, timeline=False):
    pool = _C.HostTensorPool(device == "cuda")
    return _C.CopyEngine(torch.device(device), pool, limit, timeline), pool


def _sources(device, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device) for n in sizes]


# torch.cuda._sleep's cycles on the compute stream, enqueued right before offload_many, keep its copies
# in flight while the test looks (about 25 ms on an H100; the host needs microseconds). Enqueue it after
# the sources exist: _sources' .to("cuda") is a blocking copy from pageable memory, which synchronises
# the compute stream and so would consume a sleep enqueued before it.
_SLEEP_CYCLES = 50_000_000


def _warm(engine, sizes):
    """One offload of `sizes`, drained, before a test's sleep: the pool then has its pinned segments cached
    and the engine its streams and events, so the offload under test calls no cudaHostAlloc or stream
    creation -- driver calls that may wait for the device, i.e. for the sleep -- while it is issued."""
    warm = engine.offload_many(_sources("cuda", sizes, seed=1))
    _drain(engine, "cuda")
    del warm
    assert engine.host_live_bytes() == 0


def _drain(engine, device):
    if device == "cuda":
        torch.cuda.synchronize()
    engine.poll()
    assert engine.pending_count() == 0


def test_offload_and_fetch_round_trip_bytes_exactly(device):
    engine, _ = _engine(device)
    engine.begin_step()
    src = _sources(device, [1, 4096, 3 << 20, 777])
    tickets = engine.offload_many(src)
    assert [t.kind for t in tickets] == ["d2h"] * 4 and [t.nbytes for t in tickets] == [1, 4096, 3 << 20, 777]
    fetched = [engine.fetch(t.dst, t) for t in tickets]
    for t in fetched:
        engine.wait(t)  # the compute stream waits for the copy before reading it
    for s, f in zip(src, fetched):
        assert f.kind == "h2d" and f.dst.device == s.device
        assert torch.equal(f.dst, s)
    for t in tickets:
        assert t.dst.device.type == "cpu"
        if device == "cuda":
            assert t.dst.is_pinned(), "torch must see the host blocks as pinned (non_blocking copies)"
    log = engine.end_step()
    assert log.d2h_bytes == log.h2d_bytes == sum(s.numel() for s in src)
    _drain(engine, device)
    engine.check_invariants()


def test_cpu_copies_are_complete_at_birth_and_never_pending():
    engine, _ = _engine("cpu")
    engine.begin_step()
    tickets = engine.offload_many(_sources("cpu", [100, 200]))
    assert all(t.is_complete() for t in tickets) and engine.pending_count() == 0
    assert engine.fetch(tickets[0].dst).is_complete()
    assert not engine.is_accelerator and not engine.wait(tickets[0])


def test_host_blocks_return_to_the_pool_when_their_tickets_die(device):
    engine, pool = _engine(device)
    engine.begin_step()
    tickets = engine.offload_many(_sources(device, [1 << 20] * 3))
    assert engine.host_live_bytes() >= 3 << 20
    _drain(engine, device)  # the engine itself holds nothing once the copies completed
    del tickets
    assert engine.host_live_bytes() == 0
    assert pool.stats()["reserved_bytes.all.current"] > 0, "the pool keeps its segments for the next step"


def test_host_limit_is_checked_against_live_blocks(device):
    engine, _ = _engine(device, limit=3 << 20)
    assert engine.has_room(3 << 20) and not engine.has_room((3 << 20) + 1)
    engine.begin_step()
    held = engine.offload_many(_sources(device, [2 << 20]))
    assert not engine.has_room(2 << 20) and engine.has_room(512 << 10)
    del held
    _drain(engine, device)
    assert engine.has_room(3 << 20)
    unlimited, _ = _engine(device)
    assert unlimited.has_room(1 << 50)


def test_cpu_timeline_log_has_each_copy_in_order():
    engine, _ = _engine("cpu", timeline=True)
    engine.begin_step()
    (t,) = engine.offload_many(_sources("cpu", [1 << 16]))
    engine.fetch(t.dst, t)
    rows = engine.end_step().host_copies()
    assert [(k, n) for k, _, _, n in rows] == [("d2h", 1 << 16), ("h2d", 1 << 16)]
    assert all(0.0 <= start <= end for _, start, end, _ in rows)
    assert rows[0][2] <= rows[1][1], "in-order CPU copies: the fetch starts after the offload ended"


def test_without_timeline_no_copy_is_logged():
    engine, _ = _engine("cpu")
    engine.begin_step()
    engine.offload_many(_sources("cpu", [64]))
    assert engine.end_step().host_copies() == []


def test_engine_rejects_a_missing_pool():
    with pytest.raises(_C.MemschedError, match="HostTensorPool is required"):
        _C.CopyEngine(torch.device("cpu"), None)


@pytest.mark.requires_cuda
def test_cuda_sources_are_held_until_their_copy_completes_and_drained_in_order():
    engine, _ = _engine("cuda")
    engine.begin_step()
    _warm(engine, [1 << 20] * 8)
    src = _sources("cuda", [1 << 20] * 8)
    ptrs = [s.data_ptr() for s in src]
    # Only now, after _sources' blocking .to("cuda") (a pageable H2D copy synchronises the compute
    # stream; a sleep enqueued before it had ended before the copies were issued and they all completed
    # at once on an H100): the D2H stream waits for this compute-stream work, so every copy is in flight.
    torch.cuda._sleep(_SLEEP_CYCLES)
    tickets = engine.offload_many(src)
    del src
    assert engine.pending_count() == 8 and not tickets[-1].is_complete()
    # The engine's holds keep the device blocks: a new allocation cannot land on them.
    fresh = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    assert not set(ptrs) & {f.data_ptr() for f in fresh}
    engine.poll()  # no host wait: whatever completed is released, in order
    _drain(engine, "cuda")


@pytest.mark.requires_cuda
def test_cuda_step_log_resolves_duration_stall_and_copies_one_step_later():
    engine, _ = _engine("cuda", timeline=True)
    engine.begin_step()
    (t,) = engine.offload_many(_sources("cuda", [8 << 20]))
    f = engine.fetch(t.dst, t)
    assert engine.wait(f)
    log = engine.end_step()
    engine.mark_end(log)
    duration, stall, copies = log.resolve()
    assert log.ready() and duration > 0 and stall >= 0
    assert [(k, n) for k, _, _, n in copies] == [("d2h", 8 << 20), ("h2d", 8 << 20)]
    assert all(0 <= s <= e <= duration for _, s, e, _ in copies)


@pytest.mark.requires_cuda
def test_cuda_step_log_waits_for_copies_the_compute_stream_never_waited_for():
    """A D2H copy whose tensor backward never fetched (a branch outside the loss) still runs on the D2H
    stream after the step's end mark completed: ready() is False until it is done, and resolve() waits
    for it (c10::Event::elapsedTime refuses an event that has not completed)."""
    engine, _ = _engine("cuda", timeline=True)
    engine.begin_step()
    (t,) = engine.offload_many([torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")])  # ~10 ms at 50 GB/s
    log = engine.end_step()
    engine.mark_end(log)
    torch.cuda.current_stream().synchronize()  # the end mark has completed; the copy has only begun
    assert not t.is_complete() and not log.ready(), "the copy finished before the check: it proved nothing"
    duration, stall, copies = log.resolve()
    assert log.ready() and t.is_complete() and duration >= 0 and stall == 0
    assert [(k, n) for k, _, _, n in copies] == [("d2h", 512 << 20)]
    assert all(0 <= s <= e for _, s, e, _ in copies)
    _drain(engine, "cuda")


@pytest.mark.requires_cuda
def test_cuda_destinations_stay_held_when_their_tickets_die_before_the_copy():
    """A step that raised drops its tickets at once: the host blocks the D2H copies still write must not
    go back to the pool (nor a fetch's device block to the allocator) before the copies complete."""
    engine, _ = _engine("cuda")
    engine.begin_step()
    _warm(engine, [1 << 20] * 4)
    src = _sources("cuda", [1 << 20] * 4)
    torch.cuda._sleep(_SLEEP_CYCLES)  # after _sources' synchronising .to("cuda"): the copies stay in flight
    tickets = engine.offload_many(src)
    del src
    assert not any(t.is_complete() for t in tickets), "the copies finished before the check: it proved nothing"
    del tickets
    assert engine.host_live_bytes() >= 4 << 20
    _drain(engine, "cuda")
    assert engine.host_live_bytes() == 0


def test_fetch_into_fills_the_given_device_tensor(device):
    engine, _ = _engine(device)
    engine.begin_step()
    (t,) = engine.offload_many(_sources(device, [4096]))
    dst = torch.empty(4096, dtype=torch.uint8, device=device)
    f = engine.fetch_into(dst, t.dst, t)
    engine.wait(f)
    assert f.dst.data_ptr() == dst.data_ptr() and torch.equal(dst.cpu(), t.dst)
    with pytest.raises(_C.MemschedError, match="flat uint8 tensors of one size"):
        engine.fetch_into(torch.empty(10, dtype=torch.uint8, device=device), t.dst)
    _drain(engine, device)


@pytest.mark.requires_cuda
def test_sources_freed_at_once_only_for_copies_on_the_compute_stream():
    engine, _ = _engine("cuda")
    engine.begin_step()
    with pytest.raises(_C.MemschedError, match=r"hold=False.*on_compute_stream"):
        engine.offload_many(_sources("cuda", [64]), hold=False)
    engine.on_compute_stream = True
    src = _sources("cuda", [1 << 20])
    (t,) = engine.offload_many(src, hold=False)
    del src  # freed in compute-stream order, after the copy
    _drain(engine, "cuda")
    assert t.dst.numel() == 1 << 20
