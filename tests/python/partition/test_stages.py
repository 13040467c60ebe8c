"""Partitions that cannot become pipeline stages are refused, naming the node and the fix."""
import copy

import pytest
import torch
from torch import nn

import memsched
from memsched.partition.fx_graph import to_graph_module
from memsched.partition.stages import split_stages, stage_of_node


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.a(x)) + x


def _partition(model):
    return memsched.partition(model, devices=2, cap="100%", method="flops", example_inputs=(torch.randn(8, 16),))


def test_a_contiguous_partition_splits_into_stages():
    gm = to_graph_module(Chain())
    p = _partition(gm)
    stages = stage_of_node(gm, p)
    assert sorted(set(stages.values())) == [0, 1]
    _, modules = split_stages(gm, p)
    assert len(modules) == 2


def test_devices_out_of_graph_order_are_refused_naming_the_node():
    gm = to_graph_module(Chain())
    p = copy.deepcopy(_partition(gm))
    p.node_device["a"], p.node_device["c"] = 1, 0
    with pytest.raises(ValueError, match="not a contiguous-stage partition: node '.*' is on device 0"):
        stage_of_node(gm, p)


def test_backward_on_another_device_is_refused():
    gm = to_graph_module(Chain())
    p = copy.deepcopy(_partition(gm))
    backward = p.node_ops["b"][1]
    p.device_of_op[backward] = 1 - p.device_of_op[p.node_ops["b"][0]]
    with pytest.raises(ValueError, match="node 'b' runs forward on device"):
        stage_of_node(gm, p)


def test_a_stage_reading_past_its_predecessor_is_refused():
    gm = to_graph_module(Skip())
    p = copy.deepcopy(_partition(gm))
    p.node_device.update(a=0, b=1, add=1)
    for ops in p.node_ops.values():  # keep backward with forward so only the chain check can fail
        for op in ops:
            p.device_of_op[op] = p.node_device[next(n for n, o in p.node_ops.items() if o is ops)]
    with pytest.raises(ValueError, match="does not come from stage 0"):
        split_stages(gm, p)


def test_a_trace_partition_has_no_stages():
    p = memsched.partition(memsched._C.synthetic_trace(num_layers=4), devices=2, cap="100%", method="even")
    with pytest.raises(ValueError, match="no node placement"):
        stage_of_node(to_graph_module(Chain()), p)


def test_the_partitioned_module_itself_splits_into_stages_that_share_its_parameters():
    # README: memsched.partition takes an nn.Module, and "a contiguous partition of one becomes"
    # pipeline stages; was: split_stages(model, p) raised AttributeError ('Chain' object has no attribute 'graph')
    model = Chain()
    p = _partition(model)
    assert sorted(set(stage_of_node(model, p).values())) == [0, 1]
    _, modules = split_stages(model, p)
    assert len(modules) == 2
    x = torch.randn(8, 16)
    assert torch.equal(modules[1](modules[0](x)), model(x))
    own = {id(q) for q in model.parameters()}
    assert {id(q) for m in modules for q in m.parameters()} == own  # the stages train the model in place
