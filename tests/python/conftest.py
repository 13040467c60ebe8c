"""Shared pytest setup: the one `requires_cuda` marker, skipped without a GPU.

Nothing here queries CUDA at import time; the check runs per test at setup.
"""
import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def device(request):
    """Parametrise a test over CPU and (where present) CUDA."""
    return request.param
