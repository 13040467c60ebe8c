"""Shared helpers for the out-of-order backward tests: a plain PyTorch loop
and the same loop under memsched.ooo, on memsched.models' example models."""
import copy

import torch

from memsched import models
from memsched.ooo import OutOfOrderBackward

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


def batches(name, n, batch=4, size="small"):
    return [models.example_batch(name, batch, size, seed=s) for s in range(n)]


def plain_loop(model, opt, name, data, accumulation=1, scheduler=None):
    for k, (x, y) in enumerate(data):
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        if (k + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()


def ooo_loop(model, opt, name, data, fuse=True, accumulation=1, scheduler=None, **kw):
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=fuse, grad_accumulation_steps=accumulation,
                            **kw) as ooo:
        for k, (x, y) in enumerate(data):
            loss = models.loss_fn(name, model(x), y)
            loss.backward()
            if ooo.step():
                opt.step()
                opt.zero_grad(set_to_none=True)
            if scheduler is not None and (k + 1) % accumulation == 0:
                scheduler.step()
    return ooo


def twin(name, opt_name, size="small", seed=0):
    a = models.build_model(name, size, seed=seed)
    b = copy.deepcopy(a)
    if name == "transformer":  # deepcopy keeps the tie; check it
        assert b.unembed.weight is b.tok.weight
    return a, OPTIMIZERS[opt_name](a.parameters()), b, OPTIMIZERS[opt_name](b.parameters())


def assert_same_state(model_a, opt_a, model_b, opt_b, exact=True):
    for (na, pa), (nb, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert na == nb
        if exact:
            assert torch.equal(pa, pb), f"{na}: max |diff| {(pa - pb).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=na)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                if exact:
                    assert torch.equal(sa[k], sb[k]), k
                else:
                    torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)
            else:
                assert sa[k] == sb[k], k
    for ba, bb in zip(model_a.buffers(), model_b.buffers()):
        assert torch.equal(ba, bb)


def weighted_sum_steps(model, opt, input_of, ooo_kw=None, steps=3, keep_grads=False):
    """`steps` training steps of model(input_of(g)) with a fixed random weighting of the output as the
    loss (every output element gets its own gradient), g a generator seeded with the step: plainly
    (ooo_kw None) or under OutOfOrderBackward(model, optimizer=opt, **ooo_kw). Returns each step's
    gradients (clones keeping their layout) when keep_grads, else []."""
    ooo = OutOfOrderBackward(model, optimizer=opt, **ooo_kw).install() if ooo_kw is not None else None
    grads = []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            y = model(input_of(g))
            (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum().backward()
            if keep_grads:
                grads.append([None if p.grad is None else p.grad.clone(memory_format=torch.preserve_format)
                              for p in model.parameters()])
            if ooo is None or ooo.step():
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        if ooo is not None:
            ooo.remove()
    return grads


# A backward pass that raises part way (Note [A failed backward] in memsched/ooo/backward.py): Guard raises
# in its backward while Guard.armed; GuardedNet puts it before its last layer (that layer is final and
# stepped first) or, with guard_at_loss, at the output (nothing final yet).
class Guard(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Guard.armed:
            raise FloatingPointError("non-finite gradient")
        return g


class GuardedNet(torch.nn.Module):
    def __init__(self, guard_at_loss):
        super().__init__()
        self.guard_at_loss = guard_at_loss
        self.a, self.b, self.c = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 5)

    def forward(self, x):
        h = torch.tanh(self.b(torch.relu(self.a(x))))
        if not self.guard_at_loss:
            h = Guard.apply(h)  # raises after c's backward: c is already stepped
        out = self.c(h)
        return Guard.apply(out) if self.guard_at_loss else out


def guarded_loop(m, opt, step):
    """Four steps of GuardedNet; the second one's backward raises (the loop zeroes and goes on)."""
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        Guard.armed = s == 1
        try:
            torch.nn.functional.cross_entropy(m(x), y).backward()
        except FloatingPointError:
            opt.zero_grad()
            continue
        finally:
            Guard.armed = False
        step()
