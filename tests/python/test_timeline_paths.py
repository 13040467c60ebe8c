"""Timeline PNGs are written to exactly the path given; an extension matplotlib cannot write is a
clear error naming the path -- before the work for `python -m memsched plan --out` -- never a
ValueError from inside savefig after the planning, and a name without an extension is not silently
written as NAME.png."""
import pytest

from memsched import planning
from memsched.__main__ import main as cli_main
from memsched.offload.report import save_timeline as report_save_timeline
from trace_helpers import two_activation_trace


def _result():
    t = two_activation_trace()
    return planning.simulate(t, planning.plan(t, None, "offload_all_sync"))


def test_plan_out_with_an_unknown_extension_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    trace = tmp_path / "t.json"
    two_activation_trace().to_json(str(trace))
    monkeypatch.setattr(planning, "compare", lambda *a, **k: pytest.fail("planned before checking --out"))
    out = tmp_path / "timeline.unknownext"
    assert cli_main(["plan", str(trace), "--budget", "1.0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and "'.unknownext'" in err and ".png" in err


def test_plan_out_without_extension_writes_that_exact_file(tmp_path, capsys):
    trace = tmp_path / "t.json"
    two_activation_trace().to_json(str(trace))
    out = tmp_path / "timeline"
    assert cli_main(["plan", str(trace), "--budget", "1.0", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "timeline.png").exists()


@pytest.mark.parametrize("save", ["planning", "report"])
def test_save_timeline_paths(save, tmp_path):
    def call(path):
        if save == "planning":
            return planning.save_timeline(_result(), str(path))
        return report_save_timeline(str(path), "t", [(0.0, 1), (1.0, 2)], [], [])
    with pytest.raises(ValueError, match="cannot write a '.bogus' image"):
        call(tmp_path / "x.bogus")
    with pytest.raises(ValueError, match="is a folder"):
        call(tmp_path)  # was: a PNG written next to the folder, as <folder>.png
    assert not (tmp_path.parent / (tmp_path.name + ".png")).exists()
    call(tmp_path / "noext")
    assert (tmp_path / "noext").read_bytes()[:4] == b"\x89PNG"
    call(tmp_path / "x.svg")
    assert b"<svg" in (tmp_path / "x.svg").read_bytes()[:400]


def _run(timeline):
    import torch
    import torch.nn as nn
    import memsched
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.5,
                           timeline=timeline) as run:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            run.step()
    return run


@pytest.mark.parametrize("timeline", [True, False])
def test_run_save_timeline_with_an_unsupported_extension_names_png_and_json(timeline, tmp_path):
    # was: '.txt' named only image formats (never .json), or -- without timeline=True -- only that
    run = _run(timeline)
    with pytest.raises(ValueError, match=r"x\.txt: '\.txt' is not supported; use \.png for an image or \.json "
                                         r"for a Chrome trace"):
        run.save_timeline(str(tmp_path / "x.txt"))
    assert not (tmp_path / "x.txt").exists()


def test_run_save_timeline_png_without_a_timeline_points_at_json(tmp_path):
    run = _run(False)
    with pytest.raises(RuntimeError, match=r"timeline=True.*'\.json' path writes the planned step"):
        run.save_timeline(str(tmp_path / "x.png"))
    assert run.save_timeline(str(tmp_path / "x.json")) == str(tmp_path / "x.json")


def test_run_save_timeline_names_a_wrong_extension_before_any_step(tmp_path):
    """The path's form is checked first: before any step, '.txt' is refused for its extension (a
    retry after the steps would fail on it again), not for the missing profile."""
    import torch
    import memsched
    model = torch.nn.Linear(8, 8)
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None) as run:
        with pytest.raises(ValueError, match=r"'\.txt' is not supported; use \.png for an image or \.json"):
            run.save_timeline(str(tmp_path / "x.txt"))
        with pytest.raises(RuntimeError, match="no step has been profiled yet"):
            run.save_timeline(str(tmp_path / "x.json"))


@pytest.mark.parametrize("name", ["step.json", "step.png"])
def test_run_save_timeline_creates_missing_folders_as_the_cli_does(name, tmp_path):
    # was: a bare FileNotFoundError from json's open or from PIL
    run = _run(True)
    out = tmp_path / "new" / "deeper" / name
    assert run.save_timeline(out) == out and out.stat().st_size > 0


def test_run_save_timeline_refuses_what_is_no_path(tmp_path):
    run = _run(True)
    with pytest.raises(TypeError, match=r"run.save_timeline: path: expected a file path \(a str or os.PathLike\), got int"):
        run.save_timeline(5)
    with pytest.raises(TypeError, match=r"run.save_timeline: torch_trace: expected a file path.*got dict"):
        run.save_timeline(tmp_path / "x.json", torch_trace={"traceEvents": []})
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"run.save_timeline: path .*cannot create this folder"):
        run.save_timeline(blocker / "x.json")


def test_a_negative_offset_is_refused(tmp_path):
    import json
    run = _run(True)
    torch_trace = tmp_path / "torch.json"
    torch_trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 10.0, "dur": 5.0,
                                                        "pid": 1, "tid": 1}]}))
    with pytest.raises(ValueError, match=r"offset_us: expected a finite number of microseconds >= 0"):
        run.save_timeline(tmp_path / "m.json", torch_trace=torch_trace, offset_us=-1e6)
