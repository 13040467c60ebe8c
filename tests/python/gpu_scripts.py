"""Shared by the tests of benchmarks/gpu: import one of its scripts as a module."""
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "benchmarks", "gpu")


def load_gpu_script(name):
    """benchmarks/gpu/<name>.py as a module (its own imports of its neighbours resolve too)."""
    sys.path.insert(0, GPU_DIR)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(GPU_DIR)
