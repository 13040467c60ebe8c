"""A plan whose host copies fit optimize(host_memory_limit=...), or a refusal naming a limit that works.

Entry point: plan_within_host_limit(trace, budget_bytes, planner, plan, limit, limit_text, schedule_of,
simulate_of, device_model) -> (plan, schedule, name), called by memsched.optimize when the planner's
plan keeps more bytes in host memory than the limit allows.

Note [Plans within host_memory_limit]
  Rationale: the refusal named the host bytes of the plan just made, and a retry with that limit
  was refused again naming another figure (a new user saw 64 KiB, then 928 KiB). The plan depends on
  the profiled op durations, and those change between runs: CPU noise, and above all the host limit
  itself -- the profiled step (profile='offload') copies its saved activations to host memory only
  while they fit the limit, and its copies lengthen the ops it times -- so the retry planned other
  offloads. The figure was also rounded down ("3.56 MiB" for 3,729,600 bytes), and the copy engine
  counted the pool's block sizes, not the copies' bytes, so even the exact figure left an offload on
  the device at run time.
  Approach: when the planner's plan needs more than the limit, every registered planner also plans
  the same budget with roofline op times (FLOPs and bytes: the same on every run of the same model and
  shapes), beside the planner's own plans with measured times; the fastest in simulation (with the
  Run's device model) whose host bytes fit is run instead, and run.report() says so. When none fits,
  the refusal names the least host bytes among the roofline plans -- exact bytes, rounded up when
  written in units -- and the retry finds that very plan again, so the limit it names works. The
  copy engine counts the bytes of host copies alive (the pool's requested bytes), the figure the plan
  is checked against.
  Limitations: another device model (device_model=) or another min_offload_bytes changes the plans,
  so the figure holds for the same settings.
"""
from memsched import _C
from memsched.units import format_bytes_up


def plan_within_host_limit(trace, budget_bytes, planner, need, limit, limit_text, make_plan, schedule_of,
                           simulate_of, planners):
    """The fastest plan for `budget_bytes` whose host bytes fit `limit`, as (plan, schedule, what: the planner
    and the op times it planned with, e.g. "greedy (roofline op times)"), after
    the `planner` plan needed `need` bytes; raises MemschedError naming a limit that works where none
    fits. make_plan(name, durations) plans (durations 'measured' or 'roofline'; raises MemschedError
    where that planner cannot meet the budget), schedule_of(plan) -> OffloadSchedule, simulate_of(plan)
    -> SimResult or None. See Note [Plans within host_memory_limit]."""
    fitting, least = [], None
    for name in planners:
        for durations in ("measured", "roofline"):
            try:
                plan = make_plan(name, durations)
            except _C.MemschedError:
                continue  # this planner cannot meet the budget
            schedule = schedule_of(plan)
            host = schedule.offloaded_bytes
            if durations == "roofline":  # the same plan on every run: a figure a retry finds again
                least = host if least is None else min(least, host)
            if host <= limit:
                sim = simulate_of(plan)
                fitting.append((sim.step_time_us if sim is not None else 0.0, host, name, durations, plan, schedule))
    if fitting:
        _, _, name, durations, plan, schedule = min(fitting, key=lambda c: c[:4])
        return plan, schedule, f"{name} ({durations} op times)"
    fix = (f"pass optimize(..., host_memory_limit={least}) ({format_bytes_up(least)}; the least host memory of any "
           f"plan for this budget) or more if the machine can spare it, or a larger budget" if least is not None else
           "pass a larger budget")
    raise _C.MemschedError(
        f"run.step(): the {planner} plan for this budget keeps {need} bytes ({format_bytes_up(need)}) of activations "
        f"in host memory per step, more than memsched may use ({limit} bytes: {limit_text}), and no other plan for "
        f"this budget fits it; {fix}")
