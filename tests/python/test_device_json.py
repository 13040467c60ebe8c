"""A device JSON that is not JSON, or has a field of the wrong type, is a ValueError naming the file,
the field and what it must be (issue 9) -- from memsched.plan, load_device and `memsched plan --device`."""
import json
import os

import pytest

import memsched
from memsched.__main__ import main as cli_main
from memsched.device import PRESET_DIR


@pytest.fixture
def good():
    with open(os.path.join(PRESET_DIR, "h100-pcie.json")) as f:
        return json.load(f)


@pytest.fixture
def trace():
    return memsched._C.synthetic_trace(num_layers=2, ops_per_layer=2, seed=1)


@pytest.mark.parametrize("edit,words", [
    (lambda g: "{ not json", ["not valid JSON", "line 1"]),
    (lambda g: json.dumps([1, 2]), ["expected a JSON object", "got a JSON list"]),
    (lambda g: json.dumps(dict(g, peak_flops="fast")), ["field 'peak_flops'", "finite number", '"fast"']),
    (lambda g: json.dumps(dict(g, hbm_bw_gbps=None)), ["field 'hbm_bw_gbps'", "finite number"]),
    (lambda g: json.dumps(dict(g, d2h_bw_gbps=[1])), ["field 'd2h_bw_gbps'"]),
    (lambda g: json.dumps(dict(g, memory_bytes=1.5)), ["field 'memory_bytes'", "whole number of bytes"]),
    (lambda g: json.dumps(dict(g, memory_bytes=2**64)), ["field 'memory_bytes'", "2**63 - 1"]),
    (lambda g: json.dumps(dict(g, name=7)), ["field 'name'", "string"]),
    (lambda g: json.dumps({k: v for k, v in g.items() if k != "h2d_latency_us"}), ["field 'h2d_latency_us'",
                                                                                    "missing"]),
])
def test_bad_device_file_names_file_and_field(edit, words, good, trace, tmp_path):
    path = tmp_path / "mydevice.json"
    path.write_text(edit(good))
    for call in (lambda: memsched.plan(trace, budget=None, device=str(path)), lambda: memsched.load_device(str(path))):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "mydevice.json" in msg and all(w in msg for w in words), msg


def test_device_file_not_utf8_is_named(tmp_path, trace):
    path = tmp_path / "binary.json"
    path.write_bytes(b'{"name": "\xff"}')
    with pytest.raises(ValueError, match=r"binary\.json: not UTF-8"):
        memsched.plan(trace, device=str(path))


def test_cli_plan_with_bad_device_file_is_a_message(good, trace, tmp_path, capsys):
    tp = tmp_path / "t.json"
    trace.to_json(str(tp))
    dev = tmp_path / "dev.json"
    dev.write_text(json.dumps(dict(good, peak_flops="fast")))
    assert cli_main(["plan", str(tp), "--budget", "1.0", "--device", str(dev), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "dev.json" in err and "peak_flops" in err


def test_valid_device_file_still_loads(good, tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(dict(good, name="mine")))
    d = memsched.load_device(str(path))
    assert d.name == "mine" and d.memory_bytes == good["memory_bytes"]


@pytest.mark.parametrize("field, value", [("d2h_latency_us", 1e308), ("peak_flops", 1e-300), ("h2d_bw_gbps", 1e-9)])
def test_device_fields_beyond_any_real_device_are_refused_by_validate(field, value):
    d = memsched.load_device("h100-pcie")
    setattr(d, field, value)
    with pytest.raises(memsched.MemschedError, match=field):
        d.validate()


@pytest.mark.parametrize("spec, words", [(None, "got NoneType"), ("/nonexistent/dev.json", "no such file"),
                                         ("/tmp", "is a folder")])
def test_a_device_that_is_not_a_name_or_file_says_what_it_is(spec, words):
    with pytest.raises(ValueError, match=words):
        memsched.load_device(spec)
