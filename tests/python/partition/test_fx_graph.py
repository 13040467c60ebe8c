"""A GraphModule as a trace (Note [A graph module as a trace]) and the error for a model fx cannot trace."""
import pytest
import torch
from torch import nn

import memsched
from memsched.partition.fx_graph import graph_trace, to_graph_module


class Chain(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class DataDependent(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.branchy = DataDependent()

    def forward(self, x):
        return self.branchy(self.pre(x))


def test_graph_trace_has_forward_backward_and_optimizer_ops_per_node():
    gm = to_graph_module(Chain())
    g = graph_trace(gm, (torch.randn(16, 32),))
    t = g.trace
    compute = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert len(g.forward_op_of_node) == len(compute) == len(g.backward_op_of_node)
    assert len(g.optimizer_op_of_node) == 5  # four layers and the head own parameters
    assert t.ops[g.forward_op_of_node["head"]].module_path == "head"
    params = sum(p.numel() * 4 for p in Chain().parameters())
    assert t.bytes_of_kind("parameter") == params
    assert t.bytes_of_kind("optimizer_state") == 2 * params
    # The forward's outputs are saved for the backward of their consumers.
    assert t.activation_bytes() > 0 and t.peak_bytes() > 4 * params


def test_untraceable_model_names_the_module():
    with pytest.raises(TypeError, match=r"module 'branchy' \(DataDependent\)"):
        to_graph_module(Outer())
    with pytest.raises(TypeError, match="branchy"):
        memsched.partition(Outer(), devices=2, cap="60%", example_inputs=(torch.randn(2, 8),))


def test_partition_of_a_module_places_every_node():
    model = Chain(depth=6)
    p = memsched.partition(model, devices=2, cap="70%", example_inputs=(torch.randn(64, 32),), method="flops")
    assert set(p.node_device.values()) == {0, 1}
    assert p.node_device["layers_0"] == 0 and p.node_device["head"] == 1


def test_example_inputs_are_required_for_a_module():
    with pytest.raises(ValueError, match="example_inputs"):
        memsched.partition(Chain(), devices=2, cap="70%")


def test_partitioning_a_model_leaves_its_batchnorm_statistics_and_the_rng_as_they_were():
    """Training after memsched.partition(model) is the training of the same loop without the call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    x = torch.randn(4, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = [b for b in model.buffers()]
    rng = torch.get_rng_state()
    memsched.partition(model, devices=2, example_inputs=(x,), method="even")
    memsched.partition.compare(model, devices=2, methods="even", example_inputs=(x,))
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(a is b for a, b in zip(model.buffers(), buffers))  # the tensors the model held, not copies
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training
