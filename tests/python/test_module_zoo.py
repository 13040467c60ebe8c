"""Never a wrong gradient: every torch.nn module class under memsched, against plain PyTorch.

Each variant of module_zoo.ZOO (every nn.Module class torch.nn exports, with
the configurations that take other ATen paths: RNNs with proj_size, cells,
in-place activations, embeddings with padding_idx, ...) trains for three
AdamW steps plainly and under each memsched configuration below, from the
same initial weights, inputs and RNG state. The parameters and buffers at the
end must be bitwise equal to plain PyTorch's -- or memsched must refuse at the
first step with a clear error, before it changed anything.

Under hybrid at 0.5 the CPU preset's cheap copies make the plans mostly
offload-only; "hybrid-recompute-50%" plans for a device whose copies take
seconds, so the plan recomputes wherever it can and every module's forward
ops are recorded and replayed (Note [Unpack-time recompute]): those steps
must recompute what the plan says, or say why a save kept its tensor.

Under the offload planners every saved activation goes to host memory on
CPU (min_offload_bytes is 0 there), so the executor's whole pack/unpack path
runs; those steps must also execute the plan (not fall back to plain because
the step did not match its own profile).
"""
import warnings

import pytest
import torch

import memsched
from memsched import _C
from memsched.optimize import optimize
from device_helpers import slow_copies
from module_zoo import NOT_TRAINABLE, ZOO, ZooModel, class_name, loss_of, make_inputs, torch_nn_module_classes

STEPS = 3

# configuration -> (optimize() keyword arguments, or "ooo" for OutOfOrderBackward with the fused update)
CONFIGS = {
    "offload_all_sync": dict(budget="1GiB", planner="offload_all_sync"),
    "offload_all_prefetch": dict(budget="1GiB", planner="offload_all_prefetch"),
    "dp-50%": dict(budget=0.5, planner="dp"),
    "hybrid-50%": dict(budget=0.5, planner="hybrid"),
    "hybrid-recompute-50%": dict(budget=0.5, planner="hybrid", device_model="slow-copies"),
    "ooo-fused": "ooo",
    "offload+ooo-fused": dict(budget="1GiB", planner="offload_all_prefetch", ooo=True, fuse_optimizer=True),
}


def _build(variant):
    case = ZOO[variant]
    torch.manual_seed(0)
    model = ZooModel(case, make_inputs(case, 0))
    if case.lazy:  # materialise lazy parameters before the optimizer sees them
        model(*make_inputs(case, 0))
    return case, model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _step_loss(case, model, step):
    return loss_of(model(*make_inputs(case, 100 + (0 if case.fixed_inputs else step))))


def _train_plain(variant):
    case, model, opt = _build(variant)
    torch.manual_seed(1)
    for step in range(STEPS):
        _step_loss(case, model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _train_ooo(variant, progress):
    case, model, opt = _build(variant)
    torch.manual_seed(1)
    with memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        for step in range(STEPS):
            progress["step"] = step
            _step_loss(case, model, step).backward()
            if ooo.step():
                opt.step()
                opt.zero_grad(set_to_none=True)
    return model, None


def _train_optimize(variant, kwargs, progress):
    if kwargs.get("device_model") == "slow-copies":
        kwargs = dict(kwargs, device_model=slow_copies())
    case, model, opt = _build(variant)
    torch.manual_seed(1)
    with optimize(model, optimizer=opt, **kwargs) as run:
        for step in range(STEPS):
            progress["step"] = step
            _step_loss(case, model, step).backward()
            run.step()
    return model, run


def _state(model):
    return {k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())}


def _bitwise_equal(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))
    return torch.equal(a, b)


# Variants whose executed steps save their tensors in another order than the profiled step, so the
# executor runs them plainly after the first mismatch (correct, one warning, no offload). Their
# gradients are still checked; only the "the plan ran" check is waived.
PROFILE_ORDER_DIFFERS = {
    "CTCLoss": "under the profiler's dispatch mode ctc_loss saves its length tensors before the targets; "
               "in eager mode the targets come first",
}

_PLAIN = {}


def _plain_state(variant):
    if variant not in _PLAIN:
        _PLAIN[variant] = _state(_train_plain(variant))
    return _PLAIN[variant]


def test_every_torch_nn_module_is_in_the_zoo():
    """A module class that torch.nn adds must be added to the zoo (or to NOT_TRAINABLE, with why)."""
    covered = {class_name(v) for v in ZOO}
    missing = [c for c in torch_nn_module_classes() if c not in covered and c not in NOT_TRAINABLE]
    assert not missing, f"torch.nn classes not in tests/python/module_zoo.py: {missing}"


def _is_refusal(err):
    """A clear refusal: memsched's own error type, or an error that names memsched and what to do."""
    return isinstance(err, _C.MemschedError) or "memsched" in str(err)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("variant", list(ZOO))
def test_module_trains_bitwise_as_plain(variant, config):
    want = _plain_state(variant)
    kwargs = CONFIGS[config]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes of the modules themselves; checked below instead
        progress = {}
        try:
            if kwargs == "ooo":
                model, run = _train_ooo(variant, progress)
            else:
                model, run = _train_optimize(variant, kwargs, progress)
        except Exception as err:  # noqa: BLE001 -- a refusal is allowed, if it is clear and at the first step
            assert _is_refusal(err), f"{variant} under {config}: unclear error {type(err).__name__}: {err}"
            assert progress.get("step") == 0, f"{variant} under {config}: refused at step {progress.get('step')}"
            pytest.skip(f"refused: {err}")
    got = _state(model)
    assert got.keys() == want.keys()
    diff = [k for k in want if not _bitwise_equal(got[k], want[k])]
    assert not diff, (f"{variant} under {config}: {diff} differ from plain PyTorch after {STEPS} AdamW steps "
                      f"(max abs diff {max((got[k] - want[k]).abs().max().item() for k in diff):.3g})")
    if run is not None and kwargs.get("planner", "").startswith("offload_all") \
            and variant not in PROFILE_ORDER_DIFFERS:
        executed = run.step_stats
        assert len(executed) == STEPS - 1, f"{variant}: {len(executed)} steps executed the plan"
        diverged = [s.mismatch for s in executed if s.mode != "planned"]
        assert not diverged, f"{variant} under {config}: the plan did not run: {diverged[0]}"
        if run.trace.activation_bytes() > 0:
            assert all(s.offloaded > 0 for s in executed), f"{variant} under {config}: nothing was offloaded"
    if run is not None and config == "hybrid-recompute-50%" and run.schedule is not None \
            and run.schedule.recompute and variant not in PROFILE_ORDER_DIFFERS:
        executed = [s for s in run.step_stats if s.mode == "planned"]
        assert executed, f"{variant}: no step executed the plan"
        for s in executed:
            assert s.recomputed + s.recompute_kept == len(run.schedule.recompute), (variant, s)
            assert s.recompute_kept == 0, f"{variant}: planned recomputes kept: {s.recompute_kept_reasons}"
