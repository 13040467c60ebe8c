"""Shared by the tests that spawn torch.distributed worker processes (gloo on CPU)."""
import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port():
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_and_wait(worker, args, nprocs, seconds=300):
    """mp.start_processes(worker, args, nprocs) with the spawn method; fails the test, killing the
    workers, when they have not all finished within `seconds`."""
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs} worker process(es) did not finish within {seconds} s")


def init_gloo(rank, port, world_size, timeout_s=None):
    """In a spawned worker: one intra-op thread and a gloo process group on 127.0.0.1:port (timeout_s: the
    group's collective timeout, torch's default when None)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    extra = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)
