"""Small traces built through the Python Trace API, and a structural comparison of traces, shared by tests."""
import json

import memsched


def two_activation_trace():
    """Two forward ops and two backward ops; two activations, each used by one backward op."""
    t = memsched.Trace()
    for name, phase in (("f", "forward"), ("g", "forward"), ("gb", "backward"), ("fb", "backward")):
        t.add_op(name, phase=phase, duration_us=1.0)
    t.add_tensor(100, "float32", "activation", 0, [1, 2], 2)
    t.add_tensor(200, "float32", "activation", 1, [3], 3)
    return t


def without_unmodeled(trace):
    """The trace without the device memory the profiler measured beyond its tensors (labels
    "unmodeled:...", appended after the step's own records; Note [Memory the trace does not model]):
    two profiles of one step on a GPU measure slightly different amounts of it."""
    d = json.loads(trace.to_json_string())
    kept = [t for t in d["tensors"] if not t.get("label", "").startswith("unmodeled:")]
    if len(kept) == len(d["tensors"]):
        return trace
    assert all(t["id"] == i for i, t in enumerate(kept)), "unmodeled tensors come after the step's own"
    d["tensors"] = kept
    return memsched.Trace.from_json_string(json.dumps(d))


def trace_structure(trace):
    """Everything a Trace says about the step except op durations."""
    ops = [(o.id, o.name, o.module_path, o.phase, o.rng, o.flops, o.bytes_read, o.bytes_written) for o in trace.ops]
    tensors = [(t.id, t.bytes, t.dtype, t.kind, t.producer_op, tuple(t.uses), t.freed_after_op, t.label)
               for t in trace.tensors]
    return ops, tensors


def assert_same_trace_structure(expected, actual):
    """Same ops, tensors, sizes, producers, uses, frees and labels; names the first difference. The
    unmodeled device memory a GPU profile measures is left out (without_unmodeled)."""
    expected, actual = without_unmodeled(expected), without_unmodeled(actual)
    e_ops, e_tensors = trace_structure(expected)
    a_ops, a_tensors = trace_structure(actual)
    assert len(a_ops) == len(e_ops), f"{len(a_ops)} ops, expected {len(e_ops)}"
    for e, a in zip(e_ops, a_ops):
        assert e == a, f"op differs: expected {e}, got {a}"
    assert len(a_tensors) == len(e_tensors), f"{len(a_tensors)} tensors, expected {len(e_tensors)}"
    for e, a in zip(e_tensors, a_tensors):
        assert e == a, f"tensor differs: expected {e}, got {a}"
    assert expected.peak_bytes() == actual.peak_bytes() and expected.live_bytes() == actual.live_bytes()


def assert_same_held(expected, actual):
    """Every tensor's held_until_op (Note [Held outside the graph]) is the same in both traces."""
    for e, a in zip(expected.tensors, actual.tensors):
        assert e.held_until_op == a.held_until_op, (
            f"tensor {e.id} ({e.label}): held until op {a.held_until_op}, the keep-all profile says {e.held_until_op}")
