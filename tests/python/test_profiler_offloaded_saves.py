"""Profiling with saved activations offloaded (profiler/offloaded_saves.py, Note [Profiling with saved
activations offloaded]): the Trace equals a keep-all profile's, gradients are plain PyTorch's bit for
bit, and the step's saved activations leave the device.

Each case profiles the same model, batch and RNG state three ways -- plain PyTorch (no profiler),
ProfilerSession keeping every saved activation (the keep-all profile) and ProfilerSession(...,
offload=OffloadedSaves) -- and compares. Op durations differ between runs and are not compared.
"""
import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from memsched import models
from memsched.offload.host_buffers import HostBuffers
from memsched.offload.report import planned_activation_curve
from memsched.profiler import ProfilerSession
from memsched.profiler.offloaded_saves import OffloadedSaves
from trace_helpers import assert_same_held, assert_same_trace_structure

BATCH = 4


class _DropoutTransformer(nn.Module):
    """Token and position embeddings, two torch TransformerEncoderLayers with dropout, a head."""

    def __init__(self, vocab=64, d=32, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.tok(idx) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class _Untracked(nn.Module):
    """A saved tensor written after its save without a version bump (`.data`): plain PyTorch's
    backward reads the new values, a copy taken at the save (save_on_cpu) the old ones. Also rrelu
    (its noise) and a GRU."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.act = nn.RReLU()
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        y = torch.tanh(self.act(self.inp(x)))  # tanh saves its output y
        y.data.mul_(0.5)                        # untracked: backward of tanh reads the halved y
        out, _ = self.gru(y)
        return self.head(out)


class _DroppedGraph(nn.Module):
    """A forward whose first graph is dropped before backward (its saves die in forward)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))

    def forward(self, x):
        self.net(x * 2).sum()  # dropped: never backward
        return self.net(x)


class _Checkpointed(nn.Module):
    """Blocks under torch.utils.checkpoint: reentrant (its inputs saved in forward, the block
    recomputed and saved during backward) and non-reentrant (its own saved-tensor hooks)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.b = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.a, x.relu(), use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self.b, h.sigmoid(), use_reentrant=False)
        return self.head(h.relu())


def _case(name):
    """(model, step(model) -> loss), deterministic."""
    torch.manual_seed(0)
    if name in models.MODEL_NAMES:
        model = models.build_model(name, seed=0)
        x, y = models.example_batch(name, BATCH)
        return model, lambda m: models.loss_fn(name, m(x), y)
    if name == "transformer_dropout":
        model = _DropoutTransformer()
        idx = torch.randint(0, 64, (BATCH, 16))
        return model, lambda m: nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
    if name == "rrelu_gru":
        model = _Untracked()
        x, y = torch.randn(BATCH, 6, 12), torch.randint(0, 5, (BATCH, 6))
        return model, lambda m: nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
    if name == "dropped_graph":
        model = _DroppedGraph()
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        return model, lambda m: nn.functional.cross_entropy(m(x), y)
    if name == "checkpointed":
        model = _Checkpointed()
        x, y = torch.randn(BATCH, 32, requires_grad=True), torch.randint(0, 10, (BATCH,))
        return model, lambda m: nn.functional.cross_entropy(m(x), y)
    raise AssertionError(name)


def _run(model, step, how, host=None):
    """One step from the same RNG state: (trace or None, gradients, session or None)."""
    model = copy.deepcopy(model)
    model.train()
    session = None
    if how != "plain":
        saves = OffloadedSaves("cpu", host or HostBuffers(pinned=False), 0) if how == "offload" else None
        session = ProfilerSession(model, None, "cpu", offload=saves).start()
    torch.manual_seed(1)
    try:
        step(model).backward()
    finally:
        trace = session.stop() if session is not None else None
    return trace, [p.grad.clone() for p in model.parameters()], session


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


CASES = list(models.MODEL_NAMES) + ["transformer_dropout", "rrelu_gru", "dropped_graph", "checkpointed"]


@pytest.mark.parametrize("name", CASES)
def test_offloaded_profile_records_the_keep_all_trace_with_plain_gradients(name):
    model, step = _case(name)
    _, plain_grads, _ = _run(model, step, "plain")
    keep, keep_grads, keep_session = _run(model, step, "keep")
    off, off_grads, off_session = _run(model, step, "offload")

    assert_same_trace_structure(keep, off)
    assert_same_held(keep, off)
    assert off_session.node_of_op == keep_session.node_of_op  # the executor's prefetch triggers
    assert _bitwise(plain_grads, keep_grads) and _bitwise(plain_grads, off_grads)

    # Not vacuous: every activation the forward produced went to the host and came back (saves made
    # in backward -- a reentrant checkpoint's recompute -- stay, as the Note says).
    acts = [t for t in off.tensors if t.kind == "activation"]
    made = [t for t in acts if t.producer_op >= 0 and off.ops[t.producer_op].phase == "forward"]
    # torch 2.11's non-reentrant checkpoint also saves a 0-element dummy (gone in 2.14): nothing to offload, kept.
    empty = [t for t in made if t.bytes == 0]
    made = [t for t in made if t.bytes > 0]
    st = off_session.offload.stats
    assert len(acts) > 0 and st.mode == "offload"
    assert (st.offloaded, st.kept, st.host_limited) == (len(made), len(empty), 0)
    assert st.offloaded_bytes == sum(t.bytes for t in made) == st.d2h_bytes
    assert st.fetched == len([t for t in made if any(off.ops[u].phase == "backward" for u in t.uses)])
    assert st.activation_peak_bytes < max(planned_activation_curve(keep, None))


def test_dropout_masks_are_offloaded_and_replayed_bitwise():
    model, step = _case("transformer_dropout")
    off, off_grads, session = _run(model, step, "offload")
    _, plain_grads, _ = _run(model, step, "plain")
    assert any(op.rng for op in off.ops), "the case must draw random numbers"
    assert session.offload.stats.offloaded > 0 and _bitwise(plain_grads, off_grads)


def test_untracked_writes_after_the_save_reach_backward_as_in_plain_pytorch():
    """The copy is taken when only autograd holds the storage, so a write after the save that bumps
    no version (`.data`) is in it, as plain PyTorch's backward sees it; a copy at the save is not."""
    model, step = _case("rrelu_gru")
    _, plain_grads, _ = _run(model, step, "plain")
    _, off_grads, _ = _run(model, step, "offload")
    assert _bitwise(plain_grads, off_grads)
    m = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):  # copy at the save
        loss = step(m)
    loss.backward()
    assert not _bitwise(plain_grads, [p.grad for p in m.parameters()]), "the case must tell the two apart"


@pytest.mark.parametrize("name, most", [("transformer", 0.35), ("cnn", 0.5), ("mlp", 1.0), ("lstm", 1.0)])
def test_offloaded_profile_keeps_few_saved_activations_on_the_device(name, most):
    """The measured saved-activation peak (storages holding device memory: from a save until its
    forward users let go, and from backward's fetch until it dies) against the keep-all profile's
    (every saved storage from its producer to its free). mlp: two hidden layers, so an op's input
    and output together are most of it; lstm: CPU's fused LSTM op saves one workspace for every
    time step, which its one backward op needs at once -- both are still below plain's."""
    model, step = _case(name)
    off, _, session = _run(model, step, "offload")
    plain_peak = max(planned_activation_curve(off, None))
    measured = session.offload.stats.activation_peak_bytes
    assert 0 < measured < plain_peak
    assert measured <= most * plain_peak, f"{measured} of {plain_peak} bytes of plain's saved activations"


def test_in_place_change_after_the_save_raises_as_in_plain_pytorch():
    lin = nn.Linear(8, 8)

    def step(m):
        y = m(torch.randn(4, 8)).sigmoid()  # sigmoid saves its output
        z = y * 3
        y.add_(1)                            # ... which changes before backward: plain raises
        return z.sum() + y.sum()

    _run(lin, lambda m: m(torch.randn(4, 8)).sum(), "offload")  # a clean step works
    for how in ("plain", "keep", "offload"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _run(lin, step, how)


class _ZeroesItsSavedInput(torch.autograd.Function):
    """Its backward writes its saved input in place: plain PyTorch then raises at the unpack of any other
    save of that tensor (here sigmoid's of its output), the unpacked tensor sharing its version counter."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        x.mul_(0.0)
        return g * 2.0 + x


def test_an_in_place_change_in_backward_raises_at_the_next_unpack_as_in_plain_pytorch():
    """Note [Version counter of a saved tensor]: the unpacked copy had a version counter of its own, so the
    change went unseen and sigmoid's backward read the zeroed storage."""
    lin = nn.Linear(8, 8)

    def step(m):
        y = torch.sigmoid(m(torch.randn(4, 8)))  # sigmoid saves its output y
        return _ZeroesItsSavedInput.apply(y).sum()

    for how in ("plain", "keep", "offload"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _run(lin, step, how)


def test_a_retained_graph_unpacks_twice_with_plain_gradients():
    model, step = _case("cnn")

    def twice(m):
        loss = step(m)
        loss.backward(retain_graph=True)
        return loss * 1.0  # the caller's backward() runs the graph a second time

    keep, keep_grads, _ = _run(model, twice, "keep")
    off, off_grads, session = _run(model, twice, "offload")
    _, plain_grads, _ = _run(model, twice, "plain")
    assert_same_trace_structure(keep, off)
    assert_same_held(keep, off)
    assert _bitwise(plain_grads, off_grads) and session.offload.stats.fetched > 0


def test_host_memory_limit_keeps_the_rest_on_the_device():
    model, step = _case("transformer")
    keep, _, _ = _run(model, step, "keep")
    limit = 64 * 1024
    host = HostBuffers(pinned=False, limit_bytes=limit)
    if host.pool is None:
        pytest.skip("this build has no HostTensorPool: torch's host allocator keeps no count to limit")
    off, off_grads, session = _run(model, step, "offload", host=host)
    _, plain_grads, _ = _run(model, step, "plain")
    st = session.offload.stats
    assert st.host_limited > 0 and st.kept == st.host_limited and 0 < st.offloaded_bytes <= limit
    assert_same_trace_structure(keep, off)
    assert_same_held(keep, off)
    assert _bitwise(plain_grads, off_grads)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_cuda_offloaded_profile_matches_keep_all_and_holds_less(name):
    """On CUDA: the same Trace, bitwise gradients, and a lower max_memory_allocated for the step."""
    torch.manual_seed(0)
    model = models.build_model(name, "realistic", device="cuda", seed=0)
    x, y = models.example_batch(name, 8, "realistic", device="cuda")
    out = {}
    for how in ("keep", "offload"):
        m = copy.deepcopy(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        saves = OffloadedSaves("cuda", HostBuffers(pinned=True), 0) if how == "offload" else None
        session = ProfilerSession(m, None, "cuda", offload=saves).start()
        # cuDNN may pick a convolution backward that accumulates with atomics (run-to-run rounding):
        # deterministic algorithms, so that "bitwise" compares memsched's copies, not cuDNN's choice.
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            models.loss_fn(name, m(x), y).backward()
        trace = session.stop()
        torch.cuda.synchronize()
        # the profiler restarts the allocator's peak at every op: the step's is the session's
        # (Note [Memory the trace does not model])
        out[how] = (trace, [p.grad.clone() for p in m.parameters()], session.device_peak_bytes)
        if saves is not None:
            saves.finish()
    (keep, keep_grads, keep_peak), (off, off_grads, off_peak) = out["keep"], out["offload"]
    assert_same_trace_structure(keep, off)
    assert_same_held(keep, off)
    assert _bitwise(keep_grads, off_grads)
    assert off_peak < keep_peak


def _zoo_variants():
    from module_zoo import ZOO
    return sorted(ZOO)


@pytest.mark.parametrize("variant", _zoo_variants())
def test_every_torch_nn_module_profiles_offloaded_as_kept(variant):
    """Every torch.nn module class (tests/python/module_zoo.py): one step profiled keeping and
    offloading saved activations gives the same Trace, gradients and buffers."""
    from module_zoo import ZOO, ZooModel, loss_of, make_inputs

    case = ZOO[variant]
    results = {}
    for how in ("keep", "offload"):
        torch.manual_seed(0)
        model = ZooModel(case, make_inputs(case, 0))
        if case.lazy:  # materialise lazy parameters first, as the zoo does
            model(*make_inputs(case, 0))
        saves = OffloadedSaves("cpu", HostBuffers(pinned=False), 0) if how == "offload" else None
        session = ProfilerSession(model, None, "cpu", offload=saves).start()
        torch.manual_seed(1)
        try:
            loss_of(model(*make_inputs(case, 100))).backward()
        finally:
            trace = session.stop()
        state = [p.grad for p in model.parameters() if p.grad is not None] + list(model.buffers())
        results[how] = (trace, [t.detach().clone() for t in state], saves)
    (keep, keep_state, _), (off, off_state, saves) = results["keep"], results["offload"]
    assert_same_trace_structure(keep, off)
    assert_same_held(keep, off)
    assert _bitwise(keep_state, off_state)
    assert saves.stats.offloaded > 0  # every variant saves something that goes to host and back
