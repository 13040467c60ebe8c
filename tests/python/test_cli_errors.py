"""Bad command-line input is refused before any work, with a message naming the option (issue 9):
numbers by their argparse types, output paths before profiling / planning / training. Missing folders
on the way to an output are created (Note [Command-line input is checked before the work])."""
import pytest

import memsched
from memsched import models
from memsched.__main__ import main as cli_main


@pytest.fixture
def no_work(monkeypatch):
    """Any model build, profile or plan means the command started its work."""
    def started(*args, **kwargs):
        raise AssertionError("the command started its work before refusing its arguments")
    monkeypatch.setattr(models, "build_model", started)
    monkeypatch.setattr(memsched.planning, "compare", started)


@pytest.mark.parametrize("argv,option,words", [
    (["demo", "--steps", "0"], "--steps", "must be >= 2"),
    (["demo", "--steps", "1"], "--steps", "must be >= 2"),
    (["demo", "--batch", "0"], "--batch", "must be >= 1"),
    (["demo", "--batch", "two"], "--batch", "expected a whole number"),
    (["demo", "--budget", "0"], "--budget", "fraction in (0, 1]"),
    (["demo", "--budget", "1.5"], "--budget", "fraction in (0, 1]"),
    (["demo", "--budget", "nan"], "--budget", "fraction in (0, 1]"),
    (["demo", "--warmup", "-1"], "--warmup", "must be >= 0"),
    (["demo", "--device", "tpu"], "--device", "not a torch device"),
    (["profile", "--batch", "-3"], "--batch", "must be >= 1"),
    (["profile", "--warmup", "-1"], "--warmup", "must be >= 0"),
    (["profile", "--device", "gpu0"], "--device", "not a torch device"),
    (["plan", "t.json", "--budget", "1e30"], "--budget", "2**63 - 1"),
    (["plan", "t.json", "--budget", "nan"], "--budget", "budget"),
    (["plan", "t.json", "--budget", "2.5"], "--budget", "(0, 1]"),
])
def test_bad_numbers_are_refused_by_argparse(argv, option, words, no_work, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and words in err, err
    assert "Traceback" not in err


def test_demo_steps_zero_is_not_a_statistics_error(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "memsched", "demo", "--steps", "0", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "StatisticsError" not in proc.stderr and "Traceback" not in proc.stderr
    assert "argument --steps: must be >= 2" in proc.stderr


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    return f


@pytest.mark.parametrize("command", ["profile", "plan"])
def test_unwritable_out_is_refused_before_the_work(command, a_file, tmp_path, no_work, capsys):
    trace = tmp_path / "t.json"
    memsched._C.synthetic_trace(num_layers=2, ops_per_layer=2, seed=1).to_json(str(trace))
    prefix = ["profile", "--model", "mlp"] if command == "profile" else ["plan", str(trace), "--budget", "50%"]
    for out, why in ((a_file / "sub" / "x.out", "cannot create this folder"), (tmp_path, "is a folder")):
        rc = cli_main(prefix + ["--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and f"--out {out}" in err and why in err, err


@pytest.mark.parametrize("name", ["trace.png", "t.SVG"])
def test_profile_out_with_an_image_extension_is_refused_before_the_work(name, tmp_path, no_work, capsys):
    out = tmp_path / name
    assert cli_main(["profile", "--model", "mlp", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: the trace is JSON" in err and "give a .json path" in err and "memsched plan" in err, err
    assert not out.exists()


def test_demo_out_dir_that_is_a_file_is_refused_before_the_work(a_file, no_work, capsys):
    assert cli_main(["demo", "--out-dir", str(a_file), "--no-compare"]) == 2
    err = capsys.readouterr().err
    assert f"--out-dir {a_file}" in err and "cannot create this folder" in err


def test_out_into_missing_folders_is_created(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "trace.json"
    assert cli_main(["profile", "--model", "mlp", "--batch", "2", "--warmup", "0", "--out", str(out)]) == 0
    trace = memsched.Trace.from_json(str(out))
    png = tmp_path / "plots" / "timeline.png"
    assert cli_main(["plan", str(out), "--budget", "1.0", "--planner", "dp", "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "best: dp" in capsys.readouterr().out
    assert trace.peak_bytes() > 0


def test_a_batch_that_does_not_fit_in_memory_is_a_message_not_a_traceback(tmp_path, capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 13599999999864 bytes")

    monkeypatch.setattr(models, "make_step_fn", out_of_memory)
    rc = cli_main(["profile", "--batch", "100000", "--out", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "out of memory" in err and "lower --batch (it is 100000)" in err


@pytest.mark.parametrize("command", ["profile", "demo"])
def test_an_endless_warmup_is_refused(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main([command, "--warmup", "100000000000000000000000"])
    assert info.value.code == 2 and "--warmup" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["profile", "demo"])
def test_a_batch_beyond_any_example_is_refused_by_argparse(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main([command, "--batch", "99999999999999999999"])
    assert info.value.code == 2 and "--batch" in capsys.readouterr().err


def test_a_trace_without_ops_is_refused_by_plan(tmp_path, capsys):
    """plan exited 0 on a trace of no op, with "nanx" in every row, and wrote an empty timeline."""
    path = tmp_path / "empty.json"
    path.write_text('{"version": 1, "device": "cpu", "ops": [], "tensors": []}')
    assert cli_main(["plan", str(path), "--budget", "50%", "--out", str(tmp_path / "t.png")]) == 2
    assert "the trace has no ops" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_demo_below_the_least_budget_runs_at_the_least_budget(tmp_path, capsys):
    """--budget 0.1 is below the least any plan reaches on the demo's model: the demo's retry at the least
    budget of the trace alone, without the AdamW state the first step created, was refused again, and the
    command ended in a MemschedError traceback after the plain and keep-all runs."""
    assert cli_main(["demo", "--budget", "0.1", "--steps", "2", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "used that least budget" in out and "at the least budget" in out
