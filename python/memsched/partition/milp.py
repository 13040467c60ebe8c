"""The exact partition of small graphs: a mixed-integer program solved by HiGHS
(scipy.optimize.milp), over the same model as the simulator (Note [Partition model]).

Entry point: milp_partition(problem, time_limit_s=60) -> (device_of_op, makespan_us, proven_optimal), or
None when no placement meets the caps.

Note [Partition MILP]
  Variables: x[i,d] in {0,1} (op i on device d); p[t,d] in [0,1] (tensor t present on d) with
  p[t,d] >= x[r,d] for each reason r of t (its producer and uses); y[t,v,a,b] in [0,1] with
  y >= x[home(t),a] + x[v,b] - 1 (op v reads t across a -> b); start s[i] >= 0; makespan C.
  - one device per op: sum_d x[i,d] = 1
  - memory: for each device d and op k, sum of bytes of tensors live at k with p[t,d] <= cap_d
  - dataflow: s[v] >= finish(producer(t)) + sum_{a != b} comm(t, a, b) y[t,v,a,b]  (finish = s + sum_d
    time(i,d) x[i,d]; a tensor from before the step is ready at 0)
  - device order (trace order per device): for i < j and each d,
    s[j] >= finish(i) - M (2 - x[i,d] - x[j,d])
  - C >= finish(i); minimise C.
  For a fixed x the simulator's earliest-start schedule is the least C satisfying these, so the
  optimum equals min over placements of the simulated makespan. Size grows as n^2 D: meant for
  graphs of tens of ops.
"""
import numpy as np


def milp_partition(problem, time_limit_s=60.0):
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    n, D = problem.num_ops, problem.num_devices
    tensors = problem.tensors()  # (bytes, producer, home_op, start, end, reasons)
    caps = problem.caps
    op_us = np.array([[problem.op_us(i, d) for d in range(D)] for i in range(n)])
    # Variable layout.
    nx = n * D
    x = lambda i, d: i * D + d  # noqa: E731
    p0 = nx
    np_ = len(tensors) * D
    pv = lambda t, d: p0 + t * D + d  # noqa: E731
    reads = [(t, v) for v in range(n) for t in problem.inputs(v)]
    pairs = [(a, b) for a in range(D) for b in range(D) if a != b]
    y0 = p0 + np_
    yv = lambda k, q: y0 + k * len(pairs) + q  # noqa: E731
    s0 = y0 + len(reads) * len(pairs)
    sv = lambda i: s0 + i  # noqa: E731
    C = s0 + n
    nvar = C + 1
    big_m = float(op_us.max(axis=1).sum()) + sum(
        max(problem.comm_us(t[0], a, b) for a, b in pairs) if pairs else 0.0 for t in tensors) + 1.0

    rows, lo, hi = [], [], []

    def add(coeffs, lower, upper):
        rows.append(coeffs)
        lo.append(lower)
        hi.append(upper)

    def finish(i, sign=1.0):
        c = {sv(i): sign}
        for d in range(D):
            c[x(i, d)] = c.get(x(i, d), 0.0) + sign * op_us[i, d]
        return c

    for i in range(n):
        add({x(i, d): 1.0 for d in range(D)}, 1, 1)
    for t, (_, _, _, _, _, reasons) in enumerate(tensors):
        if not reasons:  # lives on device 0
            add({pv(t, 0): 1.0}, 1, 1)
        for r in reasons:
            for d in range(D):
                add({pv(t, d): 1.0, x(r, d): -1.0}, 0, np.inf)
    live_at = [[] for _ in range(n)]
    for t, (b, _, _, start, end, _) in enumerate(tensors):
        if b > 0:
            for k in range(start, end + 1):
                live_at[k].append(t)
    for d in range(D):
        seen = set()
        for k in range(n):
            key = tuple(live_at[k])
            if key in seen or not key:
                continue
            seen.add(key)
            add({pv(t, d): float(tensors[t][0]) for t in key}, -np.inf, float(caps[d]))
    for k, (t, v) in enumerate(reads):
        b, producer, home, *_ = tensors[t]
        for q, (a, bb) in enumerate(pairs):
            add({yv(k, q): 1.0, x(home, a): -1.0, x(v, bb): -1.0}, -1, np.inf)
        c = {sv(v): 1.0}
        if producer >= 0:
            for key, val in finish(producer, -1.0).items():
                c[key] = c.get(key, 0.0) + val
        for q, (a, bb) in enumerate(pairs):
            c[yv(k, q)] = -problem.comm_us(b, a, bb)
        add(c, 0, np.inf)
    for j in range(n):
        for i in range(j):
            for d in range(D):
                c = {sv(j): 1.0}
                for key, val in finish(i, -1.0).items():
                    c[key] = c.get(key, 0.0) + val
                c[x(i, d)] = c.get(x(i, d), 0.0) - big_m
                c[x(j, d)] = c.get(x(j, d), 0.0) - big_m
                add(c, -2 * big_m, np.inf)
    for i in range(n):
        c = {C: 1.0}
        for key, val in finish(i, -1.0).items():
            c[key] = c.get(key, 0.0) + val
        add(c, 0, np.inf)

    A = lil_matrix((len(rows), nvar))
    for r, coeffs in enumerate(rows):
        for col, val in coeffs.items():
            A[r, col] = val
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    lower = np.zeros(nvar)
    upper = np.full(nvar, np.inf)
    upper[:s0] = 1.0
    cost = np.zeros(nvar)
    cost[C] = 1.0
    res = milp(cost, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(lower, upper), options={"time_limit": float(time_limit_s), "disp": False})
    if res.x is None:
        if res.status == 2:  # infeasible
            return None
        raise RuntimeError(f"partition MILP: HiGHS stopped without a solution ({res.message}); the graph "
                           f"({n} ops) is too large for the exact method -- use method='s3'")
    xs = res.x[:nx].reshape(n, D)
    device_of_op = [int(np.argmax(xs[i])) for i in range(n)]
    return device_of_op, float(res.x[C]), bool(res.status == 0)
