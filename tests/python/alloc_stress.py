"""alloc_stress.py -- GPU stress test of stream-ordered reuse under an installed allocator.

    python tests/python/alloc_stress.py --ops 1000000                 # memsched's allocator
    python tests/python/alloc_stress.py --ops 1000000 --allocator native
    python tests/python/alloc_stress.py --ops 20000 --forget-record-stream   # must report violations

Random alloc / use-on-another-stream / free / empty_cache over 4 streams (the default stream and
3 side streams), int32 tensors of 4 B to 16 MiB. Every tensor is filled with its own tag (a
canary) by a kernel on its stream; a use on another stream waits for the owner stream, sleeps a
random while (torch.cuda._sleep) and writes the same tag again, then calls record_stream. Two
checks, the first exact, the second the data-level consequence:

  busy-reuse   At free, a torch.cuda.Event is recorded on every stream that touched the tensor
               (before the allocator records its own). When a later allocation on stream S
               overlaps a freed range, each of those events on a stream other than S must have
               completed -- otherwise a block was handed out while a stream may still touch it.
  canary       Before its free, each tensor is compared with its tag on its own stream; a block
               reused early gets a late write of its previous owner's tag.

Runs in its own process (the allocator must be installed before the first CUDA allocation).
Prints a JSON summary as the last line; exits 1 on a violation unless --forget-record-stream
(which plays a user who forgets record_stream, to show that the checks do catch early reuse: it
first builds one such hazard by construction -- summary["probe"], Note [A hazard the checks must
see] -- because the random loop's short sleeps rarely leave one on a fast GPU).
"""
import argparse
import json
import math
import random
import sys
import time

STREAMS = 4
MAX_ELEMENTS = 4 << 20  # int32 elements: 16 MiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--allocator", choices=("memsched", "native"), default="memsched")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-live", type=int, default=64)
    ap.add_argument("--max-sleep-cycles", type=int, default=200_000)
    ap.add_argument("--forget-record-stream", action="store_true")
    ap.add_argument("--probe-sleep-cycles", type=int, default=50_000_000,
                    help="with --forget-record-stream: the side-stream sleep of the constructed hazard "
                         "(Note [A hazard the checks must see]); about 25 ms on an H100")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():  # does not initialise CUDA
        print("alloc_stress: needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    if args.allocator == "memsched":
        import memsched

        memsched.allocator.install()
        if not memsched.allocator.record_stream_is_honoured():
            print("alloc_stress: this memsched build cannot route record_stream", file=sys.stderr)
            return 2
    dev = torch.device("cuda")
    rng = random.Random(args.seed)
    streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(STREAMS - 1)]
    bad = []
    for s in streams:
        with torch.cuda.stream(s):
            bad.append(torch.zeros((), dtype=torch.int64, device=dev))
    # Warm up every kernel the loop launches, on every stream: with lazy module loading the first
    # launch of a kernel may synchronise the context, which would let slow streams finish early.
    for s in streams:
        with torch.cuda.stream(s):
            for n in (1, 3, 1000, 4097, 1 << 20, 3 << 20):  # 3 << 20: the probe's size (below)
                t = torch.empty(n, dtype=torch.int32, device=dev)
                t.fill_(7)
                bad[streams.index(s)].add_(torch.ne(t, 7).sum())
                torch.cuda._sleep(10)
    torch.cuda.synchronize()
    for b in bad:
        b.zero_()

    live = {}       # tag -> (tensor, owner stream index, set of stream indices that used it)
    pending = []    # [start, end, [(stream index, event), ...]] of freed tensors
    counts = dict(allocs=0, uses=0, frees=0, empty_caches=0, reuses_checked=0, busy_reuse=0)
    first_violation = None
    next_tag = 1
    start_time = time.perf_counter()

    def random_elements():
        return max(1, int(math.exp(rng.uniform(0.0, math.log(MAX_ELEMENTS)))))

    def prune():
        pending[:] = [p for p in pending if not all(ev.query() for _, ev in p[2])]

    def check_reuse(lo, hi, s, op):
        """The busy-reuse check of an allocation [lo, hi) on stream s against every pending free."""
        nonlocal first_violation
        busy = 0
        for p in pending:
            if p[0] < hi and lo < p[1]:
                counts["reuses_checked"] += 1
                for si, ev in p[2]:
                    if si != s and not ev.query():
                        busy += 1
                        if first_violation is None:
                            first_violation = (f"op {op}: [{lo:#x}, {hi:#x}) given to stream {s} while "
                                               f"stream {si} may still touch [{p[0]:#x}, {p[1]:#x})")
        counts["busy_reuse"] += busy
        return busy

    def alloc(s, n, op):
        nonlocal next_tag
        with torch.cuda.stream(streams[s]):
            t = torch.empty(n, dtype=torch.int32, device=dev)
        check_reuse(t.data_ptr(), t.data_ptr() + 4 * n, s, op)
        tag = next_tag
        next_tag += 1
        with torch.cuda.stream(streams[s]):
            t.fill_(tag)  # the canary
        live[tag] = (t, s, set())
        counts["allocs"] += 1
        return tag

    def use(tag, u, sleep_cycles):
        t, owner, used = live[tag]
        if u != owner:
            streams[u].wait_stream(streams[owner])  # a correct user orders the use after the producer
        with torch.cuda.stream(streams[u]):
            if sleep_cycles is not None:
                torch.cuda._sleep(sleep_cycles)
            t.fill_(tag)
        if u != owner:
            if not args.forget_record_stream:
                t.record_stream(streams[u])
            used.add(u)
        counts["uses"] += 1

    def free(tag):
        t, owner, used = live.pop(tag)
        with torch.cuda.stream(streams[owner]):
            bad[owner].add_(torch.ne(t, tag).sum())  # the canary must still be there
        events = []
        for si in used | {owner}:
            ev = torch.cuda.Event()
            ev.record(streams[si])
            events.append((si, ev))
        pending.append([t.data_ptr(), t.data_ptr() + 4 * t.numel(), events])
        counts["frees"] += 1

    probe = None
    if args.forget_record_stream:
        # Note [A hazard the checks must see]: in the random loop a side stream's use sleeps at most
        # --max-sleep-cycles (about 0.1 ms on an H100), so on a fast GPU it has finished before the host
        # frees the block and allocates a fitting size on the owner stream again -- the loop then finds
        # no busy reuse although record_stream was forgotten, and proves nothing about the checks. So
        # first one hazard by construction, through the same alloc/use/free and checks: a use on stream
        # 1 sleeps --probe-sleep-cycles (tens of ms; the host needs well under 1 ms for the next lines),
        # its block is freed without record_stream and the same size is allocated again on the owner
        # stream 0: the free left stream 0's pool as it was before the first allocation (coalesced), so
        # best fit hands back that block while stream 1 still sleeps (summary["probe"]["reused"] says
        # so). After a synchronize the late write of the old tag is in the new tensor: the canary sees
        # it too. The warm-up ran every kernel here at this size, so no lazy module load synchronises.
        n = 3 << 20
        first = alloc(0, n, "probe")
        lo = live[first][0].data_ptr()
        use(first, 1, args.probe_sleep_cycles)
        free(first)
        busy_before = counts["busy_reuse"]
        second = alloc(0, n, "probe")
        reused = live[second][0].data_ptr() == lo
        busy = counts["busy_reuse"] - busy_before
        torch.cuda.synchronize()
        free(second)  # the canary check runs after stream 1's late write of the old tag
        torch.cuda.synchronize()
        probe = dict(reused=reused, busy_reuse=busy, canary_errors=int(bad[0]))
        prune()

    for op in range(args.ops):
        r = rng.random()
        if r < 0.35 and len(live) < args.max_live:  # ---- alloc on a random stream
            alloc(rng.randrange(STREAMS), random_elements(), op)
        elif r < 0.60 and live:  # ---- use on a random stream
            tag = rng.choice(list(live))
            u = rng.randrange(STREAMS)
            sleep_cycles = rng.randrange(args.max_sleep_cycles) if rng.random() < 0.7 else None
            use(tag, u, sleep_cycles)
        elif r < 0.85 and live:  # ---- free
            free(rng.choice(list(live)))
        elif r < 0.851:  # ---- empty_cache (reaches memsched through the reset hook)
            torch.cuda.empty_cache()
            counts["empty_caches"] += 1
        if op % 64 == 0:
            prune()
    live.clear()
    torch.cuda.synchronize()
    canary_errors = int(sum(int(b) for b in bad))
    if args.allocator == "memsched":
        import memsched

        memsched.allocator.check_invariants()
    summary = dict(counts, ops=args.ops, allocator=args.allocator, canary_errors=canary_errors,
                   forget_record_stream=args.forget_record_stream, first_violation=first_violation, probe=probe,
                   seconds=round(time.perf_counter() - start_time, 1),
                   gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
    print(json.dumps(summary))
    violated = counts["busy_reuse"] > 0 or canary_errors > 0
    return 0 if (args.forget_record_stream or not violated) else 1


if __name__ == "__main__":
    sys.exit(main())
