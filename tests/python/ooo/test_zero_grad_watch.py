"""optimizer.zero_grad() as seen by the out-of-order backward (zero_grad_watch.py): a step that
torch.amp.GradScaler skips (inf/NaN gradients, the loop zeroes them) under ooo=True trains
bitwise as plain PyTorch, and the optimizer's zero_grad is restored at exit."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


def _loop(m, opt, scaler):
    for s in range(8):
        g = torch.Generator().manual_seed(7000 + s)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_grad_scaler_skipped_steps_under_ooo_bitwise_plain():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    sa = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)  # the first steps overflow and are skipped
    _loop(a, oa, sa)
    assert oa.state[next(a.parameters())]["step"] < 8  # some steps were skipped
    with memsched.optimize(b, ob, ooo=True):
        _loop(b, ob, torch.amp.GradScaler("cpu", init_scale=2.0 ** 22))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert "zero_grad" not in ob.__dict__
