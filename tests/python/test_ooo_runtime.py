"""Out-of-order backward's hot path is C++ (Note [dW runtime in C++] in csrc/torch/dw_runtime.h):
a backward pass runs memsched Python only per backward pass -- not per layer, not per
parameter -- and with the fused update not at all for Adam/AdamW (their update runs in C++,
csrc/torch/adam_update.h), once per layer for other optimizers (one grouped optimizer call per
step unit); the deferred gradients stay bitwise plain autograd's."""
import collections
import copy
import sys

import pytest
import torch
import torch.nn as nn

from memsched.ooo import OutOfOrderBackward


def _mlp(depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


def _memsched_python_calls_in_backward(model, fuse, executor="inline", make_opt=None):
    """Python functions of the memsched package called while loss.backward() runs (CPU: the
    autograd engine runs this graph on the calling thread, where the profile hook is set)."""
    opt = (make_opt or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(model.parameters())
    x = torch.randn(4, 16)
    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and "/memsched/" in frame.f_code.co_filename.replace("\\", "/"):
            calls[frame.f_code.co_name] += 1

    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=fuse, executor=executor) as ooo:
        for _ in range(2):
            model(x).square().sum().backward()
            if ooo.step():
                opt.step()
                opt.zero_grad(set_to_none=True)
        loss = model(x).square().sum()
        sys.setprofile(profile)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
        ooo.step()
    return calls


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_backward_runs_no_memsched_python_per_layer_or_parameter(executor):
    shallow = _memsched_python_calls_in_backward(_mlp(2), fuse=False, executor=executor)
    deep = _memsched_python_calls_in_backward(_mlp(12), fuse=False, executor=executor)
    assert shallow == deep, (shallow, deep)          # independent of 4 vs 24 parameters
    assert sum(deep.values()) <= 10, deep            # per backward pass: start, end-of-backward callback


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_fused_adamw_update_runs_no_python_per_layer(executor):
    shallow = _memsched_python_calls_in_backward(_mlp(2), fuse=True, executor=executor)
    deep = _memsched_python_calls_in_backward(_mlp(12), fuse=True, executor=executor)
    assert shallow == deep, (shallow, deep)          # the update of 24 parameters in C++
    assert calls_named(deep, "_on_ready", "step_params") == 0, deep


def test_fused_sgd_update_calls_python_once_per_layer():
    depth = 12
    calls = _memsched_python_calls_in_backward(_mlp(depth), fuse=True,
                                               make_opt=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9))
    assert calls["_on_ready"] == depth, calls        # one complete unit (weight + bias) per call
    assert calls["step_params"] == depth, calls      # one grouped optimizer call per layer


def calls_named(calls, *names):
    return sum(calls[n] for n in names)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_runtime_gradients_are_bitwise_plain_and_accumulate(executor):
    a = _mlp(4)
    b = copy.deepcopy(a)
    xs = [torch.randn(3, 5, 16) for _ in range(2)]
    for x in xs:  # two backward passes into .grad, no step
        a(x).square().sum().backward()
    with OutOfOrderBackward(b, executor=executor, max_deferred_bytes=1 << 20) as ooo:
        for x in xs:
            b(x).square().sum().backward()
    assert ooo.report()["deferred_items"] == 8
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_graph_recorded_inside_and_run_after_remove_gets_plain_gradients():
    a = _mlp(2)
    b = copy.deepcopy(a)
    x = torch.randn(4, 16)
    a(x).sum().backward()
    with OutOfOrderBackward(b):
        loss = b(x).sum()
    loss.backward()  # the runtime is shut down: the C++ Functions return dW at once
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n
