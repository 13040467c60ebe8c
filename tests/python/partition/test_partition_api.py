"""memsched.partition(...) on traces: the Partition's figures, JSON, methods side by side, and the
errors (caps no placement meets name the smallest cap that works; bad devices and caps)."""
import pytest

import memsched
from memsched import _C
from memsched.partition import CapsError, Partition, compare, format_table


def _trace(layers=16, seed=3):
    return _C.synthetic_trace(num_layers=layers, ops_per_layer=3, seed=seed)


def test_memsched_partition_is_callable_and_returns_a_fitting_partition(tmp_path):
    t = _trace()
    p = memsched.partition(t, devices=4, cap="40%")
    assert isinstance(p, Partition) and p.method == "s3" and p.fits
    assert len(p.device_of_op) == len(t.ops) and set(p.device_of_op) <= {0, 1, 2, 3}
    assert all(peak <= cap for peak, cap in zip(p.peak_bytes, p.caps))
    assert p.caps == [int(t.peak_bytes() * 0.4)] * 4
    # Everything moved is a transfer, and the single-device makespan is the sum of op times.
    assert p.bytes_moved == sum(x["bytes"] for x in p.transfers)
    one = memsched.partition(t, devices=1, cap="100%")
    assert one.peak_bytes == [t.peak_bytes()] and one.bytes_moved == 0
    p.to_json(tmp_path / "p.json")
    q = Partition.from_json(tmp_path / "p.json")
    assert q == p


def test_compare_puts_every_method_side_by_side_and_s3_is_no_worse():
    t = _trace()
    rows = compare(t, 4, "40%", methods=["s3", "even", "flops", "metis", "milp"])
    by = {r["method"]: r for r in rows}
    assert by["s3"]["ok"]
    assert "skipped" in by["milp"]["error"]
    for m in ("even", "flops", "metis"):
        if by[m]["ok"]:
            assert by["s3"]["partition"].makespan_us <= by[m]["partition"].makespan_us * (1 + 1e-9)
    text = format_table(rows)
    for m in ("s3", "even", "flops", "metis", "milp"):
        assert m in text


def test_caps_no_placement_meets_name_the_smallest_cap_that_works():
    t = _trace()
    with pytest.raises(CapsError) as err:
        memsched.partition(t, devices=2, cap="20%")
    least = err.value.least_cap
    assert f"cap={least}" in str(err.value) and "smallest cap" in str(err.value)
    assert t.peak_bytes() // 2 <= least <= t.peak_bytes()
    assert memsched.partition(t, devices=2, cap=least).fits


def test_a_baseline_that_breaks_the_cap_is_refused_with_the_least_cap():
    t = _trace()
    rows = compare(t, 4, "30%", methods=["s3", "even"])
    if rows[1]["ok"]:
        pytest.skip("even split fits here")
    with pytest.raises(CapsError, match="method 'even'"):
        memsched.partition(t, devices=4, cap="30%", method="even")


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=0, cap="1GiB"), "devices: need at least 1"),
    (dict(devices=["h100-sxm", "nope"], cap="1GiB"), r"devices\[1\]"),
    (dict(devices=2, cap=["1GiB"]), "1 caps for 2 devices"),
    (dict(devices=2, cap="lots"), "cap: cannot read"),
    (dict(devices=2, cap="1GiB", links=-3), "links"),
    (dict(devices=2, cap="1GiB", links=[[0, 1], [0, 0]]), r"links\[1\]\[0\]"),
    (dict(devices=2, cap="1GiB", method="magic"), "unknown method"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memsched.partition(_trace(4), **kwargs)


def test_links_matrix_and_presets_change_the_transfer_cost():
    t = _trace()
    fast = memsched.partition(t, devices=2, cap="60%", method="flops", links=1000.0)
    slow = memsched.partition(t, devices=2, cap="60%", method="flops", links=[[0, 1.0], [1.0, 0]])
    assert fast.device_of_op == slow.device_of_op
    assert slow.makespan_us > fast.makespan_us


def test_a_baseline_that_breaks_caps_s3_meets_points_to_s3_not_to_a_smaller_cap():
    # was: "the smallest cap ... at which S3 fits is X: pass cap=X or more" with the cap asked for already above X
    t = _trace()
    with pytest.raises(CapsError) as err:
        memsched.partition(t, devices=4, cap=1)
    cap = err.value.least_cap  # S3 fits here; the baselines, which balance layers or FLOPs, break it
    assert memsched.partition(t, devices=4, cap=cap).fits
    rows = compare(t, 4, cap, methods=["even", "flops"])
    broken = [r["method"] for r in rows if not r["ok"]]
    assert broken, "a baseline fits S3's least cap; pick another trace"
    with pytest.raises(CapsError) as err:
        memsched.partition(t, devices=4, cap=cap, method=broken[0])
    text = str(err.value)
    assert f"method {broken[0]!r} found no placement" in text and "use method='s3'" in text
    assert "or more" not in text and err.value.least_cap == cap


@pytest.mark.parametrize("methods,expected", [("s3", ["s3"]), ("s3,even", ["s3", "even"]),
                                              (" flops , s3 ", ["flops", "s3"])])
def test_compare_reads_a_methods_string_as_the_command_line_does(methods, expected):
    # was: the string was read letter by letter ("partition: unknown method 's'")
    rows = compare(_trace(), 2, "100%", methods=methods)
    assert [r["method"] for r in rows] == expected


def test_compare_names_an_unknown_method_in_a_methods_string():
    with pytest.raises(ValueError, match=r"unknown method 'foo'; known: s3, even"):
        compare(_trace(), 2, "100%", methods="s3,foo")


@pytest.mark.parametrize("devices", [2.5, object()])
def test_a_device_count_that_is_not_a_whole_number_is_named(devices):
    # was: TypeError "'float' object is not iterable"
    with pytest.raises(ValueError, match=r"devices: expected a device count \(e.g. 4\) or a list"):
        memsched.partition(_trace(), devices=devices, cap="100%")


@pytest.mark.parametrize("kwargs, words", [
    ({"time_limit_s": 0}, "time_limit_s must be a number of seconds > 0, got 0"),
    ({"time_limit_s": -1}, "time_limit_s must be .* got -1"),
    ({"time_limit_s": float("nan")}, "time_limit_s"),
    ({"milp_time_limit_s": 0.0}, "milp_time_limit_s must be"),
    ({"seed": "x"}, "seed must be a whole number from 0 .* got 'x'"),
    ({"seed": -1}, "seed must be"),
    ({"seed": 1.5}, "seed must be"),
    ({"milp_max_ops": -3}, "milp_max_ops must be a whole number >= 0 .* got -3"),
    ({"milp_max_ops": True}, "milp_max_ops"),
])
def test_bad_search_options_are_refused_by_name_before_any_work(kwargs, words):
    with pytest.raises(ValueError, match=words):
        memsched.partition(_trace(), devices=2, **kwargs)
    with pytest.raises(ValueError, match=words):  # not a row saying 'skipped' or a raw pybind TypeError
        compare(_trace(), 2, methods="s3,milp", **kwargs)


def test_a_saved_partition_states_the_link_matrix_it_was_simulated_with(tmp_path):
    t = _trace()
    slow = [[0, 1.0], [2.0, 0]]
    p = memsched.partition(t, devices=2, links=slow)
    assert p.links == [[0.0, 1.0], [2.0, 0.0]] and p.link_bw_gbps is None  # not the NVLink default it never used
    p.to_json(tmp_path / "p.json")
    assert Partition.from_json(tmp_path / "p.json") == p
    q = memsched.partition(t, devices=2)
    assert q.links == [] and q.link_bw_gbps == 450.0
