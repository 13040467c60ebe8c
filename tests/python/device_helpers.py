"""Device models for tests that need a planner to choose recompute."""
import memsched


def slow_copies():
    """A device whose copies cost a second each way: the hybrid planner recomputes wherever it can
    (the ops of a CPU test model take microseconds)."""
    d = memsched.DeviceModel()
    d.name = "slow-copies"
    d.d2h_bw_gbps = d.h2d_bw_gbps = 1e-3
    d.d2h_latency_us = d.h2d_latency_us = 1e6
    return d
