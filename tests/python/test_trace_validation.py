"""A Trace that is out of range -- op ids past the last op, bytes whose sums overflow int64, numbers that
are not finite, names that are not UTF-8 -- gets a memsched.MemschedError naming the record and the field
from every entry point, whether it was built in Python (add_op/add_tensor) or loaded from JSON. Never a
segfault, a negative peak, a bare JSON error or a UnicodeDecodeError (See Note [Trace value bounds])."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import memsched
from memsched import allocator

# The probe imports the same memsched as this test does.
_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in [os.path.dirname(os.path.dirname(os.path.abspath(memsched.__file__))), os.environ.get("PYTHONPATH")] if p))


def _run_probe(code):
    """Run `code` in a fresh interpreter: a segfault fails the test instead of killing pytest."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=_ENV)
    assert proc.returncode == 0, f"probe died with rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_out_of_range_op_id_from_python_is_an_error_at_every_entry_point_not_a_segfault():
    out = _run_probe("""
        import memsched
        from memsched import allocator
        t = memsched.Trace(); t.add_op('a'); t.add_op('b')
        t.add_tensor(8, 'float32', 'activation', producer_op=0, uses=[1], freed_after_op=100000000)
        entry_points = {
            'peak_bytes': t.peak_bytes, 'live_bytes': t.live_bytes, 'peak_op': t.peak_op,
            'activation_bytes': t.activation_bytes, 'bytes_of_kind': lambda: t.bytes_of_kind('activation'),
            'to_json_string': t.to_json_string, 'validate': t.validate,
            'plan': lambda: memsched.plan(t, budget='1KiB'), 'plan_pct': lambda: memsched.plan(t, budget='50%'),
            'simulate': lambda: memsched.simulate(t, memsched.Plan()),
            'least_budget_bytes': lambda: memsched._C.least_budget_bytes(t),
            'plan_placement': lambda: allocator.plan_placement(t),
            'replay_trace': lambda: allocator.replay_trace(t),
        }
        for name, call in entry_points.items():
            try:
                call()
                print('ACCEPTED', name)
            except memsched.MemschedError as e:
                print('ERROR', name, '|', e)
    """)
    lines = out.splitlines()
    assert len(lines) == 13, out
    for line in lines:
        assert line.startswith("ERROR"), line
        assert "tensors[0] field 'freed_after_op' is 100000000 but there are 2 ops" in line, line


def test_int64_max_bytes_is_refused_not_a_negative_peak():
    t = memsched.Trace()
    t.add_op("a")
    t.add_tensor(2**63 - 1, "float32", "activation", producer_op=0)
    t.add_tensor(8, "float32", "activation", producer_op=0)
    with pytest.raises(memsched.MemschedError, match=r"tensors\[0\] field 'bytes' is 9223372036854775807"):
        t.peak_bytes()
    with pytest.raises(memsched.MemschedError, match=r"tensors\[0\] field 'bytes'"):
        t.activation_bytes()


def test_several_bytes_of_2_to_62_are_refused_by_their_sum():
    t = memsched.Trace()
    t.add_op("a")
    for _ in range(3):
        t.add_tensor(2**62, "float32", "parameter")
    with pytest.raises(memsched.MemschedError, match=r"tensors\[1\] field 'bytes' .*overflow"):
        t.peak_bytes()
    with pytest.raises(memsched.MemschedError, match=r"tensors\[1\] field 'bytes'"):
        memsched.plan(t, budget=None)


def test_several_bytes_of_2_to_62_from_json_are_refused_at_load(tmp_path):
    t = memsched.Trace()
    t.add_op("a")
    t.add_tensor(8, "float32", "parameter")
    t.add_tensor(8, "float32", "parameter")
    doc = json.loads(t.to_json_string())
    for rec in doc["tensors"]:
        rec["bytes"] = 2**62
    path = tmp_path / "big.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(memsched.MemschedError, match=r"tensors\[1\] field 'bytes' .*overflow"):
        memsched.Trace.from_json(str(path))


def _one_op_json():
    t = memsched.Trace()
    t.add_op("matmul", "fc1", "forward", duration_us=3.0, flops=12.0)
    t.add_tensor(8, "float32", "parameter", uses=[0], label="fc1.weight")
    return t.to_json_string()


def test_flops_1e400_in_json_names_the_record_and_field(tmp_path):
    text = _one_op_json().replace('"flops":12.0', '"flops":1e400')
    assert "1e400" in text
    path = tmp_path / "inf.json"
    path.write_text(text)
    with pytest.raises(memsched.MemschedError, match=r"ops\[0\] field 'flops' is out of range") as info:
        memsched.Trace.from_json(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("field", ["flops", "duration_us"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300])
def test_non_finite_or_huge_op_numbers_from_python_name_the_field(field, value):
    t = memsched.Trace()
    t.add_op("a", **{field: value})
    t.add_tensor(8, "float32", "activation", producer_op=0)
    with pytest.raises(memsched.MemschedError, match=rf"ops\[0\] \('a'\) field '{field}'"):
        memsched.plan(t)
    with pytest.raises(memsched.MemschedError, match=rf"ops\[0\] \('a'\) field '{field}'"):
        t.to_json_string()


def test_invalid_utf8_name_in_json_is_refused_at_load(tmp_path):
    raw = _one_op_json().encode().replace(b'"name":"matmul"', b'"name":"mat\xffmul"')
    assert b"\xff" in raw
    path = tmp_path / "utf8.json"
    path.write_bytes(raw)
    with pytest.raises(memsched.MemschedError, match=r"ops\[0\] field 'name' is not valid UTF-8"):
        memsched.Trace.from_json(str(path))


def test_invalid_utf8_name_from_python_reads_back_replaced_and_is_refused_by_validation():
    t = memsched.Trace()
    t.add_op(b"mat\xffmul", module_path=b"fc\xfe1")
    t.add_tensor(8, b"float\xff", "parameter", uses=[0], label=b"w\xff")
    t.device = b"cu\xffda"
    # Reading a name never raises UnicodeDecodeError: undecodable bytes read as U+FFFD.
    assert t.ops[0].name == "mat\ufffdmul" and t.ops[0].module_path == "fc\ufffd1"
    assert t.tensors[0].dtype == "float\ufffd" and t.tensors[0].label == "w\ufffd"
    assert t.device == "cu\ufffdda"
    assert "mat\ufffdmul" in repr(t.ops[0]) and "cu\ufffdda" in repr(t)
    with pytest.raises(memsched.MemschedError, match=r"the top level field 'device' is not valid UTF-8"):
        t.validate()
    t.device = "cpu"
    with pytest.raises(memsched.MemschedError, match=r"ops\[0\] field 'name' is not valid UTF-8"):
        t.peak_bytes()
    with pytest.raises(memsched.MemschedError, match=r"ops\[0\] field 'name' is not valid UTF-8"):
        memsched.plan(t)
    op = t.ops[0]  # a copy: set it back through the list
    op.name, op.module_path = "matmul", "fc1"
    t.ops = [op]
    with pytest.raises(memsched.MemschedError, match=r"tensors\[0\] field 'dtype' is not valid UTF-8"):
        t.to_json_string()


def test_an_error_quoting_bytes_that_are_not_utf8_is_a_memsched_error():
    # The message quotes the bad text; raising it must not raise UnicodeDecodeError instead.
    with pytest.raises(memsched.MemschedError, match="unknown phase 'side\ufffd'"):
        memsched.Trace().add_op("a", phase=b"side\xff")
    with pytest.raises(memsched.MemschedError, match="unknown tensor kind"):
        memsched.Trace().add_tensor(8, "float32", b"\xfe")


def test_placement_alignment_that_would_overflow_is_refused():
    t = memsched.Trace()
    t.add_op("a")
    t.add_tensor(2**61, "float32", "activation", producer_op=0)
    with pytest.raises(memsched.MemschedError, match="alignment_bytes"):
        allocator.plan_placement(t, alignment_bytes=2**63 - 1)


@pytest.mark.parametrize("call, field", [
    (lambda t: t.add_op("x", bytes_read=2**63), "bytes_read"),
    (lambda t: t.add_op("x", flops="a"), "flops"),
    (lambda t: t.add_op(3), "name"),
    (lambda t: t.add_tensor(1.5, "float32", "activation"), "bytes"),
    (lambda t: t.add_tensor(8, "float32", "activation", uses="ab"), "uses"),
    (lambda t: t.add_tensor(8, "float32", "activation", uses=[2**64]), "uses"),
])
def test_builder_arguments_pybind_cannot_convert_name_the_argument(call, field):
    with pytest.raises(memsched.MemschedError, match=field):
        call(memsched.Trace())


def test_a_name_with_a_lone_surrogate_is_named_by_validate():
    t = memsched.Trace()
    t.add_op("a")
    t.add_tensor(8, "\udcff", "activation")
    with pytest.raises(memsched.MemschedError, match="dtype"):
        t.validate()
