"""planner="hybrid" (issue 12, CPU side): keep, offload or recompute per activation in memsched.plan,
memsched.simulate, the CLI table and memsched.optimize (where recompute runs as keep for now). See Note [Hybrid planner] and Note [Recompute model] in csrc/core."""
import copy
import io
import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched import planning
from memsched.__main__ import main as cli_main


def slow_link():
    """Copies of 1-8 MiB take 0.5-4 ms each way; the synthetic trace's ops take 50-500 us."""
    d = memsched.DeviceModel()
    d.name = "slow-link"
    d.d2h_bw_gbps = d.h2d_bw_gbps = 2.0
    d.d2h_latency_us = d.h2d_latency_us = 5.0
    return d


@pytest.fixture(scope="module")
def chain():
    return memsched._C.synthetic_trace(num_layers=12, ops_per_layer=2, skip_probability=0.0, seed=5)


def test_hybrid_is_registered():
    assert "hybrid" in planning.planner_names()
    assert "recompute" in memsched._C.planner_description("hybrid")


def test_hybrid_recomputes_where_copies_cannot_hide(chain):
    least = memsched._C.least_budget_bytes(chain)
    budget = least + (chain.peak_bytes() - least) // 10
    plan = memsched.plan(chain, budget=budget, planner="hybrid", device=slow_link())
    actions = [d.action for d in plan.decisions]
    assert set(actions) <= {"keep", "offload", "recompute"}
    assert plan.num_recomputed() == actions.count("recompute") > 0
    replays = 0
    for d in plan.decisions:
        if d.action == "recompute":
            assert not d.offload and d.offload_after_op == d.prefetch_at_op == -1
            assert d.recompute_ops == memsched._C.recompute_chain(chain, d.tensor_id, plan)["ops"]
            assert d.recompute_at_op >= 0
            replays += bool(d.recompute_ops)
        else:
            assert d.recompute_ops == [] and d.recompute_at_op == -1
    assert replays > 0
    r = memsched.simulate(chain, plan, device=slow_link())
    r.check_invariants(chain, plan)
    assert r.peak_bytes <= budget and not r.over_budget
    assert r.recompute_us > 0
    assert r.step_time_us == pytest.approx(r.compute_us + r.recompute_us + r.stall_us)
    assert any(e["kind"] == "recompute" for e in r.timeline["compute"])
    # Never slower than any other planner at the same budget; here clearly faster than offload alone.
    for name in planning.planner_names():
        if name == "hybrid":
            continue
        try:
            other = memsched.simulate(chain, memsched.plan(chain, budget=budget, planner=name, device=slow_link()),
                                      device=slow_link())
        except memsched.MemschedError:
            continue
        assert r.step_time_us <= other.step_time_us, name
        assert r.step_time_us < 0.9 * other.step_time_us, name


def test_a_hand_made_recompute_decision_is_validated(chain):
    plan = memsched.plan(chain, budget=None, planner="keep_all")
    decisions = plan.decisions
    tid = decisions[3].tensor_id
    first_backward = next(op.id for op in chain.ops if op.phase == "backward")
    use = min(u for u in chain.tensors[tid].uses if u >= first_backward)
    decisions[3].recompute = True
    decisions[3].recompute_ops = [0]
    decisions[3].recompute_at_op = use
    plan.decisions = decisions
    want = memsched._C.recompute_chain(chain, tid)["ops"]
    with pytest.raises(memsched.MemschedError, match=re.escape(
            f"field 'recompute_ops' is [0] but under this plan the tensor is recreated by replaying ops "
            f"[{', '.join(map(str, want))}]")):
        memsched._C.validate_plan(chain, plan)
    decisions[3].recompute_ops = want
    decisions[3].recompute_at_op = -1
    plan.decisions = decisions
    with pytest.raises(memsched.MemschedError, match=re.escape(
            f"field 'recompute_at_op' is -1 but under this plan the tensor is recreated just before op {use}")):
        memsched._C.validate_plan(chain, plan)
    decisions[3].recompute_at_op = use
    plan.decisions = decisions
    memsched._C.validate_plan(chain, plan)
    with pytest.raises(memsched.MemschedError, match="is not an offloadable activation"):
        memsched._C.recompute_chain(chain, 10**6)


def test_cli_table_has_hybrid_and_recomputed_column(chain, tmp_path, capsys):
    path = tmp_path / "trace.json"
    chain.to_json(str(path))
    rc = cli_main(["plan", str(path), "--budget", "60%", "--planner", "all", "--out", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "recomputed" in out
    row = next(line for line in out.splitlines() if line.startswith("hybrid "))
    assert "infeasible" not in row


# -- optimize(planner="hybrid"): recompute decisions run (Note [Unpack-time recompute]) -------------------
class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Dropout(0.1), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class TransformerDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(32, 10)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


MODELS = {"mlp": DropoutMLP, "cnn": CNN, "transformer": TransformerDropout, "lstm": LSTMModel}


def _data(kind, step):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        return torch.randn(512, 32, generator=g), torch.randint(0, 10, (512,), generator=g)
    if kind == "transformer":
        return torch.randint(0, 50, (8, 16), generator=g), torch.randint(0, 10, (8,), generator=g)
    if kind == "lstm":
        return torch.randn(8, 12, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)


def _train(kind, model, opt, run=None, steps=3):
    grads = []
    torch.manual_seed(123)  # dropout masks: the same RNG stream for both runs
    for step in range(steps):
        x, y = _data(kind, step)
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return grads


def very_slow_link():
    """A copy costs over 1 ms; these small models' ops take microseconds: recompute is chosen."""
    d = memsched.DeviceModel()
    d.name = "very-slow-link"
    d.d2h_bw_gbps = d.h2d_bw_gbps = 1e-3
    d.d2h_latency_us = d.h2d_latency_us = 1000.0
    return d


# Issue 12's cells (0.7, 0.5, 0.3 of the activation memory) where a plan can reach them; below, the
# least budget any plan reaches on that model.
CELLS = [("mlp", 0.7), ("mlp", 0.5), ("mlp", 0.3), ("cnn", 0.7), ("cnn", 0.5), ("cnn", 0.4),
         ("transformer", 0.7), ("transformer", 0.5), ("transformer", 0.3), ("lstm", 0.7), ("lstm", 0.5)]


@pytest.mark.parametrize("kind,budget", CELLS)
def test_optimize_hybrid_recomputes_and_gradients_are_bitwise(kind, budget, monkeypatch):
    opt_mod = sys.modules["memsched.optimize"]  # the module; memsched.optimize is the function
    planned = []

    def plan_on_a_very_slow_link(trace, b, planner, device):
        # Recompute is chosen, and the same way on every run: roofline op times (from FLOPs and
        # bytes) rather than CPU wall clock, which varies with machine load.
        p = memsched.plan(trace, budget=b, planner=planner, device=very_slow_link(), durations="roofline")
        planned.append(p.num_recomputed())
        return p

    monkeypatch.setattr(opt_mod, "make_plan", plan_on_a_very_slow_link)
    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    with memsched.optimize(model, opt, budget=budget, planner="hybrid") as run, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _train(kind, model, opt, run)
        table = run.report(file=io.StringIO()).table
    ref_grads = _train(kind, ref, ref_opt)
    assert len(planned) == 1
    assert planned[0] > 0, "the plan should recompute: the test would not exercise the keep path"
    assert not [w for w in caught if "memsched" in str(w.message)], [str(w.message) for w in caught]
    executed = [s for s in run.step_stats if s.mode == "planned"]
    assert len(executed) == 2
    for s in executed:
        # every planned recompute ran: released after the forward, replayed in backward
        assert s.recompute_kept == 0, s.recompute_kept_reasons
        assert s.recomputed == len(run.schedule.recompute) > 0
        assert s.recomputed_bytes == sum(run.schedule.bytes[k] for k in run.schedule.recompute)
        assert 0 < s.replays <= s.recomputed
        # and the measured saved-activation peak is the plan's
        assert s.peak_bytes <= run.budget_bytes, (s.peak_bytes, run.budget_bytes)
    assert re.search(r"recomputed activations +\d+ \(", table) and "recompute time" in table
    assert run.plan.num_recomputed() == planned[0]  # the plan that ran is the plan that was made
    for step, (gs, rs) in enumerate(zip(grads, ref_grads)):
        for i, (g, r) in enumerate(zip(gs, rs)):
            assert torch.equal(g, r), f"step {step} param {i}: gradient differs"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    for b, c in zip(model.buffers(), ref.buffers()):
        assert torch.equal(b, c)


def test_dropout_mask_chain_needs_the_rng():
    """The profiled dropout mask is recreated by empty_like + bernoulli_ + div_, so its chain says rng."""
    torch.manual_seed(0)
    model = DropoutMLP()
    x, y = _data("mlp", 0)
    trace = memsched.profile(lambda: F.cross_entropy(model(x), y).backward(), model=model)
    masks = [t.id for t in trace.tensors
             if t.kind == "activation" and t.producer_op >= 0 and trace.ops[t.producer_op].name == "aten::empty_like"]
    assert len(masks) == 2
    for tid in masks:
        chain = memsched._C.recompute_chain(trace, tid)
        assert chain["feasible"] and chain["rng"]
        # empty_like reads the GELU/Tanh output (for its shape), a temporary freed in forward: replayed too.
        assert [trace.ops[i].name for i in chain["ops"]][-3:] == ["aten::empty_like", "aten::bernoulli_", "aten::div_"]


def test_hybrid_recomputes_a_gradient_accumulation_step_of_a_hugging_face_decoder():
    """Two micro-batches of a transformers Llama under bf16 autocast (136 candidates): none of the DP's
    plans fitted the budget and the local search is off beyond 128 candidates, so hybrid ran greedy's plan,
    offloading over a link where recomputing most of the same tensors simulates 3x faster (Note
    [Hybrid planner], (d))."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=128, attention_dropout=0.1))
    model.train()

    def step():
        for mb in range(2):
            torch.manual_seed(mb)
            ids = torch.randint(1, 128, (8, 64))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss / 2
            loss.backward()

    trace = memsched.profile(step, model=model)
    device = memsched.DeviceModel()
    device.d2h_bw_gbps = device.h2d_bw_gbps = 1e-3
    device.d2h_latency_us = device.h2d_latency_us = 1e6
    assert len(memsched._C.offloadable_tensor_ids(trace)) > 128
    hybrid = memsched.plan(trace, 0.5, "hybrid", device)
    greedy = memsched.plan(trace, 0.5, "greedy", device)
    assert hybrid.num_recomputed() > 0, hybrid.objective_name
    hybrid_us = memsched.simulate(trace, hybrid, device).step_time_us
    assert hybrid_us * 2 < memsched.simulate(trace, greedy, device).step_time_us  # 26.6 s against 81 s here


def test_hybrid_offloads_what_the_forward_can_carry_on_a_trace_past_the_local_search():
    """Past the local search's 128 candidates, the DP's per-tensor offload cost cannot see how much copy
    bandwidth the forward has left: every candidate recomputed all it freed (1.16x keep_all's simulated step
    here). A pass over the recomputed tensors in forward order tries each as an offload (Note [Hybrid planner],
    (e)): the first layers' copies hide in the forward."""
    trace = memsched._C.synthetic_trace(num_layers=80, ops_per_layer=2, seed=1)
    assert len(memsched._C.offloadable_tensor_ids(trace)) > 128
    link = slow_link()
    link.d2h_bw_gbps = link.h2d_bw_gbps = 5.0
    keep = planning.simulate(trace, planning.plan(trace, None, "keep_all", device=link), device=link).step_time_us
    p = planning.plan(trace, 0.5, "hybrid", device=link)
    r = planning.simulate(trace, p, device=link)
    assert p.num_offloaded() > 10 and p.num_recomputed() > 10, (p.num_offloaded(), p.num_recomputed())
    assert r.step_time_us < 1.12 * keep, r.step_time_us / keep  # 1.097x measured; 1.163x before the pass
    first = min(trace.tensors[i].producer_op for i in p.offloaded_tensor_ids())
    assert first < len(trace.ops) // 4  # the forward's first layers go to the host
