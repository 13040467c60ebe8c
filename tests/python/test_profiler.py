"""memsched.profile on CPU: hand-counted saved activations, kinds, module paths,
FLOPs, the memory curve against an independent tracker, and cleanup.

Hand counts assume float32 (4 bytes) unless said otherwise.
"""
import pytest
import torch
from torch import nn

import memsched
from memsched import models

F32 = 4


def hooks_left(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def assert_clean(model, optimizer=None):
    assert hooks_left(model) == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def acts(trace):
    return [t for t in trace.tensors if t.kind == "activation"]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def test_mlp_saved_activation_bytes_by_hand():
    model, x = mlp(), torch.randn(5, 4)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model)
    # Linear0 saves x only (x needs no grad, so W0 is not needed); each ReLU saves
    # its output; Linear2/Linear4 save the ReLU outputs again (same storage) and
    # their weights (parameters, not activations).
    x_b, h_b = 5 * 4 * F32, 5 * 8 * F32
    assert trace.activation_bytes() == x_b + 2 * h_b == 400
    assert [t.label for t in acts(trace)] == [
        "act:0:0:[5, 4]:float32", "act:1:1:[5, 8]:float32", "act:2:3:[5, 8]:float32"]
    param_b = F32 * sum(p.numel() for p in model.parameters())
    assert param_b == F32 * (32 + 8 + 64 + 8 + 24 + 3)
    assert trace.bytes_of_kind("parameter") == param_b
    assert trace.bytes_of_kind("gradient") == param_b  # one .grad per parameter
    assert sum(t.kind == "gradient" for t in trace.tensors) == 6
    # Memory during the forward loss op (aten::sum over the logits): parameters,
    # x, both saved ReLU outputs, the logits (5x3) and the loss scalar. The
    # pre-ReLU addmm outputs died after their ReLU.
    fwd_sum = next(o.id for o in trace.ops if o.name == "aten::sum" and o.phase == "forward")
    assert trace.live_bytes()[fwd_sum] == param_b + x_b + 2 * h_b + 5 * 3 * F32 + F32


def test_mlp_ops_phases_module_paths_and_flops():
    model, x = mlp(), torch.randn(5, 4)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model)
    fwd = [o for o in trace.ops if o.phase == "forward"]
    bwd = [o for o in trace.ops if o.phase == "backward"]
    assert [o.module_path for o in fwd if o.name == "aten::addmm"] == ["0", "2", "4"]
    assert [o.module_path for o in fwd if o.name == "aten::relu"] == ["1", "3"]
    assert [o.module_path for o in bwd if o.name == "aten::threshold_backward"] == ["3", "1"]
    # Backward matmuls belong to the Linear they differentiate, in reverse order.
    assert [o.module_path for o in bwd if o.name == "aten::mm"] == ["4", "4", "2", "2", "0"]
    # FLOPs (torch.utils.flop_counter): 2*M*K*N per matmul.
    assert [o.flops for o in fwd if o.name == "aten::addmm"] == [2 * 5 * 4 * 8, 2 * 5 * 8 * 8, 2 * 5 * 8 * 3]
    assert sum(o.flops for o in bwd) == 2 * 5 * (8 * 3 * 2 + 8 * 8 * 2 + 4 * 8)
    assert all(o.duration_us >= 0 for o in trace.ops) and sum(o.duration_us for o in trace.ops) > 0
    addmm0 = next(o for o in fwd if o.name == "aten::addmm")
    assert addmm0.bytes_read == F32 * (8 + 5 * 4 + 8 * 4) and addmm0.bytes_written == F32 * 5 * 8
    assert trace.device == "cpu"


def test_fast_matmul_flops_equal_flop_counter():
    from torch.utils.flop_counter import flop_registry

    from memsched.profiler.flops import flop_fn

    aten = torch.ops.aten
    a, b, bias = torch.randn(3, 5), torch.randn(5, 7), torch.randn(7)
    ba, bb = torch.randn(2, 3, 5), torch.randn(2, 5, 4)
    cases = [(aten.mm.default, (a, b)), (aten.addmm.default, (bias, a, b)), (aten.bmm.default, (ba, bb)),
             (aten.baddbmm.default, (torch.randn(2, 3, 4), ba, bb))]
    for op, args in cases:
        out = op(*args)
        assert flop_fn(op)(args, {}, out) == flop_registry[op._overloadpacket](*args, out_val=out) > 0


def test_cnn_with_batchnorm_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 5))
    x = torch.randn(2, 3, 8, 8)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model)
    # conv saves x; BatchNorm saves its input and the per-channel batch mean and
    # inverse std (its weight and running stats are parameters/buffers); ReLU its
    # output; max-pool the ReLU output (same storage) and int64 indices; the
    # Linear the pooled output (through the Flatten view).
    expected = {
        "act:0:0:[2, 3, 8, 8]:float32": 2 * 3 * 8 * 8 * F32,
        "act:1:1:[2, 4, 8, 8]:float32": 2 * 4 * 8 * 8 * F32,
        "act:2:1:[4]:float32": 4 * F32,
        "act:3:1:[4]:float32": 4 * F32,
        "act:4:2:[2, 4, 8, 8]:float32": 2 * 4 * 8 * 8 * F32,
        "act:5:3:[2, 4, 4, 4]:int64": 2 * 4 * 4 * 4 * 8,
        "act:6:5:[2, 4, 4, 4]:float32": 2 * 4 * 4 * 4 * F32,
    }
    assert {t.label: t.bytes for t in acts(trace)} == expected
    assert trace.activation_bytes() == sum(expected.values()) == 7200
    conv = next(o for o in trace.ops if o.name == "aten::convolution")
    assert conv.flops == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3) and conv.module_path == "0"
    # BatchNorm buffers (running_mean, running_var, num_batches_tracked) are parameters.
    buffer_b = 4 * F32 * 2 + 8
    assert trace.bytes_of_kind("parameter") == F32 * sum(p.numel() for p in model.parameters()) + buffer_b


def test_small_transformer_attention_layernorm_gelu():
    b, s, d, h = 2, 16, 32, 2  # models.build_model("transformer"): d_model 32, 2 heads, seq 16
    model = models.build_model("transformer", "small")
    step = models.make_step_fn(model, "transformer", b)
    trace = memsched.profile(step, model=model)
    by_module = {}
    for t in acts(trace):
        path = t.label.split(":")[2]
        by_module.setdefault(path, []).append(t.bytes)
    for layer in range(2):
        p = f"blocks.{layer}"
        # LayerNorm saves its input and the per-row mean and rstd.
        assert sorted(by_module[f"{p}.ln1"]) == sorted([b * s * d * F32, b * s * F32, b * s * F32])
        assert sorted(by_module[f"{p}.ln2"]) == sorted([b * s * d * F32, b * s * F32, b * s * F32])
        # GELU saves its input: the fc1 output, 4*d wide.
        assert by_module[f"{p}.mlp.1"] == [b * s * 4 * d * F32]
        # Attention saves the softmax output (b, h, s, s) among others.
        assert b * h * s * s * F32 in by_module[f"{p}.attn"]
    # Tied weights: the embedding weight is one parameter record and one gradient.
    vocab = 64
    params = [t for t in trace.tensors if t.kind == "parameter"]
    unique_param_b = F32 * sum(p.numel() for p in model.parameters())
    assert sum(t.bytes for t in params) == unique_param_b
    assert sum(t.bytes == vocab * d * F32 for t in params) == 1
    grads = [t for t in trace.tensors if t.kind == "gradient"]
    assert sum(t.bytes for t in grads) == unique_param_b
    # Backward ops carry the module whose forward they differentiate (Note [Backward module path]).
    bwd = [o for o in trace.ops if o.phase == "backward"]
    assert [o.module_path for o in bwd if o.name == "aten::_softmax_backward_data"] == ["blocks.1.attn",
                                                                                        "blocks.0.attn"]
    assert [o.module_path for o in bwd if o.name == "aten::gelu_backward"] == ["blocks.1.mlp.1", "blocks.0.mlp.1"]
    assert [o.module_path for o in bwd if o.name == "aten::native_layer_norm_backward"] == [
        "ln_f", "blocks.1.ln2", "blocks.1.ln1", "blocks.0.ln2", "blocks.0.ln1"]
    assert [o.module_path for o in bwd if o.name == "aten::embedding_dense_backward"] == ["pos", "tok"] or \
        [o.module_path for o in bwd if o.name == "aten::embedding_dense_backward"] == ["tok", "pos"]
    assert {o.name for o in trace.ops} >= {"aten::native_layer_norm", "aten::gelu", "aten::_softmax",
                                           "aten::native_layer_norm_backward", "aten::gelu_backward"}


def test_lstm():
    model = models.build_model("lstm", "small")  # embed 16, hidden 32, 1 layer, seq 8, vocab 32
    step = models.make_step_fn(model, "lstm", 4)
    trace = memsched.profile(step, model=model)
    records = acts(trace)
    labels = [t.label for t in records]
    # The embedding saves the token ids; the LSTM saves its whole input sequence
    # (4 x 8 x 16, as a time-major copy on the oneDNN CPU path) and its output
    # sequence (4 x 8 x 32) plus its initial and final states (4 x 32 each).
    assert labels[0] == "act:0:embed:[4, 8]:int64" and records[0].bytes == 4 * 8 * 8
    lstm_bytes = [t.bytes for t in records if t.label.split(":")[2] == "lstm"]
    assert 4 * 8 * 16 * F32 in lstm_bytes and 4 * 8 * 32 * F32 in lstm_bytes
    assert lstm_bytes.count(4 * 32 * F32) >= 2
    assert trace.activation_bytes() == sum(t.bytes for t in records)
    assert trace.bytes_of_kind("parameter") == F32 * sum(p.numel() for p in model.parameters())
    assert trace.bytes_of_kind("gradient") == trace.bytes_of_kind("parameter")
    assert any(o.phase == "backward" and o.module_path == "lstm" for o in trace.ops)


def test_tied_weights_count_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6, bias=False)
            self.b = nn.Linear(6, 6, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x).tanh())

    model, x = Tied(), torch.randn(3, 6)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model)
    w_b = 6 * 6 * F32
    assert trace.bytes_of_kind("parameter") == w_b
    assert trace.bytes_of_kind("gradient") == w_b  # both uses accumulate into one .grad
    # a saves x; tanh saves its output; b saves the tanh output (same storage).
    assert trace.activation_bytes() == 3 * 6 * F32 * 2


def test_in_place_and_views_do_not_double_count():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x):
            h = self.fc(x)
            h.relu_()                          # in place: saves h itself
            v = h.view(5, 2, 4).transpose(0, 1)  # two views of h's storage
            return (v * v).sum()               # mul saves both operands: views of h

    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(5, 4)
    trace = memsched.profile(lambda: model(x).backward(), model=model)
    h_b = 5 * 8 * F32
    assert trace.activation_bytes() == 5 * 4 * F32 + h_b
    h_records = [t for t in trace.tensors if t.bytes == h_b and t.producer_op >= 0
                 and trace.ops[t.producer_op].name == "aten::addmm"]
    assert len(h_records) == 1 and h_records[0].kind == "activation"
    h = h_records[0]
    names_using_h = [trace.ops[u].name for u in h.uses]
    # relu_ writes h; forward mul reads its views; backward mul and
    # threshold_backward read the saved h. View ops are not Op records (Note
    # [Profiler overhead]): they allocate, read and compute nothing.
    assert names_using_h == ["aten::relu_", "aten::mul", "aten::mul", "aten::mul", "aten::threshold_backward"]
    assert not any(o.name in ("aten::view", "aten::transpose", "aten::t", "aten::detach") for o in trace.ops)
    relu_ = next(o for o in trace.ops if o.name == "aten::relu_")
    assert relu_.bytes_written == h_b  # in place: writes h, allocates nothing
    # In forward only addmm (h), mul (v * v), sum and the seed gradient (ones_like,
    # see Note [Backward module path]) allocated; views and relu_ did not.
    fwd_new = [t for t in trace.tensors if t.producer_op >= 0 and trace.ops[t.producer_op].phase == "forward"]
    assert [trace.ops[t.producer_op].name for t in fwd_new] == ["aten::addmm", "aten::mul", "aten::sum",
                                                                "aten::ones_like"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "lstm"])
def test_peak_agrees_with_mem_tracker(name):
    """The trace's peak equals torch.distributed._tools.mem_tracker's on the same step.

    Tolerance 0 bytes: on CPU both count whole storages (untyped_storage().nbytes(),
    no allocator rounding) at op granularity, and both are told about the same
    pre-existing tensors (the model and the batch). On CUDA the comparison is
    with torch.cuda.max_memory_allocated at 5% (test_cuda_peak_matches_allocator).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    model = models.build_model(name, "small")
    x, y = models.example_batch(name, 4)

    def step():
        models.loss_fn(name, model(x), y).backward()

    tracker = MemTracker()
    tracker.track_external(model, x, y)
    with tracker:
        trace = memsched.profile(step, model=model)
    assert trace.peak_bytes() == tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert_clean(model)


def test_optimizer_state_and_phase():
    model, x = mlp(), torch.randn(5, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model, optimizer=opt)
    param_b = F32 * sum(p.numel() for p in model.parameters())
    n_params = len(list(model.parameters()))
    # Adam's first step makes exp_avg and exp_avg_sq per parameter and a float32 step count.
    assert trace.bytes_of_kind("optimizer_state") == 2 * param_b + n_params * F32
    opt_ops = [o for o in trace.ops if o.phase == "optimizer"]
    assert opt_ops and trace.ops[-1].phase == "optimizer"
    assert all(o.phase != "optimizer" for o in trace.ops[: opt_ops[0].id])
    assert len(opt.state) == n_params  # profile() stepped the optimizer once
    assert_clean(model, opt)


def test_optimizer_stepped_by_step_fn_is_not_stepped_twice():
    model, x = mlp(), torch.randn(5, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def step():
        model(x).sum().backward()
        opt.step()
        calls.append(1)

    trace = memsched.profile(step, model=model, optimizer=opt)
    expected = [b - 0.5 * p.grad for b, p in zip(before, model.parameters())]
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
    assert any(o.phase == "optimizer" for o in trace.ops)


def test_nothing_left_behind_after_success_and_exception():
    model, x = mlp(), torch.randn(5, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memsched.profile(lambda: model(x).sum().backward(), model=model, optimizer=opt)
    assert_clean(model, opt)

    def bad_step():
        model(x).sum().backward()
        raise ValueError("user error")

    with pytest.raises(ValueError, match="user error"):
        memsched.profile(bad_step, model=model, optimizer=opt)
    assert_clean(model, opt)

    def bad_forward():
        model(x[:, :3])  # shape error inside a module's forward

    with pytest.raises(RuntimeError):
        memsched.profile(bad_forward, model=model)
    assert_clean(model)
    # The model still trains normally afterwards.
    model(x).sum().backward()


def test_trace_json_round_trip(tmp_path):
    model = models.build_model("cnn", "small")
    trace = memsched.profile(models.make_step_fn(model, "cnn", 2), model=model)
    path = tmp_path / "trace.json"
    trace.to_json(str(path))
    loaded = memsched.Trace.from_json(str(path))
    assert loaded.to_json_string() == trace.to_json_string()
    assert loaded.peak_bytes() == trace.peak_bytes() and loaded.live_bytes() == trace.live_bytes()


def test_bad_arguments():
    with pytest.raises(TypeError, match="step_fn must be callable"):
        memsched.profile(None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        memsched.profile(lambda: None, model="mlp")


def test_a_module_passed_as_step_fn_is_named():
    # was: the module was called with no input, and its own error ("missing argument") said nothing of step_fn
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"step_fn is a module \(Linear\); pass a function that runs one training "
                                        r"step.*model="):
        memsched.profile(model, model=model)


def test_free_detection_op_by_op():
    x = torch.randn(100)  # 400 bytes, exists before the step

    def step():
        a = x * 2          # op 0
        b = a + 1          # op 1
        del a              # a dies after op 1
        c = b * 3          # op 2
        del b              # b dies after op 2
        return c.sum()     # op 3; c and the sum die when step returns

    trace = memsched.profile(step)
    assert [o.name for o in trace.ops] == ["aten::mul", "aten::add", "aten::mul", "aten::sum"]
    by_producer = {t.producer_op: t for t in trace.tensors}
    assert by_producer[0].freed_after_op == 1 and by_producer[0].uses == [1]  # read by op 1 only
    assert by_producer[1].freed_after_op == 2 and by_producer[1].uses == [2]
    assert by_producer[2].freed_after_op == 3 and by_producer[3].freed_after_op == 3
    assert by_producer[-1].bytes == 400 and by_producer[-1].freed_after_op == -1
    assert trace.live_bytes() == [800, 1200, 1200, 804]


def test_profile_without_model_counts_everything_as_seen():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    trace = memsched.profile(lambda: (x @ w).tanh().sum().backward())
    # No model: w is first seen as an op input, so it is a pre-existing temporary
    # (nothing is a parameter); mm saves x (for dw; x needs no grad, so w is not
    # saved) and tanh its output.
    assert trace.activation_bytes() == 2 * 4 * F32 + 2 * 4 * F32
    assert trace.bytes_of_kind("parameter") == 0
    w_rec = next(t for t in trace.tensors if t.bytes == 4 * 4 * F32 and t.producer_op == -1)
    assert w_rec.kind == "temporary" and w_rec.uses


@pytest.mark.requires_cuda
def test_cuda_peak_matches_allocator():
    """Trace peak vs torch.cuda.max_memory_allocated of the same step run again, within 5%.

    One plain step first, so one-time allocations (the cuBLAS workspace) exist as in any later step.
    The trace counts the tensors existing before the step (parameters, the batch) and, measured from
    the allocator around each op, the memory no tensor explains (the workspace, rounding; Note
    [Memory the trace does not model]), so the peaks compare as they are.
    """
    model = models.build_model("transformer", "realistic", device="cuda")
    step = models.make_step_fn(model, "transformer", 8, "realistic", device="cuda")
    step()
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    trace = memsched.profile(step, model=model)
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    assert trace.device == "cuda:0"
    assert abs(trace.peak_bytes() - measured) <= 0.05 * measured, (trace.peak_bytes(), measured)
    assert all(o.duration_us >= 0 for o in trace.ops)
    assert sum(o.duration_us for o in trace.ops if o.name == "aten::mm") > 0

def test_session_start_stop_equals_profile_and_abort_is_clean():
    from memsched.profiler import ProfilerSession

    model = models.build_model("mlp", "small")
    step = models.make_step_fn(model, "mlp", 3)
    expected = memsched.profile(step, model=model)
    session = ProfilerSession(model).start()
    assert session.recording
    with pytest.raises(RuntimeError, match="already recording"):
        session.start()
    step()
    trace = session.stop()
    assert not session.recording
    assert [o.name for o in trace.ops] == [o.name for o in expected.ops]
    assert trace.live_bytes() == expected.live_bytes()
    assert [t.label for t in trace.tensors] == [t.label for t in expected.tensors]
    assert_clean(model)
    with pytest.raises(RuntimeError, match="not recording"):
        session.stop()
    session = ProfilerSession(model).start()
    session.abort()
    session.abort()  # twice is fine
    assert_clean(model)
