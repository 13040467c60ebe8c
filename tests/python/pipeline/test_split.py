"""split_stages: cuts an nn.Sequential (nested ones flattened) before each split point, keeps the
model's own modules, and refuses what cannot be pipelined with a message naming the fix."""
import pytest
import torch
import torch.nn as nn

from memsched import MemschedError
from memsched.pipeline import split_stages


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(),
                         nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), nn.Linear(4, 2))


def test_split_by_names_and_indices_composes_to_the_model():
    m = _model()
    x = torch.randn(3, 4)
    for points in (["2"], [2], ["2.2"], ["1", "2.2", "3"]):
        stages = split_stages(m, points)
        assert len(stages) == len(points) + 1
        h = x
        for st in stages:
            h = st(h)
        torch.testing.assert_close(h, m(x), rtol=0, atol=0)
    stages = split_stages(m, ["2.2"])
    assert stages[1][0] is m[2][2]  # the model's own modules, not copies
    assert [len(s) for s in stages] == [4, 2]


@pytest.mark.parametrize("points, words", [
    (["9"], "names no module"), (["0"], "stage 0 would be empty"), (["3", "2"], "does not come after"),
    (["2", "2"], "does not come after"), ("2", "list of module names")])
def test_bad_split_points_are_refused(points, words):
    with pytest.raises(MemschedError, match=words):
        split_stages(_model(), points)


def test_non_sequential_and_tied_weights_are_refused():
    with pytest.raises(MemschedError, match="nn.Sequential"):
        split_stages(nn.Linear(2, 2), [])
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(MemschedError, match="tied weights"):
        split_stages(nn.Sequential(a, nn.ReLU(), b), ["2"])


def _reused_model():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.ReLU(), shared, nn.ReLU(), nn.Linear(4, 2))


def test_a_module_called_twice_in_one_stage_is_called_twice_in_the_pipeline():
    m = _reused_model()
    x = torch.randn(3, 4)
    stages = split_stages(m, ["4"])
    assert [len(s) for s in stages] == [4, 1]
    assert stages[0][0] is m[0] and stages[0][2] is m[0]
    torch.testing.assert_close(stages[1](stages[0](x)), m(x), rtol=0, atol=0)
    # a nested block used twice: both calls kept, under their own positions
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    m2 = nn.Sequential(block, block, nn.Linear(4, 2))
    stages = split_stages(m2, ["2"])
    torch.testing.assert_close(stages[1](stages[0](x)), m2(x), rtol=0, atol=0)


def test_a_module_with_state_called_in_two_stages_is_refused_naming_both_calls():
    with pytest.raises(MemschedError, match=r"module '0' \(Linear\) is called again as '2'.*stage 0.*stage 1"):
        split_stages(_reused_model(), ["2"])
    bn = nn.BatchNorm1d(4, affine=False)  # buffers only: no parameter for the tied-weight check to see
    with pytest.raises(MemschedError, match=r"module '1' \(BatchNorm1d\) is called again as '3'"):
        split_stages(nn.Sequential(nn.Linear(4, 4), bn, nn.Linear(4, 4), bn), ["2"])


def test_a_stateless_module_shared_across_stages_is_allowed():
    act = nn.ReLU()
    m = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.Linear(4, 2))
    x = torch.randn(3, 4)
    stages = split_stages(m, ["2"])
    torch.testing.assert_close(stages[1](stages[0](x)), m(x), rtol=0, atol=0)


def test_the_refusal_of_a_non_sequential_model_offers_only_what_exists():
    import inspect

    import memsched.partition.stages
    from memsched.pipeline import Pipeline

    with pytest.raises(MemschedError) as e:
        split_stages(nn.Linear(2, 2), [])
    msg = str(e.value)
    assert "nn.Sequential(embedding, *blocks, head)" in msg
    assert "memsched.partition.stages.pipeline_stage" in msg and hasattr(memsched.partition.stages, "pipeline_stage")
    assert "stages" not in inspect.signature(Pipeline).parameters and "stages=" not in msg
