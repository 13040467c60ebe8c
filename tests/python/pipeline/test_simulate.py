"""memsched.pipeline.simulate: per-stage F / I / W times from a profiled Trace add up to the trace's
forward and backward time on the device model, Linear layers get a dW share, and the C++ simulator
behind it ranks schedules as the closed forms say and refuses unknown schedules."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.pipeline import simulate as psim


def _trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return memsched.profile(lambda: F.cross_entropy(model(x), y).backward(), model=model), model


def test_stage_costs_partition_the_profiled_time():
    trace, model = _trace()
    dev = memsched.load_device("h100-sxm")
    dev.use_measured_durations = False
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    costs = psim.stage_costs(trace, [["0", "1"], ["2", "3", "4"]], dev, linear, [1000, 2000], [512, 512],
                             optimizer="adamw", policy="predict")
    fwd = sum(dev.op_time_us(op) for op in trace.ops if op.phase == "forward")
    bwd = sum(dev.op_time_us(op) for op in trace.ops if op.phase == "backward")
    assert sum(c.forward_us for c in costs) == pytest.approx(fwd)
    assert sum(c.backward_input_us + c.backward_weight_us for c in costs) == pytest.approx(bwd)
    assert all(c.forward_us > 0 and c.backward_weight_us > 0 for c in costs)
    assert costs[1].update_us == pytest.approx(2 * costs[0].update_us)        # proportional to parameter bytes
    assert costs[0].policy_us == pytest.approx(costs[0].update_us * 4 / 7)    # predict: 4 passes, AdamW: 7
    assert costs[0].send_bytes == 512 and costs[1].send_bytes == 0           # the last stage sends nothing on


def test_simulated_schedules_rank_as_expected_and_bad_names_are_refused():
    stages = []
    for _ in range(4):
        c = memsched._C.PipelineStageCost()
        c.forward_us, c.backward_input_us, c.backward_weight_us = 1.0, 1.0, 1.0
        stages.append(c)
    lk = psim.link(1e6, 0.0)
    t = {s: psim.simulate(stages, lk, s, microbatches=8).time_per_microbatch_us for s in psim.SIM_SCHEDULES}
    assert t["gpipe"] == pytest.approx(t["1f1b"]) == pytest.approx((8 + 3) * 3.0 / 8)
    assert t["zero_bubble"] < t["1f1b"]
    assert t["async_1f1b"] == pytest.approx(3.0)
    ddp = psim.simulate_data_parallel(12.0, 6.0, 0.0, 0, 4, 8, lk)
    assert ddp.time_per_microbatch_us == pytest.approx(2 * 12.0 / 8)
    with pytest.raises(memsched.MemschedError, match="schedule"):
        psim.simulate(stages, lk, "pipedream")
    with pytest.raises(ValueError, match="policy"):
        psim.stage_costs(_trace()[0], [["0"]], memsched.load_device("h100-sxm"), [], [0], [0], policy="guess")
