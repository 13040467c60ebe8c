"""offload/host_limit.py plan_within_host_limit, with stand-in plans: the fastest plan whose host bytes fit
runs; where none fits, the refusal names the least host bytes of the roofline plans -- the figure a retry
finds again -- never a measured plan's (Note [Plans within host_memory_limit])."""
import re
from types import SimpleNamespace

import pytest

import memsched
from memsched.offload.host_limit import plan_within_host_limit

# (planner, durations) -> (host bytes, simulated step time us); None: that planner refuses the budget
_PLANS = {("dp", "measured"): (5000, 10.0), ("dp", "roofline"): (3000, 12.0),
          ("greedy", "measured"): (2500, 15.0), ("greedy", "roofline"): (4000, 11.0),
          ("vdnn", "measured"): None, ("vdnn", "roofline"): None}


def _choose(limit):
    def make_plan(name, durations):
        if _PLANS[(name, durations)] is None:
            raise memsched.MemschedError(f"planner '{name}' cannot meet budget")
        return (name, durations)
    return plan_within_host_limit(
        trace=None, budget_bytes=1 << 20, planner="dp", need=6000, limit=limit, limit_text="host_memory_limit",
        make_plan=make_plan, schedule_of=lambda plan: SimpleNamespace(offloaded_bytes=_PLANS[plan][0]),
        simulate_of=lambda plan: SimpleNamespace(step_time_us=_PLANS[plan][1]), planners=["dp", "greedy", "vdnn"])


def test_the_fastest_plan_within_the_limit_runs():
    assert _choose(10_000)[0] == ("dp", "measured")
    assert _choose(4000)[0] == ("greedy", "roofline")   # 11 us beats dp roofline's 12 us
    assert _choose(4000)[2] == "greedy (roofline op times)"
    assert _choose(3000)[0] == ("dp", "roofline")
    assert _choose(2500)[0] == ("greedy", "measured")   # a measured plan may still be run when it fits


def test_the_refusal_names_the_least_roofline_plan_in_exact_bytes():
    with pytest.raises(memsched.MemschedError) as info:
        _choose(1000)
    text = str(info.value)
    # 2500 (a measured plan, which another run may not make) is not the figure: 3000 is
    assert re.search(r"keeps 6000 bytes \(5.86 KiB\) .* \(1000 bytes: host_memory_limit\).*"
                     r"host_memory_limit=3000\) \(2.93 KiB;", text), text
