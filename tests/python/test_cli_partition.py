"""python -m memsched partition TRACE --devices N --cap C: the methods table, the JSON, and the errors."""
import json

from memsched import _C
from memsched.__main__ import main


def _trace_file(tmp_path):
    t = _C.synthetic_trace(num_layers=12, ops_per_layer=2, seed=5)
    path = tmp_path / "trace.json"
    t.to_json(str(path))
    return path, t


def test_partition_prints_the_methods_table_and_writes_json(tmp_path, capsys):
    path, t = _trace_file(tmp_path)
    out = tmp_path / "p.json"
    assert main(["partition", str(path), "--devices", "4", "--cap", "40%", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("method", "makespan ms", "per-device peak", "bytes moved", "s3", "even", "flops", "metis", "milp"):
        assert word in text
    assert "4 x h100-sxm" in text
    saved = json.loads(out.read_text())
    assert saved["version"] == 1 and len(saved["device_of_op"]) == len(t.ops) and saved["fits"]


def test_caps_nothing_meets_name_the_cap_that_works(tmp_path, capsys):
    path, t = _trace_file(tmp_path)
    assert main(["partition", str(path), "--devices", "2", "--cap", "1MiB", "--methods", "s3,even"]) == 1
    err = capsys.readouterr().err
    assert "smallest cap" in err and "pass --cap " in err


def test_bad_cap_and_method_are_refused_before_work(tmp_path, capsys):
    path, _ = _trace_file(tmp_path)
    assert main(["partition", str(path), "--cap", "eight gigs"]) == 2
    assert "cap: cannot read" in capsys.readouterr().err
    assert main(["partition", str(path), "--cap", "8GiB", "--methods", "s3,magic"]) == 2
    assert "unknown method(s) magic" in capsys.readouterr().err
    assert main(["partition", str(tmp_path / "missing.json"), "--cap", "8GiB"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_no_method_and_more_devices_than_ops_are_refused_before_work(tmp_path, capsys):
    """--methods "" printed a TypeError traceback (a table of no row); --devices 10**9 built a list of that many
    device names and filled the host's memory."""
    path, t = _trace_file(tmp_path)
    assert main(["partition", str(path), "--cap", "8GiB", "--methods", ""]) == 2
    assert "--methods names no method" in capsys.readouterr().err
    assert main(["partition", str(path), "--cap", "8GiB", "--devices", str(10**9)]) == 2
    assert f"give at most {len(t.ops)}" in capsys.readouterr().err


def test_the_api_refuses_no_method_and_more_devices_than_ops():
    import pytest

    import memsched

    t = _C.synthetic_trace(num_layers=2, ops_per_layer=2, seed=5)
    with pytest.raises(ValueError, match="methods names no method"):
        memsched.partition.compare(t, 2, "50%", methods="")
    with pytest.raises(ValueError, match=f"devices: {10**9} devices for a trace of {len(t.ops)} ops"):
        memsched.partition(t, devices=10**9, cap="8GiB")


def test_methods_that_all_skip_say_so_not_that_the_caps_fail(tmp_path, capsys):
    """milp alone on more ops than it takes: the message said no placement met the caps and to pass a cap the
    given one already exceeded."""
    path, t = _trace_file(tmp_path)
    assert len(t.ops) > 24
    assert main(["partition", str(path), "--devices", "2", "--cap", "8GiB", "--methods", "milp"]) == 1
    err = capsys.readouterr().err
    assert "no method produced a placement (milp: skipped" in err and "pass --cap" not in err
