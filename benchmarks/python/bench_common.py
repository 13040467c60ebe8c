"""Shared by the benchmarks that replay or plan real traces: the three model
families at realistic sizes, profiled once per process, and where results go."""
import os

import memsched
from memsched import models

# (family, batch) at the "realistic" sizes of memsched.models; batches chosen so activations, not
# weights, dominate the peak where the family allows it (the MLP's weights and gradients still set
# a high floor).
FAMILIES = [("transformer", 16), ("cnn", 128), ("mlp", 4096)]
OUT_DIR = os.environ.get("MEMSCHED_BENCH_OUT", "bench_out")

_TRACES = {}


def profiled_trace(family, batch):
    """memsched.profile of one training step of `family` at `batch`, cached."""
    key = (family, batch)
    if key not in _TRACES:
        model = models.build_model(family, "realistic")
        step = models.make_step_fn(model, family, batch=batch, size="realistic")
        _TRACES[key] = memsched.profile(step, model=model)
    return _TRACES[key]
