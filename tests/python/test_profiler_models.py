"""memsched.models: the built-in example models the CLI, tests and benchmarks profile."""
import pytest
import torch

from memsched import models


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_small_step_gives_every_parameter_a_gradient(name):
    model = models.build_model(name, "small")
    step = models.make_step_fn(model, name, 3)
    loss = step()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    first = [p.grad.clone() for p in model.parameters()]
    step()  # the step drops .grad first: no accumulation across calls
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))


def test_deterministic_and_seeded():
    a, b = models.build_model("cnn", seed=3), models.build_model("cnn", seed=3)
    c = models.build_model("cnn", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    x1, y1 = models.example_batch("transformer", 2)
    x2, y2 = models.example_batch("transformer", 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # next-token targets


def test_transformer_ties_embedding_and_unembedding():
    model = models.build_model("transformer")
    assert model.unembed.weight is model.tok.weight
    # 2 layers of LayerNorm/attention/GELU MLP, tied weight counted once.
    d, v, s = 32, 64, 16
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert sum(p.numel() for p in model.parameters()) == v * d + s * d + 2 * block + 2 * d


def test_shapes_of_batches():
    assert models.example_batch("mlp", 5)[0].shape == (5, 32)
    assert models.example_batch("cnn", 2)[0].shape == (2, 3, 16, 16)
    assert models.example_batch("lstm", 4)[0].shape == (4, 8)
    x, y = models.example_batch("transformer", 4, "realistic")
    assert x.shape == y.shape == (4, 128) and x.dtype == torch.int64


def test_bad_names_are_clear():
    with pytest.raises(ValueError, match="unknown model 'resnet'; expected one of mlp, cnn, transformer, lstm"):
        models.build_model("resnet")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        models.build_model("mlp", "huge")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        models.example_batch("mlp", 0)
