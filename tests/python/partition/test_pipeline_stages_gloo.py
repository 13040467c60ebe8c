"""A contiguous 2-stage partition of a GraphModule runs as torch.distributed.pipelining stages:
gloo on CPU, two processes on 127.0.0.1; the loss of each of 3 training steps equals the
single-device model's, and so do the parameters after them."""
import os

import torch
from torch import nn

from spawn_helpers import free_port, init_gloo, spawn_and_wait

STEPS = 3
WORLD = 2
TIMEOUT_S = 120


class Chain(nn.Module):
    def __init__(self, width=64, depth=6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _model():
    torch.manual_seed(0)
    return Chain()


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(STEPS)]


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)



def _worker(rank, port, partition_path, out_dir):
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe

    from memsched.partition import Partition
    from memsched.partition.fx_graph import to_graph_module
    from memsched.partition.stages import pipeline_stage

    init_gloo(rank, port, WORLD, timeout_s=60)
    try:
        gm = to_graph_module(_model())
        stage = pipeline_stage(gm, Partition.from_json(partition_path), rank, "cpu")
        opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-2)
        schedule = ScheduleGPipe(stage, n_microbatches=1, loss_fn=_loss)
        losses = []
        for x, y in _data():
            if rank == 0:
                schedule.step(x)
            else:
                out = []
                schedule.step(target=y, losses=out)
                losses.append(out[0].detach().clone())
            opt.step()
            opt.zero_grad(set_to_none=True)
        params = {n: p.detach().clone() for n, p in stage.submod.named_parameters()}
        torch.save({"losses": losses, "params": params}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_stage_partition_trains_like_the_single_device_model(tmp_path):
    import memsched
    from memsched.partition.fx_graph import to_graph_module
    from memsched.partition.stages import split_stages

    gm = to_graph_module(_model())
    x0 = _data()[0][0]
    # Half the single-device peak plus a margin: no single device holds the step.
    p = memsched.partition(gm, devices=2, cap="65%", example_inputs=(x0,))
    assert sorted(set(p.node_device.values())) == [0, 1]
    split, stages = split_stages(gm, p)
    assert len(stages) == 2
    p.to_json(tmp_path / "partition.json")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: a matmul's reduction order depends on the thread count
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in _data():
        loss = _loss(ref(x), y)
        loss.backward()
        ref_losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)

    spawn_and_wait(_worker, (free_port(), str(tmp_path / "partition.json"), str(tmp_path)), WORLD, TIMEOUT_S)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert len(res[1]["losses"]) == STEPS
    for k, (a, b) in enumerate(zip(ref_losses, res[1]["losses"])):
        assert torch.equal(a, b), f"step {k}: pipeline loss {b.item()} != single-device loss {a.item()}"
    ref_params = dict(ref.named_parameters())
    seen = 0
    for r in range(WORLD):
        for name, value in res[r]["params"].items():
            original = name.replace("_", ".")  # split_module names submodules layers_0 for layers.0
            assert torch.equal(ref_params[original].detach(), value), (r, name)
            seen += 1
    assert seen == len(ref_params)
