"""gpu_check.py's "Done when" verdicts, fed hand-written results: for each issue a met and a not-met case,
"not measured" where a figure is missing, and a CPU run that judges nothing."""
import pytest

from gpu_scripts import load_gpu_script

GIB = 2 ** 30
MIB = 2 ** 20


def _load():
    return load_gpu_script("gpu_check")


gc = _load()


def _row(method, ms, peak, **kw):
    return dict(method=method, step_ms=ms, peak_bytes=peak, **kw)


def _offload_model():
    """Every bench_offload criterion met (figures shaped as bench_offload.py writes them)."""
    rows = [
        _row("plain", 100.0, 16 * GIB, max_batch=7),
        _row("memsched budget None", 101.0, 16 * GIB, budget_bytes=None, budget_with_state_bytes=None,
             max_batch="n/a (keeps all: plain's)"),
        _row("torch.compile budget 0.5", 80.0, 12 * GIB, max_batch="n/a (recompiles per batch)"),
        _row("trl OffloadActivations", 460.0, 10 * GIB, max_batch=15),
        _row("offload_all_prefetch", 300.0, 9 * GIB, budget_bytes=15 * GIB, budget_with_state_bytes=16 * GIB,
             d2h_bytes=15e9, h2d_bytes=14e9, max_batch=18, max_batch_ms_per_sample=40.0),
        _row("memsched dp 70%", 108.0, 14 * GIB, budget_bytes=13 * GIB, budget_with_state_bytes=14 * GIB,
             d2h_bytes=1e9, h2d_bytes=1e9, max_batch=10),
        {"method": "memsched dp 50%", "error": "MemschedError: budget ... needs at least 123 B"},
        _row("checkpoint", 125.0, 10 * GIB, max_batch=14),
        _row("memsched hybrid 50%", 104.0, 11 * GIB, budget_bytes=11 * GIB, budget_with_state_bytes=12 * GIB,
             max_batch=20, max_batch_ms_per_sample=14.0),
        _row("memsched hybrid 30%", 115.0, 9.5 * GIB, budget_bytes=9 * GIB, budget_with_state_bytes=10 * GIB,
             max_batch=">= 24 (time budget)"),
    ]
    return {"title": "t", "batch": 8, "rows": rows,
            "keep_all_fidelity": {"sim_peak_bytes": 16.2 * GIB, "plain_peak_bytes": 16 * GIB, "ratio": 16.2 / 16}}


def _ooo_rows(plain_ms=10.0, ooo_ms=9.0, fused_ms=10.2, oib_ms=11.0, plain_peak=300 * MIB, fused_peak=220 * MIB,
              oib_peak=230 * MIB, grads=100 * MIB):
    def r(ms, peak):
        return {"median_ms": ms, "iqr_ms": 0.1, "peak_allocated_bytes": 2 * GIB, "step_peak_above_resident_bytes": peak,
                "max_abs_param_diff_vs_plain": 1e-7, "param_grad_bytes": grads, "report": None}
    rows = {"plain": r(plain_ms, plain_peak), "ooo": r(ooo_ms, plain_peak), "ooo_fused": r(fused_ms, fused_peak),
            "optim_in_bwd": r(oib_ms, oib_peak)}
    for m in ("ooo", "ooo_fused", "optim_in_bwd"):
        rows[m]["speedup_vs_plain"] = plain_ms / rows[m]["median_ms"]
    return rows


def _junit(**outcomes):
    """The cuda_tests result as gpu_check.summarize_tests shapes it (outcomes: passed, failed, errors,
    skipped, crashed, not run)."""
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "crashed": 0, "not_run": 0,
           "failures": [], "outcomes": {}, "crashes": [], "processes": [{"rc": 0}]}
    for name, o in outcomes.items():
        out["tests"] += 1
        out[o.replace(" ", "_")] += 1
        out["outcomes"][f"test_mod::{name}"] = o
        if o in ("failed", "errors", "crashed"):
            out["failures"].append({"test": f"test_mod::{name}", "kind": {"failed": "failure", "errors": "error"}.get(o, o),
                                    "message": "boom"})
        if o == "crashed":
            out["crashes"].append({"test": f"test_mod::{name}", "rc": -11, "frame": "python/memsched/planning.py:262 in plan"})
    if out["not_run"]:
        out["not_run_why"] = "the part's time ran out while test_mod::test_slow ran"
    return out


def met_report():
    ok = {"status": "ok", "wall_s": 1.0}
    return {
        "mode": "gpu", "environment": {"cuda_available": True, "gpu": "NVIDIA H100 80GB HBM3"},
        "parts": {p: dict(ok) for p in ("env", "build", "cuda_tests", "offload_gpt", "offload_resnet", "ooo",
                                          "allocator", "trainer")},
        "results": {
            "cuda_tests": _junit(test_pinned_pool_on_gpu="passed",
                                 test_memsched_never_hands_out_a_block_a_stream_may_still_touch="passed",
                                 **{"test_budget[0.7-mlp]": "passed"}),
            "offload": {"gpt": _offload_model(), "resnet": _offload_model()},
            "ooo": {"env": {}, "models": {"MobileNetV3-small (torchvision) b32 224px": _ooo_rows(ooo_ms=9.0),
                                          "memsched transformer (realistic) b32": _ooo_rows(ooo_ms=9.9)}},
            "allocator": {"step_ratio": {f: {"median": 1.01, "min": 0.99, "max": 1.02,
                                             "fragmentation": {"native": 1.3, "memsched": 1.29}}
                                         for f in ("transformer", "cnn", "mlp")}},
            "trainer": {"rows": [
                {"row": "plain", "median_ms": 100.0, "min_ms": 99, "max_ms": 101, "peak_allocated_bytes": 17 * GIB},
                {"row": "checkpointing", "median_ms": 130.0, "min_ms": 129, "max_ms": 131,
                 "peak_allocated_bytes": 10 * GIB},
                {"row": "memsched-dp-50%", "median_ms": 120.0, "min_ms": 119, "max_ms": 121,
                 "peak_allocated_bytes": 12 * GIB, "budget_with_state_bytes": 12 * GIB, "mismatches": 0,
                 "steps_planned": 5, "keep_all_sim_peak_bytes": 17.2 * GIB}]},
        }}


def by_criterion(report):
    vs = gc.verdicts(report)
    assert len(vs) == len(gc.CRITERIA)
    return {(v["issue"], v["criterion"]): v for v in vs}


def _find(vs, issue, words):
    (key,) = [k for k in vs if k[0] == issue and words in k[1]]
    return vs[key]


def test_all_met():
    vs = by_criterion(met_report())
    not_met = {k: v for k, v in vs.items() if v["verdict"] != "met"}
    # the one criterion no bench can settle: the 1M-operation stress run is not a part
    assert list(not_met) == [(14, "allocator stress test, 1M operations")], not_met
    assert "20,000-op pytest run: passed" in not_met[(14, "allocator stress test, 1M operations")]["measured"]
    assert "1.010x" in _find(vs, 10, "budget=None")["measured"]


# (issue, words of its criterion, how to break the met report[, other criteria the same break fails])
def _set(path, value):
    def apply(rep):
        obj = rep
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return apply


def _offload_row(model, method, **changes):
    def apply(rep):
        row = next(r for r in rep["results"]["offload"][model]["rows"] if r["method"] == method)
        row.update(changes)
    return apply


def _ooo(label, mode, **changes):
    def apply(rep):
        rep["results"]["ooo"]["models"][label][mode].update(changes)
    return apply


MOBILE = "MobileNetV3-small (torchvision) b32 224px"
TRANSFORMER = "memsched transformer (realistic) b32"
BREAKS = [
    (10, "budget=None", _offload_row("resnet", "memsched budget None", step_ms=103.0)),
    (10, "dp 70%", _offload_row("gpt", "memsched dp 70%", step_ms=111.0)),
    (10, "TRL", _offload_row("gpt", "offload_all_prefetch", peak_bytes=11 * GIB)),  # faster, but more peak
    (10, "test_pinned_pool_on_gpu", _set(["results", "cuda_tests"], _junit(test_pinned_pool_on_gpu="failed")),
     [(14, "every pytest")]),
    (11, "keep_all", _set(["results", "offload", "gpt", "keep_all_fidelity", "ratio"], 0.77)),
    (11, "keep_all", _set(["results", "trainer", "rows", 2, "keep_all_sim_peak_bytes"], 13 * GIB)),
    (11, "budget", _offload_row("resnet", "memsched hybrid 30%", budget_with_state_bytes=9 * GIB)),
    (11, "budget", _set(["results", "trainer", "rows", 2, "peak_allocated_bytes"], 13 * GIB)),
    (11, "largest batch", lambda rep: [_offload_row("gpt", m, max_batch=14)(rep) for m in
                                       ("offload_all_prefetch", "memsched hybrid 50%", "memsched hybrid 30%")]),
    (12, "hybrid 50%", _offload_row("gpt", "memsched hybrid 50%", step_ms=106.0)),
    (12, "hybrid 30%", _offload_row("resnet", "memsched hybrid 30%", step_ms=121.0)),
    (12, "checkpoint's peak", _offload_row("gpt", "checkpoint", peak_bytes=9 * GIB)),
    (13, "ooo speedup vs plain", _ooo(TRANSFORMER, "ooo", speedup_vs_plain=0.98)),
    (13, "MobileNetV3-small b32", _ooo(MOBILE, "ooo", speedup_vs_plain=1.04)),
    (13, "step time vs plain", _ooo(TRANSFORMER, "ooo_fused", median_ms=10.4)),
    (13, "step peak", _ooo(MOBILE, "ooo_fused", step_peak_above_resident_bytes=240 * MIB), [(13, "optim_in_bwd")]),
    (13, "optim_in_bwd", _ooo(TRANSFORMER, "optim_in_bwd", median_ms=10.1)),
    (14, "every pytest", _set(["results", "cuda_tests"], _junit(test_a="passed", test_b="errors")),
     [(10, "test_pinned_pool_on_gpu")]),
    # a test that killed its process (Note [CUDA tests that crash]) fails both, like a failed one
    (14, "every pytest", _set(["results", "cuda_tests"], _junit(test_pinned_pool_on_gpu="passed", test_b="crashed")),
     [(10, "test_pinned_pool_on_gpu")]),
    (14, "whole-step", _set(["results", "allocator", "step_ratio", "cnn", "median"], 1.13)),
    (14, "fragmentation", _set(["results", "allocator", "step_ratio", "mlp", "fragmentation", "memsched"], 1.4)),
    (17, "Trainer", _set(["results", "trainer", "rows", 2], {"row": "memsched-dp-50%",
                                                             "error": "OutOfMemoryError: CUDA out of memory"})),
]


@pytest.mark.parametrize("case", BREAKS, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BREAKS)])
def test_not_met(case):
    issue, words, brk = case[:3]
    rep = met_report()
    brk(rep)
    vs = by_criterion(rep)
    v = _find(vs, issue, words)
    assert v["verdict"] == "NOT met", v
    # nothing else changed its verdict to NOT met, but what the same figure also fails
    expected = {(v["issue"], v["criterion"])} | {
        (x["issue"], x["criterion"]) for i, w in (case[3] if len(case) > 3 else []) for x in [_find(vs, i, w)]}
    assert {k for k, x in vs.items() if x["verdict"] == "NOT met"} == expected


def test_each_issue_has_a_met_and_a_not_met_case():
    vs = by_criterion(met_report())
    for issue in (10, 11, 12, 13, 14, 17):
        assert any(v["verdict"] == "met" for k, v in vs.items() if k[0] == issue)
        assert any(c[0] == issue for c in BREAKS)


def test_missing_figures_are_not_measured_with_why():
    rep = met_report()
    rep["results"]["offload"]["gpt"]["rows"] = [r for r in rep["results"]["offload"]["gpt"]["rows"]
                                                if r["method"] != "trl OffloadActivations"]
    rep["results"]["offload"]["resnet"] = {"skipped": "No module named 'torchvision'"}
    del rep["results"]["allocator"]
    rep["parts"]["allocator"] = {"status": "timeout after 60 s (what it wrote is kept)"}
    rep["results"]["cuda_tests"] = _junit(test_pinned_pool_on_gpu="passed", test_two_gpus="skipped")
    rep["results"]["ooo"]["models"] = {"MobileNetV3-small STAND-IN (no torchvision) b32 224px": _ooo_rows()}
    del rep["results"]["offload"]["gpt"]["rows"][0]["max_batch"]
    vs = by_criterion(rep)
    trl = _find(vs, 10, "TRL")["verdict"]
    assert trl.startswith("not measured") and "trl OffloadActivations' missing" in trl and "torchvision" in trl
    assert _find(vs, 14, "whole-step")["verdict"] == "not measured: part allocator timeout after 60 s (what it wrote is kept)"
    assert "1 skipped" in _find(vs, 14, "every pytest")["verdict"]
    assert "no MobileNetV3-small (torchvision) b32" in _find(vs, 13, "MobileNetV3-small b32")["verdict"]
    assert "no largest batch for plain" in _find(vs, 11, "largest batch")["verdict"]
    # copy throughput: bytes per step / whole step is only a lower bound; under 45 GB/s it settles nothing
    rep = met_report()
    for model in ("gpt", "resnet"):
        _offload_row(model, "offload_all_prefetch", step_ms=400.0)(rep)
    v = _find(by_criterion(rep), 10, "copy throughput")
    assert v["verdict"].startswith("not measured") and ">= 35.0 GB/s" in v["measured"]
    # a largest batch cut by the time budget settles only what its lower bound settles
    rep = met_report()
    _offload_row("gpt", "plain", max_batch=">= 7 (time budget)")(rep)
    assert _find(by_criterion(rep), 11, "largest batch")["verdict"].startswith("not measured")


def test_copy_throughput_from_bench_copy_engine():
    """bench_copy_engine.py's own medians settle the criterion both ways (the bench_offload bound only
    settles 'met')."""
    def copy(d2h, h2d):
        return {"count": 16, "mib": 64, "rounds": 5,
                "rows": {"memsched d2h": {"gbps_median": d2h}, "memsched h2d": {"gbps_median": h2d},
                         "memsched both": {"gbps_median": d2h + h2d - 10}, "torch d2h": {"gbps_median": 53.0}}}
    rep = met_report()
    rep["results"]["copy"] = copy(52.0, 47.5)
    v = _find(by_criterion(rep), 10, "copy throughput")
    assert v["verdict"] == "met" and "d2h 52.0, h2d 47.5 GB/s" in v["measured"] and "torch's own d2h 53.0" in v["measured"]
    rep["results"]["copy"] = copy(52.0, 41.0)
    assert _find(by_criterion(rep), 10, "copy throughput")["verdict"] == "NOT met"


def test_stress_from_the_optional_part():
    rep = met_report()
    run = {"ops": 1_000_000, "allocator": "memsched", "busy_reuse": 0, "canary_errors": 0,
           "forget_record_stream": False, "gpu": "NVIDIA H100 80GB HBM3", "seconds": 95.0}
    rep["results"]["stress"] = dict(run)
    v = _find(by_criterion(rep), 14, "stress")
    assert v["verdict"] == "met" and "1,000,000 ops" in v["measured"]
    rep["results"]["stress"] = dict(run, busy_reuse=3)
    assert _find(by_criterion(rep), 14, "stress")["verdict"] == "NOT met"
    rep["results"]["stress"] = dict(run, ops=20_000)
    assert _find(by_criterion(rep), 14, "stress")["verdict"].startswith("not measured")


def test_cpu_run_judges_nothing():
    rep = met_report()  # figures that would all be met on a GPU
    rep["mode"] = "cpu-smoke (reduced sizes; CPU numbers)"
    vs = gc.verdicts(rep)
    assert vs and all(v["verdict"] == "not measured (CPU run)" and v["measured"] == "-" for v in vs)
    rep = met_report()
    rep["environment"]["cuda_available"] = False  # gpu mode asked for, but no CUDA device visible
    assert all(v["verdict"] == "not measured (CPU run)" for v in gc.verdicts(rep))
    md = gc.verdicts_md(rep)
    assert "CPU run" in md and "| met |" not in md and "NOT met |" not in md


def test_render_md_has_the_done_when_table():
    rep = met_report()
    rep.update(tree={"digest": "d", "git": None}, started="now", wall_s=1.0, budget_s=500)
    rep["environment"].update(gpu_memory_bytes=80 * GIB, capability="9.0")
    for p in rep["parts"].values():
        p.setdefault("timeout_s", 10)
    md = gc.render_md(rep)
    assert "## Done when" in md and "| 13 | ooo_fused vs PyTorch's optimizer in backward (optim_in_bwd) |" in md
    assert "20 met, 0 NOT met, 1 not measured" in md


def test_a_row_over_its_budget_says_where_its_peak_went():
    """Note [Where the peak went]: the verdict names the over-budget row's gap by category."""
    rep = met_report()
    _offload_row("resnet", "memsched hybrid 30%", budget_with_state_bytes=9 * GIB, peak_phase="backward",
                 peak_gap={"planned_bytes": 9 * GIB, "measured_bytes": 9.5 * GIB, "fragmentation_bytes": None,
                           "categories": {"late release": 0.25 * GIB, "not in the profiled step": 0.25 * GIB}})(rep)
    v = _find(by_criterion(rep), 11, "budget")
    assert v["verdict"] == "NOT met"
    assert ("over: memsched hybrid 30% (peak in the backward: late release 0.25 GiB, not in the profiled step "
            "0.25 GiB)") in v["measured"], v["measured"]


def test_cuda_tests_not_run_or_crashed():
    """Tests the part's time did not reach leave the criteria open (a failure or crash among the rest still
    settles them); the markdown names each crashed test with its innermost Python frame."""
    rep = met_report()
    rep["results"]["cuda_tests"] = _junit(test_pinned_pool_on_gpu="passed", test_a="passed", test_slow="not run")
    for words in ("every pytest", "test_pinned_pool_on_gpu"):
        v = _find(by_criterion(rep), 10 if "pinned" in words else 14, words)
        assert v["verdict"].startswith("not measured: 1 not run (the part's time ran out while test_mod::test_slow"), v
        assert "1 not run" in v["measured"]
    rep["results"]["cuda_tests"] = _junit(test_pinned_pool_on_gpu="not run", test_a="crashed", test_b="not run")
    v = _find(by_criterion(rep), 14, "every pytest")
    assert v["verdict"] == "NOT met" and "1 crashed" in v["measured"] and "test_mod::test_a (crashed)" in v["measured"]
    md = gc.tests_md(rep["results"]["cuda_tests"])
    assert "| test_mod::test_a | rc -11, SIGSEGV | python/memsched/planning.py:262 in plan |" in md, md
    assert "1 crashed, 2 not run" in md


def test_trainer_and_keep_all_figures_a_cut_run_did_not_write():
    """bench_trainer_gpu adds vs_plain, and bench_offload keep_all_fidelity, at their ends, which a killed or
    resumed process never reaches: gpu_check works them out from the rows."""
    rep = met_report()
    md = gc.trainer_md({"model": "m", "batch": 8, "seq": 1024, "rows": rep["results"]["trainer"]["rows"]})
    assert "| memsched-dp-50% | 120.0 | 119.0-121.0 | 1.20x |" in md, md
    rows = rep["results"]["offload"]["gpt"]["rows"]
    assert gc.keep_all_fidelity(rows) is None  # no memsched row with a keep_all figure
    rows[5]["keep_all_sim_peak_bytes"] = 16.4 * GIB
    fid = gc.keep_all_fidelity(rows)
    assert fid["ratio"] == pytest.approx(16.4 / 16) and fid["trace_of"] == "memsched dp 70%"
