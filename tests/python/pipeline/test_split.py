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
