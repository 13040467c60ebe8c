"""memsched.partition(...): place a training step's ops on several devices under memory caps.

Entry points: partition(source, devices, cap, method="s3", ...) -> Partition;
compare(source, devices, cap, methods="all", ...) -> list of rows; CapsError.

`source` is a memsched.Trace (profiled: memsched.profile), a trace JSON path, a
torch.fx.GraphModule or an nn.Module (traced with torch.fx; both need example_inputs; Note [A graph
module as a trace] in fx_graph.py). Methods: "s3" (C++, Note [S3 partitioner]), "even" (layers split
evenly by count), "flops" (contiguous FLOP-balanced split), "metis" (pymetis min-cut), "milp" (exact,
HiGHS; small graphs only).
"""
import math
import numbers
import os
import time

from memsched import _C
from memsched.partition import baselines
from memsched.partition.devices import describe_caps, resolve_devices
from memsched.partition.milp import milp_partition
from memsched.partition.result import Partition
from memsched.units import format_bytes

METHODS = ("s3", "even", "flops", "metis", "milp")
MILP_MAX_OPS = 24   # the exact method's size limit by default (its constraints grow as ops^2 x devices)


class CapsError(ValueError):
    """No placement found meets the caps; the message names the smallest cap that works."""

    def __init__(self, message, least_cap=None):
        super().__init__(message)
        self.least_cap = least_cap


class _Source:
    def __init__(self, source, example_inputs):
        self.graph = None
        if isinstance(source, _C.Trace):
            self.trace = source
        elif isinstance(source, (str, os.PathLike)):
            self.trace = _C.Trace.from_json(os.fspath(source))
        else:
            from memsched.partition.fx_graph import graph_trace, to_graph_module
            gm = to_graph_module(source)
            if example_inputs is None:
                raise ValueError("partition: example_inputs is required for a GraphModule or nn.Module (a tuple of "
                                 "the forward's arguments, e.g. (x,)); it runs once to measure the graph")
            self.graph = graph_trace(gm, example_inputs)
            self.trace = self.graph.trace
        self.trace.validate()


def _problem(src, devices, cap, links, link_latency_us, durations):
    dset = resolve_devices(devices, cap, src.trace.peak_bytes(), links=links, link_latency_us=link_latency_us,
                           trace=src.trace, durations=durations)
    problem = _C.PartitionProblem(src.trace, dset.models, dset.caps, dset.links, dset.link_bw_gbps,
                                  dset.link_latency_us)
    return problem, dset


def _run_method(problem, method, time_limit_s, milp_time_limit_s, milp_max_ops, seed):
    """(device_of_op, note) or raises ValueError/RuntimeError saying why the method has no answer."""
    if method == "s3":
        extra = [("metis", baselines.metis_split(problem))] if baselines.metis_available()[0] else []
        r = problem.s3(time_limit_s=time_limit_s, seed=seed, extra_starts=extra)
        return r["device_of_op"], f"start: {r['start']}, {r['num_clusters']} clusters"
    if method == "even":
        return baselines.even_split(problem), f"{problem.num_layers} layers"
    if method == "flops":
        return baselines.flops_split(problem), f"{problem.num_layers} layers"
    if method == "metis":
        ok, why = baselines.metis_available()
        if not ok:
            raise RuntimeError(why)
        return baselines.metis_split(problem), "pymetis k-way"
    if method == "milp":
        if problem.num_ops > milp_max_ops:
            raise RuntimeError(f"skipped: {problem.num_ops} ops > milp_max_ops={milp_max_ops} (the exact MILP is for "
                               f"small graphs)")
        out = milp_partition(problem, time_limit_s=milp_time_limit_s)
        if out is None:
            raise _Infeasible("the MILP proves that no placement meets the caps")
        device_of_op, _obj, optimal = out
        return device_of_op, "optimal" if optimal else f"time limit {milp_time_limit_s:g} s: best found"
    raise ValueError(f"partition: unknown method {method!r}; known: {', '.join(METHODS)}")


class _Infeasible(RuntimeError):
    pass


def _partition_of(problem, dset, method, device_of_op, seconds, note, graph):
    ev = problem.evaluate(device_of_op)
    transfers = [dict(tensor=t, **{"from": a}, to=b, bytes=n, ready_us=r, arrive_us=s)
                 for t, a, b, n, r, s in problem.transfers(device_of_op)]
    node_device = node_ops = None
    if graph is not None:
        node_device = {name: device_of_op[op] for name, op in graph.forward_op_of_node.items()}
        node_ops = {name: [op] + [o for o in (graph.backward_op_of_node.get(name), graph.optimizer_op_of_node.get(name))
                                  if o is not None]
                    for name, op in graph.forward_op_of_node.items()}
    return Partition(method=method, device_of_op=list(device_of_op), devices=list(dset.names), caps=list(dset.caps),
                     makespan_us=ev["makespan_us"], peak_bytes=list(ev["peak_bytes"]), busy_us=list(ev["busy_us"]),
                     bytes_moved=ev["bytes_moved"], transfers=transfers, fits=ev["fits"],
                     link_bw_gbps=None if dset.links else dset.link_bw_gbps, link_latency_us=dset.link_latency_us,
                     seconds=seconds, node_device=node_device, node_ops=node_ops, note=note, links=_matrix(dset))


def _matrix(dset):
    """The per-pair link matrix the problem was simulated with (rows of GB/s), or [] for one bandwidth."""
    n = len(dset)
    return [dset.links[a * n:(a + 1) * n] for a in range(n)] if dset.links else []


def caps_error(problem, dset, trace, method, why="", flag="cap="):
    least = problem.least_uniform_cap()
    n = len(dset)
    if method not in (None, "s3") and least <= min(dset.caps):
        # S3 fits the caps asked for: "pass cap=<less than that> or more" would be no advice at all
        return CapsError(
            f"partition: method {method!r} found no placement that meets the caps ({describe_caps(dset.caps)}) on "
            f"{n} device(s){': ' + why if why else ''}. S3 meets them (it fits from {format_bytes(least)}, "
            f"{least} bytes, on every device): use method='s3', or a larger cap for {method!r}", least)
    msg = (f"partition: no placement found that meets the caps ({describe_caps(dset.caps)}) on {n} device(s)"
           f"{' with method ' + repr(method) if method else ''}{': ' + why if why else ''}. The step's single-device "
           f"peak is {format_bytes(trace.peak_bytes())}; the smallest cap (the same on every device) at which "
           f"S3 fits is {format_bytes(least)} ({least} bytes): pass {flag}{least} or more, or more devices")
    return CapsError(msg, least)


def _check_options(time_limit_s, milp_time_limit_s, milp_max_ops, seed):
    """Refuses a bad search option by name, before the model is traced or any method runs."""
    for name, v in (("time_limit_s", time_limit_s), ("milp_time_limit_s", milp_time_limit_s)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"partition: {name} must be a number of seconds > 0, got {v!r}")
    if isinstance(milp_max_ops, bool) or not isinstance(milp_max_ops, numbers.Integral) or milp_max_ops < 0:
        raise ValueError(f"partition: milp_max_ops must be a whole number >= 0 (the most ops the exact MILP "
                         f"takes; default {MILP_MAX_OPS}), got {milp_max_ops!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"partition: seed must be a whole number from 0 to 2**64 - 1 (S3's random starts), "
                         f"got {seed!r}")


def partition(source, devices=4, cap=None, *, method="s3", example_inputs=None, links=None, link_latency_us=5.0,
              durations="auto", time_limit_s=40.0, milp_time_limit_s=60.0, milp_max_ops=MILP_MAX_OPS, seed=1):
    """A Partition of `source`'s ops over `devices` under `cap` (module docstring; Note [Partition devices
    and links] for devices, cap and links). Raises CapsError naming the smallest cap that works when the
    method's placement breaks a cap."""
    if method not in METHODS:
        raise ValueError(f"partition: unknown method {method!r}; known: {', '.join(METHODS)}")
    _check_options(time_limit_s, milp_time_limit_s, milp_max_ops, seed)
    src = _Source(source, example_inputs)
    problem, dset = _problem(src, devices, cap, links, link_latency_us, durations)
    t0 = time.perf_counter()
    try:
        device_of_op, note = _run_method(problem, method, time_limit_s, milp_time_limit_s, milp_max_ops, seed)
    except _Infeasible as e:
        raise caps_error(problem, dset, src.trace, method, str(e)) from None
    result = _partition_of(problem, dset, method, device_of_op, time.perf_counter() - t0, note, src.graph)
    if not result.fits:
        raise caps_error(problem, dset, src.trace, method)
    return result


def compare(source, devices=4, cap=None, methods="all", *, example_inputs=None, links=None, link_latency_us=5.0,
            durations="auto", time_limit_s=40.0, milp_time_limit_s=60.0, milp_max_ops=MILP_MAX_OPS, seed=1):
    """One row per method: {"method", "ok", "partition" (or None), "error", "seconds"}; a method that
    breaks a cap still has its partition (fits False)."""
    if isinstance(methods, str) and methods != "all":  # "s3,even" as on the command line; was read letter by letter
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    names = list(METHODS) if methods == "all" else list(methods)
    if not names:
        raise ValueError(f"partition: methods names no method; give 'all' or some of {', '.join(METHODS)}")
    for m in names:
        if m not in METHODS:
            raise ValueError(f"partition: unknown method {m!r}; known: {', '.join(METHODS)}")
    _check_options(time_limit_s, milp_time_limit_s, milp_max_ops, seed)
    src = _Source(source, example_inputs)
    problem, dset = _problem(src, devices, cap, links, link_latency_us, durations)
    rows = []
    for m in names:
        t0 = time.perf_counter()
        try:
            device_of_op, note = _run_method(problem, m, time_limit_s, milp_time_limit_s, milp_max_ops, seed)
        except (RuntimeError, ValueError) as e:
            rows.append(dict(method=m, ok=False, partition=None, error=str(e), seconds=time.perf_counter() - t0))
            continue
        p = _partition_of(problem, dset, m, device_of_op, time.perf_counter() - t0, note, src.graph)
        rows.append(dict(method=m, ok=p.fits, partition=p, error="" if p.fits else "breaks a cap",
                         seconds=p.seconds))
    return rows
