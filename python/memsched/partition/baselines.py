"""The baselines S3 is compared with: what PyTorch users do (even split by layer count), a
FLOP-balanced contiguous split (both in C++: csrc/core/partition/contiguous_split.h, Note
[Layers]) and a METIS min-cut (pymetis, when installed).

Entry points: even_split(problem), flops_split(problem), metis_split(problem) -> device_of_op;
metis_available() -> (bool, why not).
"""


def even_split(problem):
    return list(problem.even_layer_split())


def flops_split(problem):
    return list(problem.flop_balanced_split())


def metis_available():
    try:
        import pymetis  # noqa: F401
    except ImportError as e:
        return False, f"pymetis is not installed ({e}); pip install pymetis"
    return True, ""


def metis_split(problem):
    """METIS k-way min-cut of the undirected dataflow graph: vertex weight = the op's time on device
    0 (balanced across parts), edge weight = bytes of the tensors between the two ops. Memory caps are
    not an input: the placement is evaluated as it comes."""
    import pymetis

    n, D = problem.num_ops, problem.num_devices
    if D == 1:
        return [0] * n
    weights = {}
    for bytes_, _producer, home, _s, _e, reasons in problem.tensors():
        if home < 0:
            continue
        for r in reasons:
            if r != home:
                key = (min(home, r), max(home, r))
                weights[key] = weights.get(key, 0) + bytes_
    adj = [[] for _ in range(n)]
    ew = [[] for _ in range(n)]
    top = max(weights.values(), default=1) or 1
    for (a, b), w in weights.items():
        scaled = max(1, int(w * 1e6 / top))  # METIS weights are 32-bit ints
        adj[a].append(b)
        ew[a].append(scaled)
        adj[b].append(a)
        ew[b].append(scaled)
    times = [problem.op_us(i, 0) for i in range(n)]
    total = sum(times) or 1.0
    vw = [max(1, int(t * 1e7 / total)) for t in times]
    xadj, adjncy, eweights = [0], [], []
    for i in range(n):
        adjncy.extend(adj[i])
        eweights.extend(ew[i])
        xadj.append(len(adjncy))
    if hasattr(pymetis, "CSRAdjacency"):
        graph = dict(adjacency=pymetis.CSRAdjacency(xadj, adjncy))
    else:  # pymetis before 2025.2
        graph = dict(xadj=xadj, adjncy=adjncy)
    _cut, parts = pymetis.part_graph(D, **graph, vweights=vw, eweights=eweights)
    return [int(p) for p in parts]
