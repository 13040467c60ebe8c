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


@pytest.fixture
def unchecked_budget(monkeypatch):
    """For a CUDA test about something other than the budget: its first planned step is not held to the
    budget + 2% (Note [A budget the guard cannot meet] in optimize.py), which test_plan_holds_cuda.py
    checks on its own, so a memory gap there does not hide what this test measures."""
    from memsched.optimize import Run
    monkeypatch.setattr(Run, "_measures_device_peak", lambda self: False)
