"""memsched.offload.compare: the side-by-side run of `python -m memsched demo` (plain PyTorch,
memsched keep_all, memsched under a budget), in-process on CPU with the demo's model."""
import statistics

import memsched
from memsched.offload.compare import compare
from memsched.offload.report import planned_activation_curve


def test_compare_trains_three_ways_bitwise_and_the_budget_offloads(tmp_path):
    lines = []
    png = tmp_path / "timeline.png"
    rows, run = compare("transformer", "small", batch=2, steps=3, budget_fraction=0.5, device="cpu",
                        timeline_path=str(png), out=lines.append)
    text = "\n".join(lines)
    assert [r[0] for r in rows][:2] == ["plain PyTorch", "memsched keep_all (no budget)"]
    assert len(rows) == 3 and rows[2][0].startswith("memsched ")
    assert [r[-1] for r in rows] == ["yes", "yes", "yes"]  # the same weights as plain PyTorch, bitwise
    assert rows[1][4] == "0 B"  # keep_all moves nothing
    executed = [s for s in run.step_stats if s.mode == "planned"]
    assert run.steps_profiled == 1 and len(executed) == 2
    assert all(s.offloaded > 0 and s.d2h_bytes == s.h2d_bytes > 0 for s in executed)
    peak = max(s.peak_bytes for s in executed)
    assert rows[2][3] == memsched.format_bytes(peak)
    assert rows[2][4] == memsched.format_bytes(statistics.median(s.d2h_bytes + s.h2d_bytes for s in executed))
    assert peak < max(planned_activation_curve(run.trace, None))  # less saved-activation memory than keep_all
    assert "weights == plain" in text and f"wrote {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
