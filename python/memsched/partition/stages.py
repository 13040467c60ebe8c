"""A contiguous-stage partition of a GraphModule as torch.distributed.pipelining stages.

Entry points: stage_of_node(gm, partition) -> {node name: stage}; split_stages(gm, partition) ->
(split GraphModule, [stage submodules]); pipeline_stage(gm, partition, rank, device, group=None) ->
torch.distributed.pipelining.PipelineStage for this rank. gm is the torch.fx.GraphModule or the
nn.Module that was partitioned (a module is traced again, as memsched.partition traced it).

A partition is contiguous when the graph's compute nodes, in graph order, go to non-decreasing
devices and each node's backward and optimizer ops sit on its forward's device; stage k is device
k's nodes (devices without nodes are dropped, so stages stay numbered 0..S-1). Each stage must
take only the previous stage's outputs (a chain): torch.distributed.pipelining sends one stage's
outputs to the next stage only.
"""
from torch.fx.passes.split_module import split_module

from memsched.partition.fx_graph import to_graph_module

_COMPUTE = ("call_module", "call_function", "call_method")


def stage_of_node(gm, partition):
    gm = to_graph_module(gm)  # the nn.Module that was partitioned: its nodes are named as partition() named them
    if not partition.node_device:
        raise ValueError("pipeline stages: this partition has no node placement; partition a GraphModule or "
                         "nn.Module (with example_inputs), not a Trace")
    for name, ops in (partition.node_ops or {}).items():
        for op in ops[1:]:
            if partition.device_of_op[op] != partition.device_of_op[ops[0]]:
                raise ValueError(f"pipeline stages: node '{name}' runs forward on device "
                                 f"{partition.device_of_op[ops[0]]} but its backward or optimizer update on device "
                                 f"{partition.device_of_op[op]}; a pipeline stage keeps both on one device")
    stages, last, last_name = {}, 0, None
    order = {}
    for n in gm.graph.nodes:
        if n.op not in _COMPUTE:
            continue
        if n.name not in partition.node_device:
            raise ValueError(f"pipeline stages: node '{n.name}' is not in the partition; partition this GraphModule")
        d = partition.node_device[n.name]
        if d < last:
            raise ValueError(f"pipeline stages: not a contiguous-stage partition: node '{n.name}' is on device {d} "
                             f"after node '{last_name}' on device {last}; use method='flops' or 'even', or a "
                             f"partition whose devices follow the graph order")
        last, last_name = d, n.name
        order.setdefault(d, len(order))
        stages[n.name] = order[d]
    return stages


def split_stages(gm, partition):
    """(split GraphModule, stage submodules in order)."""
    gm = to_graph_module(gm)
    stages = stage_of_node(gm, partition)
    split = split_module(gm, gm, lambda node: stages[node.name])
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    for k, call in enumerate(calls):
        if k == 0:
            continue
        for arg in call.all_input_nodes:
            src = arg.args[0] if arg.op == "call_function" and arg.target.__name__ == "getitem" else arg
            if src is not calls[k - 1]:
                raise ValueError(f"pipeline stages: stage {k} ({call.target}) reads '{arg.name}', which does not come "
                                 f"from stage {k - 1}: torch.distributed.pipelining passes only the previous stage's "
                                 f"outputs; choose split points where the graph is a chain")
    return split, [split.get_submodule(c.target) for c in calls]


def pipeline_stage(gm, partition, rank, device="cpu", group=None):
    """torch.distributed.pipelining.PipelineStage holding this rank's stage of `gm` (one stage per rank)."""
    from torch.distributed.pipelining import PipelineStage

    _, modules = split_stages(gm, partition)
    if not 0 <= rank < len(modules):
        raise ValueError(f"pipeline stages: rank {rank} has no stage; the partition has {len(modules)} stages "
                         f"(run {len(modules)} processes)")
    return PipelineStage(modules[rank], rank, len(modules), device, group=group)
