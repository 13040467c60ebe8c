"""OffloadSchedule: plan ops -> backward triggers (Note [Plan ops to backward triggers]), by hand.

Trace (ops 0-2 forward, 3-8 backward):
  op:      0 f   1 f   2 f   3 b   4 b   5 b   6 b   7 b   8 b
  act 0:   produced 0, used 1 and 7        first backward use 7
  act 1:   produced 1, used 2 and 5        first backward use 5
  act 2:   produced 2, used 3              first backward use 3
  act 3:   produced 2, used 8              first backward use 8 (100 bytes: below a 512 floor)
  param:   parameter, used 0 and 6         (never an activation)
Observable ops = first backward uses = {3, 5, 7, 8}; ops 4 and 6 unpack nothing of ours.
"""
import pytest

import memsched  # noqa: F401
from memsched.offload.report import planned_activation_curve
from memsched.offload.schedule import OffloadSchedule, ordinal_of_label
from offload_standins import Decision, StandInPlan


def trace():
    t = memsched.Trace()
    for i, phase in enumerate(["forward"] * 3 + ["backward"] * 6):
        t.add_op(f"op{i}", "", phase, duration_us=1.0)
    t.add_tensor(1000, "float32", "activation", producer_op=0, uses=[1, 7], freed_after_op=7, label="act:0:a:[250]:float32")
    t.add_tensor(2000, "float32", "activation", producer_op=1, uses=[2, 5], freed_after_op=5, label="act:1:b:[500]:float32")
    t.add_tensor(4000, "float32", "activation", producer_op=2, uses=[3], freed_after_op=3, label="act:2:c:[1000]:float32")
    t.add_tensor(100, "float32", "activation", producer_op=2, uses=[8], freed_after_op=8, label="act:3:c:[25]:float32")
    t.add_tensor(64, "float32", "parameter", uses=[0, 6])
    return t


def test_observable_ops_and_labels():
    s = OffloadSchedule.build(trace(), None)
    assert s.observable_ops == [3, 5, 7, 8]
    assert s.first_bwd_op == {0: 7, 1: 5, 2: 3, 3: 8}
    assert s.labels[2] == "act:2:c:[1000]:float32" and not s.offload
    assert ordinal_of_label("act:12:x.y:[1]:bf16") == 12 and ordinal_of_label("fc1") is None


def test_prefetch_ops_round_down_to_observable_and_on_demand():
    plan = StandInPlan([
        Decision(0, True, 1, 6),   # op 6 unobservable -> issued at op 5 (one observable op early)
        Decision(1, True, 2, 3),   # op 3 observable -> at op 3
        Decision(2, True, 2, 3),   # prefetch at its own first use -> on demand
        Decision(3, True, 2, 8),   # on demand, but below the 512-byte floor -> kept
    ])
    s = OffloadSchedule.build(trace(), plan, min_bytes=512)
    assert s.offload == {0, 1, 2}
    assert s.trigger_op == {0: 5, 1: 3}
    assert s.prefetch_at == {5: [0], 3: [1]}
    assert s.skipped_small == 1
    assert s.offloaded_bytes == 7000


def test_prefetch_before_any_observable_op_fires_at_backward_start():
    plan = StandInPlan([Decision(0, True, 1, 3), Decision(1, True, 2, 4)])
    # act 0 at op 3 (observable: act 2's first use) -> 3; act 1 at op 4 -> rounds to 3.
    s = OffloadSchedule.build(trace(), plan)
    assert s.prefetch_at == {3: [0, 1]}
    t = trace()
    t2 = memsched.Trace()
    for op in t.ops:
        t2.add_op(op.name, "", op.phase, duration_us=1.0)
    # Only act 0 exists: no observable op precedes its first use 7 except 7 itself -> start trigger.
    t2.add_tensor(1000, "float32", "activation", producer_op=0, uses=[1, 7], freed_after_op=7, label="act:0:a:[250]:float32")
    s2 = OffloadSchedule.build(t2, StandInPlan([Decision(0, True, 1, 4)]))
    assert s2.trigger_op == {0: -1} and s2.prefetch_at == {-1: [0]}
    assert s2.triggers_through(7, -2) == [-1]


def test_triggers_fire_in_order_and_catch_up():
    plan = StandInPlan([Decision(0, True, 1, 5), Decision(1, True, 2, 3)])
    s = OffloadSchedule.build(trace(), plan)
    assert s.triggers_through(3, -2) == [3]
    assert s.triggers_through(8, 3) == [5]          # 5 skipped by the unpack order: caught up at 8
    assert s.triggers_through(8, 8) == []


def test_planned_activation_curve_by_hand():
    # keep all: act0 ops 0-7, act1 1-5, act2 2-3, act3 2-8.
    t = trace()
    assert planned_activation_curve(t, None) == [1000, 3000, 7100, 7100, 3100, 3100, 1100, 1100, 100]
    # offload act0 after op 1 (its last forward use), back at op 5: resident ops 0-1 and 5-7.
    plan = StandInPlan([Decision(0, True, 1, 5)])
    assert planned_activation_curve(t, plan) == [1000, 3000, 6100, 6100, 2100, 3100, 1100, 1100, 100]


def test_plan_without_decisions_is_rejected():
    with pytest.raises(TypeError, match="plan: expected an object with .decisions"):
        OffloadSchedule.build(trace(), object())


def test_labelled_storage_of_another_kind_is_matched_but_never_offloaded():
    t = trace()
    t.add_tensor(500, "float32", "gradient", producer_op=3, uses=[4], freed_after_op=4, label="act:4:d:[125]:float32")
    s = OffloadSchedule.build(t, StandInPlan([Decision(5, True, 3, 4)]))
    assert s.labels[4] == "act:4:d:[125]:float32"   # the executor's 5th saved storage matches the trace
    assert 4 not in s.first_bwd_op and not s.offload
