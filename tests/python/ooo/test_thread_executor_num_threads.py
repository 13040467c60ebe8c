"""The thread executor's worker runs its items with the intra-op thread count of the thread that runs
backward (torch.set_num_threads), so its weight gradients are bitwise plain PyTorch's (Note [The
worker's intra-op threads] in csrc/torch/dw_runtime.h). Needs 2 cores to tell."""
import copy
import os

import pytest
import torch
import torch.nn as nn

from ooo_helpers import weighted_sum_steps


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 80)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, z):
        t = torch.tanh(self.pre(z)).reshape(-1)
        return self.conv(t[:80].view(2, 8, 5)).sum((0, 2))


def _train(model, ooo_kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weighted_sum_steps(model, opt, lambda g: torch.randn(4, 4, generator=g),
                       dict(fuse_optimizer=True, **ooo_kw) if ooo_kw else None)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: one thread against the default")
def test_thread_executor_follows_set_num_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        plain = Net()
        model = copy.deepcopy(plain)
        _train(plain, None)
        _train(model, dict(executor="thread"))
    finally:
        torch.set_num_threads(before)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"
