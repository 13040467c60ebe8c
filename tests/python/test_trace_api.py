"""memsched.Trace from Python: building, derived views, JSON files, errors."""
import json

import pytest

import memsched


def build_trace():
    t = memsched.Trace()
    f0 = t.add_op("fc1", "fc1", "forward", duration_us=5.0)
    f1 = t.add_op("fc2", "fc2", "forward", duration_us=5.0)
    b0 = t.add_op("fc2_bwd", "fc2", "backward", duration_us=9.0)
    t.add_tensor(400, "float32", "parameter", uses=[f0, b0])
    t.add_tensor(64, "float32", "activation", producer_op=f0, uses=[f1, b0], freed_after_op=b0)
    t.add_tensor(32, "float32", "temporary", producer_op=f1, freed_after_op=f1)
    return t


def test_views_match_hand_counts():
    t = build_trace()
    assert t.live_bytes() == [464, 496, 464]
    assert t.peak_bytes() == 496 and t.peak_op() == 1
    assert t.activation_bytes() == 64
    assert t.bytes_of_kind("parameter") == 400


def test_json_file_round_trip(tmp_path):
    t = build_trace()
    path = tmp_path / "trace.json"
    t.to_json(str(path))
    back = memsched.Trace.from_json(str(path))
    assert back.to_json_string() == t.to_json_string()
    assert [op.phase for op in back.ops] == ["forward", "forward", "backward"]
    assert [r.kind for r in back.tensors] == ["parameter", "activation", "temporary"]


def test_malformed_trace_names_the_field(tmp_path):
    doc = json.loads(build_trace().to_json_string())
    doc["tensors"][1]["bytes"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(memsched.MemschedError, match=r"tensors\[1\] field 'bytes' is negative"):
        memsched.Trace.from_json(str(path))
    assert issubclass(memsched.MemschedError, RuntimeError)


def test_unknown_kind_is_rejected_from_python():
    with pytest.raises(memsched.MemschedError, match="unknown tensor kind 'weights'"):
        memsched.Trace().add_tensor(4, "float32", "weights")


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), (4096, 4096), ("4096", 4096),
])
def test_parse_bytes(text, expected):
    assert memsched.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["six gigs", "-1GiB", -5, "4 parsecs", None, True])
def test_parse_bytes_rejects_with_field_name(bad):
    with pytest.raises(ValueError, match="budget"):
        memsched.parse_bytes(bad)


def test_op_rng_is_derived_from_the_name_and_can_be_set(tmp_path):
    t = memsched.Trace()
    t.add_op("aten::native_dropout")
    t.add_op("aten::linear")
    t.add_op("my_noise", rng=True)
    assert [op.rng for op in t.ops] == [True, False, True]
    with pytest.raises(memsched.MemschedError, match="rng must be True, False or None"):
        t.add_op("x", rng="yes")
    path = tmp_path / "t.json"
    t.to_json(str(path))
    assert [op.rng for op in memsched.Trace.from_json(str(path)).ops] == [True, False, True]


def test_json_paths_may_be_pathlib_paths(tmp_path):
    """Trace.from_json(pathlib.Path) raised pybind11's "incompatible function arguments"; open() takes both."""
    import pathlib

    t = memsched._C.synthetic_trace(num_layers=2, ops_per_layer=2, seed=1)
    path = pathlib.Path(tmp_path) / "t.json"
    t.to_json(path)
    back = memsched.Trace.from_json(path)
    assert back.to_json_string() == t.to_json_string()
    with pytest.raises(TypeError, match="os.PathLike"):
        memsched.Trace.from_json(3)


def test_elements_taken_before_the_lists_grow_stay_valid():
    """Note [Element lists are copies] (csrc/bindings/bind_trace.cpp): an Op, TensorRecord or TensorDecision
    taken from trace.ops / trace.tensors / plan.decisions is a copy, not a pointer into the C++ vector: one
    kept across add_op/add_tensor (which reallocate) read the allocator's free-list words (heap-use-after-free
    under ASan) and a write through it corrupted the heap."""
    t = build_trace()
    op, rec = t.ops[0], t.tensors[1]
    for i in range(200):  # enough push_backs to move both vectors
        t.add_op(f"extra{i}", "", "backward")
        t.add_tensor(8 + i, "float32", "temporary", producer_op=3 + i, freed_after_op=3 + i)
    assert (op.id, op.name, op.duration_us) == (0, "fc1", 5.0)
    assert (rec.id, rec.bytes, rec.producer_op, list(rec.uses)) == (1, 64, 0, [1, 2])
    rec.bytes = 1 << 40  # a copy: the trace does not change, and nothing else is written
    op.name = "renamed"
    assert t.tensors[1].bytes == 64 and t.ops[0].name == "fc1"
    t.validate()

    plan = memsched.plan(build_trace(), budget=None, planner="keep_all")
    d = plan.decisions[0]
    plan.decisions = plan.decisions * 64  # a longer list: a new buffer
    assert (d.tensor_id, d.offload) == (1, False)
    d.offload = True  # a copy: assign the list back to change the plan
    assert not plan.decisions[0].offload
    decisions = plan.decisions
    decisions[0].offload = True
    plan.decisions = decisions
    assert plan.decisions[0].offload
