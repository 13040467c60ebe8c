"""Which device and torch.distributed backend a pipeline process uses.

Entry points: ``select_backend(device) -> "nccl" | "gloo"``,
``stage_device(device) -> torch.device``, ``ensure_process_group(device)``.

One process per stage, launched with ``torchrun`` (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment). A CUDA device
means NCCL (point-to-point sends between GPUs); a CPU device means gloo.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from memsched._C import MemschedError


def select_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _local_cuda_index() -> int:
    """This process's GPU: LOCAL_RANK (torchrun), else the current CUDA device (a process group set up
    by hand after torch.cuda.set_device)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def stage_device(device=None) -> torch.device:
    """The device this process's stage runs on: ``device`` if given ("cuda" without an index meaning
    this process's GPU, cuda:LOCAL_RANK), else cuda:LOCAL_RANK when a GPU is present, else the CPU."""
    if device is None:
        return torch.device("cuda", _local_cuda_index()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MemschedError(f"device: {str(device)!r} asks for a GPU, but torch sees no CUDA device here; "
                                f"leave device unset (the CPU with gloo) or run where a GPU is visible")
        if dev.index is None:
            # torch.cuda.set_device (and NCCL) need an index; one process per GPU under torchrun
            dev = torch.device("cuda", _local_cuda_index())
    return dev


def ensure_process_group(device: torch.device) -> Tuple[bool, str]:
    """Initialises the default process group from torchrun's environment unless one exists.
    Returns (created here, backend)."""
    if dist.is_available() and dist.is_initialized():
        return False, dist.get_backend()
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise MemschedError(
            f"memsched.pipeline runs one process per stage: launch the script with torchrun "
            f"(torchrun --nproc-per-node=K script.py), or call torch.distributed.init_process_group() first. "
            f"Missing environment variables: {', '.join(missing)}")
    backend = select_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend)
    return True, backend


def backend_matches(device: torch.device, backend: Optional[str]) -> None:
    """Refuses a CPU stage on an NCCL group (NCCL sends only CUDA tensors)."""
    if backend == "nccl" and device.type != "cuda":
        raise MemschedError(f"device: the process group uses NCCL, which sends CUDA tensors only, but the stage "
                            f"runs on {device}. Use a CUDA device or a gloo process group")
