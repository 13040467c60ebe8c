"""Every torch.nn module class, built small, as a trainable model with its inputs.

Used by test_module_zoo.py. ZOO maps a variant name to a Case: a constructor
for the module under test and a function that makes its inputs. Each class of
torch.nn that is an nn.Module appears under its own name (with variants such
as "LSTM-proj" for the configurations that take other code paths) or in
NOT_TRAINABLE with the reason it has no forward of its own to train. The list
of classes comes from torch.nn itself (torch_nn_module_classes()), so a class
that a newer torch adds fails test_every_torch_nn_module_is_in_the_zoo until
it is added here.

Inputs: an input made with `grad=True` is multiplied by a parameter of its
shape before the module sees it (so the module's saved activations are
activations of a training step, and modules without parameters still train
something); `grad=False` inputs (targets, indices, lengths) are passed as they
are. The loss is the sum of every floating-point output times fixed random
weights, so every output element gets its own gradient.
"""
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ZOO", "NOT_TRAINABLE", "Case", "ZooModel", "make_inputs", "loss_of", "torch_nn_module_classes",
           "class_name"]


@dataclass
class In:
    """One input: a factory taking a torch.Generator, and whether it is scaled by a parameter."""
    make: Callable[[torch.Generator], torch.Tensor]
    grad: bool = True


def randn(*shape, positive=False):
    def make(g):
        t = torch.randn(*shape, generator=g)
        return t.abs() + 0.1 if positive else t
    return In(make)


def const(fn):
    return In(fn, grad=False)


def randint(high, *shape):
    return const(lambda g: torch.randint(0, high, shape, generator=g))


def sign(*shape):
    return const(lambda g: torch.randint(0, 2, shape, generator=g).float() * 2 - 1)


def uniform(*shape):
    return const(lambda g: torch.rand(*shape, generator=g))


@dataclass
class Case:
    build: Callable[[], nn.Module]
    inputs: List[In]
    pre: Callable = None          # applied to the first (scaled) input, e.g. sigmoid for BCELoss
    cls: str = ""                 # torch.nn class covered; default: the variant name up to "-"
    lazy: bool = False            # has lazy parameters: run one forward before making the optimizer
    fixed_inputs: bool = False    # saved tensors' shapes depend on the values: the same inputs every step


class ZooModel(nn.Module):
    """The module under test behind one parameter per float input tensor (tuples: per element)."""

    def __init__(self, case: Case, inputs: list):
        super().__init__()
        self.inner = case.build()
        self.pre = case.pre
        self.grad_mask = [spec.grad for spec in case.inputs]
        scales = []
        for x, grad in zip(inputs, self.grad_mask):
            for t in (x if isinstance(x, tuple) else (x,)) if grad else ():
                ramp = torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) / max(t.numel(), 1)
                scales.append(nn.Parameter(1.0 + 0.01 * ramp))
        self.scales = nn.ParameterList(scales)

    def forward(self, *inputs):
        scales = iter(self.scales)
        args = []
        for i, (x, grad) in enumerate(zip(inputs, self.grad_mask)):
            if grad and isinstance(x, tuple):
                x = tuple(t * next(scales) for t in x)
            elif grad:
                x = x * next(scales)
                if i == 0 and self.pre is not None:
                    x = self.pre(x)
            args.append(x)
        return self.inner(*args)


def make_inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [spec.make(g) for spec in case.inputs]


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() and out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    return []


def loss_of(out, weights_seed=1234):
    """Sum of each floating-point output times fixed random weights (same weights every step)."""
    g = torch.Generator().manual_seed(weights_seed)
    total = 0
    for o in _outputs(out):
        w = torch.randn(o.shape, generator=g, dtype=o.dtype)
        total = total + (o * w).sum()
    return total


# -- the zoo -------------------------------------------------------------------------------------
N = 3  # batch


def _mlp(cls, *args, **kw):
    return lambda: cls(*args, **kw)


class MaxUnpoolCase(nn.Module):
    """MaxUnpool needs the indices of a MaxPool of the same dimensionality."""

    def __init__(self, dims):
        super().__init__()
        self.pool = [None, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d][dims](2, return_indices=True)
        self.unpool = [None, nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d][dims](2)

    def forward(self, x):
        y, idx = self.pool(x)
        return self.unpool(y * 2, idx)


def _spatial(dims, c=2, s=4):
    return (N, c) + (s,) * dims


def _zoo() -> Dict[str, Case]:
    z: Dict[str, Case] = {}

    def add(name, build, inputs, **kw):
        assert name not in z, name
        z[name] = Case(build, inputs, **kw)

    # pooling
    for d in (1, 2, 3):
        shp = _spatial(d)
        add(f"AdaptiveAvgPool{d}d", _mlp(getattr(nn, f"AdaptiveAvgPool{d}d"), 2), [randn(*shp)])
        add(f"AdaptiveMaxPool{d}d", _mlp(getattr(nn, f"AdaptiveMaxPool{d}d"), 2), [randn(*shp)])
        add(f"AvgPool{d}d", _mlp(getattr(nn, f"AvgPool{d}d"), 2), [randn(*shp)])
        add(f"MaxPool{d}d", _mlp(getattr(nn, f"MaxPool{d}d"), 2), [randn(*shp)])
        add(f"LPPool{d}d", _mlp(getattr(nn, f"LPPool{d}d"), 2, 2), [randn(*shp)])
        add(f"MaxUnpool{d}d", lambda d=d: MaxUnpoolCase(d), [randn(*shp)])
        for pad in ("Circular", "Constant", "Reflection", "Replication", "Zero"):
            cls = getattr(nn, f"{pad}Pad{d}d")
            add(f"{pad}Pad{d}d", (lambda cls=cls: cls(1, 0.5)) if pad == "Constant" else (lambda cls=cls: cls(1)),
                [randn(*shp)])
        add(f"BatchNorm{d}d", _mlp(getattr(nn, f"BatchNorm{d}d"), 2), [randn(*shp)])
        add(f"InstanceNorm{d}d", _mlp(getattr(nn, f"InstanceNorm{d}d"), 2, affine=True, track_running_stats=True),
            [randn(*shp)])
        add(f"Conv{d}d", _mlp(getattr(nn, f"Conv{d}d"), 2, 3, 3, padding=1), [randn(*shp)])
        add(f"Conv{d}d-stride-groups", _mlp(getattr(nn, f"Conv{d}d"), 2, 4, 3, stride=2, groups=2, bias=False),
            [randn(*shp)])
        add(f"ConvTranspose{d}d", _mlp(getattr(nn, f"ConvTranspose{d}d"), 2, 3, 3, stride=2), [randn(*shp)])
        add(f"LazyBatchNorm{d}d", _mlp(getattr(nn, f"LazyBatchNorm{d}d")), [randn(*shp)], lazy=True)
        add(f"LazyInstanceNorm{d}d", _mlp(getattr(nn, f"LazyInstanceNorm{d}d"), affine=True), [randn(*shp)],
            lazy=True)
        add(f"LazyConv{d}d", _mlp(getattr(nn, f"LazyConv{d}d"), 3, 3), [randn(*shp)], lazy=True)
        add(f"LazyConvTranspose{d}d", _mlp(getattr(nn, f"LazyConvTranspose{d}d"), 3, 3), [randn(*shp)], lazy=True)
        add(f"Dropout{d}d" if d > 1 else "Dropout1d", _mlp(getattr(nn, f"Dropout{d}d"), 0.3), [randn(*shp)])
    add("Conv2d-padding-same-reflect", _mlp(nn.Conv2d, 2, 3, 3, padding="same", padding_mode="reflect"),
        [randn(*_spatial(2))])
    add("FractionalMaxPool2d", _mlp(nn.FractionalMaxPool2d, 2, output_size=2), [randn(*_spatial(2, s=5))])
    add("FractionalMaxPool3d", _mlp(nn.FractionalMaxPool3d, 2, output_size=2), [randn(*_spatial(3, s=5))])
    add("MaxPool2d-indices", _mlp(nn.MaxPool2d, 2, return_indices=True), [randn(*_spatial(2))])

    # activations, in place and not
    for name in ("CELU", "ELU", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU", "Mish", "ReLU", "ReLU6",
                 "RReLU", "SELU", "SiLU"):
        cls = getattr(nn, name)
        add(name, _mlp(cls), [randn(N, 5)])
        add(f"{name}-inplace", _mlp(cls, inplace=True), [randn(N, 5)])
    for name in ("GELU", "Hardshrink", "LogSigmoid", "Sigmoid", "Softplus", "Softshrink", "Softsign", "Tanh",
                 "Tanhshrink", "Identity", "Flatten"):
        add(name, _mlp(getattr(nn, name)), [randn(N, 5)])
    add("GELU-tanh", _mlp(nn.GELU, approximate="tanh"), [randn(N, 5)])
    add("Threshold", _mlp(nn.Threshold, 0.1, 20.0), [randn(N, 5)])
    add("Threshold-inplace", _mlp(nn.Threshold, 0.1, 20.0, inplace=True), [randn(N, 5)])
    add("PReLU", _mlp(nn.PReLU, 5), [randn(N, 5)])
    add("GLU", _mlp(nn.GLU), [randn(N, 6)])
    for name in ("Softmax", "Softmin", "LogSoftmax"):
        add(name, _mlp(getattr(nn, name), dim=1), [randn(N, 5)])
    add("Softmax2d", _mlp(nn.Softmax2d), [randn(*_spatial(2))])
    add("Dropout", _mlp(nn.Dropout, 0.3), [randn(N, 5)])
    add("Dropout-inplace", _mlp(nn.Dropout, 0.3, inplace=True), [randn(N, 5)])
    add("AlphaDropout", _mlp(nn.AlphaDropout, 0.3), [randn(N, 5)])
    add("FeatureAlphaDropout", _mlp(nn.FeatureAlphaDropout, 0.3), [randn(*_spatial(2))])

    # linear, embeddings, shape ops
    add("Linear", _mlp(nn.Linear, 5, 4), [randn(N, 5)])
    add("Linear-3d-nobias", _mlp(nn.Linear, 5, 4, bias=False), [randn(N, 2, 5)])
    add("LazyLinear", _mlp(nn.LazyLinear, 4), [randn(N, 5)], lazy=True)
    add("Bilinear", _mlp(nn.Bilinear, 5, 3, 4), [randn(N, 5), randn(N, 3)])
    add("Embedding", _mlp(nn.Embedding, 10, 4), [randint(10, N, 6)])
    add("Embedding-padding_idx", _mlp(nn.Embedding, 10, 4, padding_idx=0),
        [const(lambda g: torch.tensor([[0, 1, 2, 0], [3, 0, 4, 5], [9, 9, 0, 1]]))])
    add("Embedding-max_norm", _mlp(nn.Embedding, 10, 4, max_norm=1.0), [randint(10, N, 6)])
    for mode in ("sum", "mean", "max"):
        add(f"EmbeddingBag-{mode}", _mlp(nn.EmbeddingBag, 10, 4, mode=mode),
            [randint(10, 8), const(lambda g: torch.tensor([0, 3, 5]))])
    add("EmbeddingBag-padding_idx", _mlp(nn.EmbeddingBag, 10, 4, mode="mean", padding_idx=0),
        [const(lambda g: torch.tensor([[0, 1, 2], [3, 0, 0], [9, 9, 1]]))])
    add("EmbeddingBag-per_sample_weights", _mlp(nn.EmbeddingBag, 10, 4, mode="sum"),
        [randint(10, 8), const(lambda g: torch.tensor([0, 3, 5])), randn(8)])
    add("Unflatten", _mlp(nn.Unflatten, 1, (2, 3)), [randn(N, 6)])
    add("Fold", _mlp(nn.Fold, (3, 3), 2), [randn(N, 8, 4)])
    add("Unfold", _mlp(nn.Unfold, 2), [randn(*_spatial(2))])
    add("PixelShuffle", _mlp(nn.PixelShuffle, 2), [randn(N, 8, 2, 2)])
    add("PixelUnshuffle", _mlp(nn.PixelUnshuffle, 2), [randn(N, 2, 4, 4)])
    add("ChannelShuffle", _mlp(nn.ChannelShuffle, 2), [randn(N, 4, 2, 2)])
    add("Upsample", _mlp(nn.Upsample, scale_factor=2, mode="nearest"), [randn(*_spatial(2))])
    add("Upsample-bilinear", _mlp(nn.Upsample, scale_factor=2, mode="bilinear"), [randn(*_spatial(2))])
    add("Upsample-trilinear", _mlp(nn.Upsample, scale_factor=2, mode="trilinear"), [randn(*_spatial(3))])
    add("UpsamplingBilinear2d", _mlp(nn.UpsamplingBilinear2d, scale_factor=2), [randn(*_spatial(2))])
    add("UpsamplingNearest2d", _mlp(nn.UpsamplingNearest2d, scale_factor=2), [randn(*_spatial(2))])
    add("CosineSimilarity", _mlp(nn.CosineSimilarity), [randn(N, 5), randn(N, 5)])
    add("PairwiseDistance", _mlp(nn.PairwiseDistance), [randn(N, 5), randn(N, 5)])
    add("Sequential", lambda: nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)), [randn(N, 5)])
    add("DataParallel", lambda: nn.DataParallel(nn.Linear(5, 4)), [randn(N, 5)])

    # norms
    add("LayerNorm", _mlp(nn.LayerNorm, 5), [randn(N, 5)])
    add("LayerNorm-no-affine", _mlp(nn.LayerNorm, 5, elementwise_affine=False), [randn(N, 2, 5)])
    add("RMSNorm", _mlp(nn.RMSNorm, 5), [randn(N, 5)])
    add("GroupNorm", _mlp(nn.GroupNorm, 2, 4), [randn(N, 4, 3)])
    add("LocalResponseNorm", _mlp(nn.LocalResponseNorm, 2), [randn(*_spatial(2, c=4))])
    add("CrossMapLRN2d", _mlp(nn.CrossMapLRN2d, 3), [randn(*_spatial(2, c=4))])
    add("SyncBatchNorm", _mlp(nn.SyncBatchNorm, 2), [randn(*_spatial(2))])

    # recurrent: proj_size, bidirectional, layers and cells take different ATen paths
    L, H = 4, 5
    for kind in ("RNN", "GRU", "LSTM"):
        cls = getattr(nn, kind)
        add(kind, _mlp(cls, 3, H), [randn(L, N, 3)])
        add(f"{kind}-2layer-bidir-batch_first", _mlp(cls, 3, H, num_layers=2, bidirectional=True, batch_first=True),
            [randn(N, L, 3)])
        add(f"{kind}-h0", _mlp(cls, 3, H),
            [randn(L, N, 3)] + ([In(lambda g: (torch.randn(1, N, H, generator=g), torch.randn(1, N, H, generator=g)))]
                                if kind == "LSTM" else [randn(1, N, H)]))
        add(f"{kind}Cell", _mlp(getattr(nn, f"{kind}Cell"), 3, H), [randn(N, 3)])
        add(f"{kind}Cell-hx", _mlp(getattr(nn, f"{kind}Cell"), 3, H),
            [randn(N, 3)] + ([In(lambda g: (torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)))]
                             if kind == "LSTM" else [randn(N, H)]))
    add("RNN-relu", _mlp(nn.RNN, 3, H, nonlinearity="relu"), [randn(L, N, 3)])
    add("LSTM-proj", _mlp(nn.LSTM, 3, H, proj_size=2), [randn(L, N, 3)])
    add("LSTM-proj-2layer-bidir", _mlp(nn.LSTM, 3, H, proj_size=2, num_layers=2, bidirectional=True),
        [randn(L, N, 3)])

    # attention and transformers (dropout 0.1: the RNG must replay identically)
    E = 8
    add("MultiheadAttention", _mlp(nn.MultiheadAttention, E, 2), [randn(L, N, E), randn(L, N, E), randn(L, N, E)])
    add("MultiheadAttention-kdim-batch_first", _mlp(nn.MultiheadAttention, E, 2, kdim=4, vdim=6, batch_first=True,
                                                    dropout=0.1),
        [randn(N, L, E), randn(N, L + 1, 4), randn(N, L + 1, 6)])
    add("TransformerEncoderLayer", _mlp(nn.TransformerEncoderLayer, E, 2, 16, dropout=0.1), [randn(L, N, E)])
    add("TransformerEncoderLayer-norm_first-gelu", _mlp(nn.TransformerEncoderLayer, E, 2, 16, dropout=0.0,
                                                        norm_first=True, activation="gelu", batch_first=True),
        [randn(N, L, E)])
    add("TransformerDecoderLayer", _mlp(nn.TransformerDecoderLayer, E, 2, 16, dropout=0.1),
        [randn(L, N, E), randn(L + 1, N, E)])
    add("TransformerEncoder", lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(E, 2, 16, dropout=0.1), 2,
                                                            enable_nested_tensor=False), [randn(L, N, E)])
    add("TransformerDecoder", lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(E, 2, 16, dropout=0.1), 2),
        [randn(L, N, E), randn(L + 1, N, E)])
    add("Transformer", _mlp(nn.Transformer, E, 2, 1, 1, 16, dropout=0.1), [randn(L, N, E), randn(L + 1, N, E)])

    # losses: prediction scaled by a parameter; targets constant
    C = 4
    add("L1Loss", _mlp(nn.L1Loss), [randn(N, C), uniform(N, C)])
    add("MSELoss", _mlp(nn.MSELoss), [randn(N, C), uniform(N, C)])
    add("HuberLoss", _mlp(nn.HuberLoss, delta=0.5), [randn(N, C), uniform(N, C)])
    add("SmoothL1Loss", _mlp(nn.SmoothL1Loss), [randn(N, C), uniform(N, C)])
    add("BCELoss", _mlp(nn.BCELoss), [randn(N, C), uniform(N, C)], pre=torch.sigmoid)
    add("BCEWithLogitsLoss", _mlp(nn.BCEWithLogitsLoss, pos_weight=torch.full((C,), 2.0)),
        [randn(N, C), uniform(N, C)])
    add("CrossEntropyLoss", _mlp(nn.CrossEntropyLoss), [randn(N, C), randint(C, N)])
    add("CrossEntropyLoss-smoothing-ignore", _mlp(nn.CrossEntropyLoss, label_smoothing=0.1, ignore_index=1),
        [randn(N, C, 2), randint(C, N, 2)])
    add("CrossEntropyLoss-probs", _mlp(nn.CrossEntropyLoss), [randn(N, C), const(lambda g: torch.softmax(
        torch.randn(N, C, generator=g), 1))])
    add("NLLLoss", _mlp(nn.NLLLoss), [randn(N, C), randint(C, N)], pre=lambda x: F.log_softmax(x, 1))
    add("NLLLoss2d", _mlp(nn.NLLLoss2d), [randn(N, C, 2, 2), randint(C, N, 2, 2)], pre=lambda x: F.log_softmax(x, 1))
    add("KLDivLoss", _mlp(nn.KLDivLoss, reduction="batchmean"), [randn(N, C), const(lambda g: torch.softmax(
        torch.randn(N, C, generator=g), 1))], pre=lambda x: F.log_softmax(x, 1))
    add("PoissonNLLLoss", _mlp(nn.PoissonNLLLoss), [randn(N, C), uniform(N, C)])
    add("GaussianNLLLoss", _mlp(nn.GaussianNLLLoss), [randn(N, C), uniform(N, C), randn(N, C, positive=True)])
    add("HingeEmbeddingLoss", _mlp(nn.HingeEmbeddingLoss), [randn(N, C), sign(N, C)])
    add("SoftMarginLoss", _mlp(nn.SoftMarginLoss), [randn(N, C), sign(N, C)])
    add("MultiLabelSoftMarginLoss", _mlp(nn.MultiLabelSoftMarginLoss), [randn(N, C), uniform(N, C)])
    add("MultiLabelMarginLoss", _mlp(nn.MultiLabelMarginLoss), [randn(N, C), const(
        lambda g: torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1], [0, -1, 2, 1]]))])
    add("MultiMarginLoss", _mlp(nn.MultiMarginLoss), [randn(N, C), randint(C, N)])
    add("MarginRankingLoss", _mlp(nn.MarginRankingLoss, 0.1), [randn(N), randn(N), sign(N)])
    add("CosineEmbeddingLoss", _mlp(nn.CosineEmbeddingLoss), [randn(N, C), randn(N, C), sign(N)])
    add("TripletMarginLoss", _mlp(nn.TripletMarginLoss), [randn(N, C), randn(N, C), randn(N, C)])
    add("TripletMarginWithDistanceLoss", _mlp(nn.TripletMarginWithDistanceLoss),
        [randn(N, C), randn(N, C), randn(N, C)])
    add("CTCLoss", _mlp(nn.CTCLoss), [randn(6, N, 5), const(lambda g: torch.randint(1, 5, (N, 3), generator=g)),
                                      const(lambda g: torch.full((N,), 6)), const(lambda g: torch.tensor([3, 2, 1]))],
        pre=lambda x: F.log_softmax(x, 2), fixed_inputs=True)
    # which clusters the targets fall in decides which tensors are saved: the same targets every step
    add("AdaptiveLogSoftmaxWithLoss", _mlp(nn.AdaptiveLogSoftmaxWithLoss, 8, 10, [4, 8], div_value=2.0),
        [randn(N, 8), const(lambda g: torch.tensor([1, 5, 9]))], fixed_inputs=True)
    # div_value 4 makes the second tail's hidden layer Linear(8, 0): zero features
    add("AdaptiveLogSoftmaxWithLoss-empty-tail", _mlp(nn.AdaptiveLogSoftmaxWithLoss, 8, 10, [4, 8]),
        [randn(N, 8), const(lambda g: torch.tensor([1, 5, 9]))], fixed_inputs=True)
    if hasattr(nn, "LinearCrossEntropyLoss"):
        add("LinearCrossEntropyLoss", _linear_ce, [randn(N, 5), randint(C, N)])
    return z


def _linear_ce():
    return nn.LinearCrossEntropyLoss(5, 4, bias=True)


# Classes with no forward of their own to train: containers and abstract bases (their contents are
# covered under their own names; Sequential and DataParallel are in the zoo).
NOT_TRAINABLE = {
    "Module": "abstract base: no forward",
    "Container": "deprecated abstract container: no forward",
    "ModuleDict": "container: no forward",
    "ModuleList": "container: no forward",
    "ParameterDict": "container: no forward",
    "ParameterList": "container: no forward",
    "RNNCellBase": "abstract base of RNNCell/GRUCell/LSTMCell: no forward",
    "RNNBase": "base of RNN/GRU/LSTM (each in the zoo): no forward of its own",
}


def class_name(variant: str) -> str:
    case = ZOO[variant]
    return case.cls or variant.split("-")[0]


def torch_nn_module_classes():
    """Every public nn.Module subclass that torch.nn exports, by name."""
    return sorted(n for n in dir(nn) if not n.startswith("_") and inspect.isclass(getattr(nn, n))
                  and issubclass(getattr(nn, n), nn.Module))


ZOO = _zoo()
