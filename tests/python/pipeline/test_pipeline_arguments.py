"""Pipeline refuses bad arguments before any process group or stage exists, naming the field and the
fix; backends follow the device (NCCL on CUDA, gloo on CPU)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memsched import MemschedError
from memsched.pipeline import Pipeline, select_backend


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("kwargs, words", [
    ({"schedule": "pipedream"}, "schedule"),
    ({"policy": "guess"}, "policy"),
    ({"schedule": "1f1b", "policy": "predict"}, "async-1f1b.? only"),
    ({"schedule": "1f1b", "n_microbatches": 0}, "n_microbatches"),
    ({"n_microbatches": 4}, "n_microbatches"),
    ({"optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)}, "callable"),
    ({"loss_fn": 3}, "loss_fn"),
    ({"split_points": ["7"]}, "split_points"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, words):
    args = {"model": _model(), "split_points": ["2"], "optimizer": _opt, "loss_fn": F.cross_entropy}
    args.update(kwargs)
    with pytest.raises(MemschedError, match=words):
        Pipeline(**args)


def test_without_torchrun_entering_names_torchrun(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    pipe = Pipeline(_model(), ["2"], optimizer=_opt, loss_fn=F.cross_entropy)
    with pytest.raises(MemschedError, match="torchrun"):
        with pipe:
            pass
    with pytest.raises(MemschedError, match="context manager"):
        pipe.step((torch.randn(2, 4), torch.tensor([0, 1])))


def test_backend_follows_the_device():
    assert select_backend(torch.device("cuda", 0)) == "nccl"
    assert select_backend(torch.device("cpu")) == "gloo"


def test_cuda_without_an_index_means_this_process_gpu(monkeypatch):
    from memsched.pipeline.process_group import stage_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert stage_device("cuda") == torch.device("cuda", 3)
    assert stage_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert stage_device(None) == torch.device("cuda", 3)
    assert stage_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
    assert stage_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_cuda_without_a_gpu_is_refused_naming_the_device():
    from memsched.pipeline.process_group import stage_device

    with pytest.raises(MemschedError, match="device: 'cuda' asks for a GPU.*no CUDA device"):
        stage_device("cuda")
