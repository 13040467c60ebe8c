"""models.py -- small built-in example models for the CLI, tests and benchmarks.

Entry points:
  build_model(name, size="small"|"realistic", *, device="cpu", seed=0)
  example_batch(name, batch, size="small", *, device="cpu", seed=0) -> (inputs, targets)
  make_step_fn(model, name, batch, size="small", *, device="cpu", seed=0) -> step()
  MODEL_NAMES: "mlp", "cnn", "transformer", "lstm".

"small" models profile in well under a second and their numbers can be
checked by hand; "realistic" ones are what the planner benchmarks use on a
CPU (each profiles in a few seconds on a 2-core machine). A step is
forward + loss + backward; it first drops the parameters' .grad so every
call is the same step (no accumulation across calls).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAMES = ("mlp", "cnn", "transformer", "lstm")
SIZES = ("small", "realistic")


@dataclass(frozen=True)
class _MlpCfg:
    in_features: int      # input width
    hidden: int           # hidden width
    layers: int           # hidden layers
    classes: int          # output width


@dataclass(frozen=True)
class _CnnCfg:
    channels: Tuple[int, ...]  # output channels per Conv+BN+ReLU+pool block
    image: int                 # input height = width, pixels
    classes: int


@dataclass(frozen=True)
class _TransformerCfg:
    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int                   # tokens per sequence


@dataclass(frozen=True)
class _LstmCfg:
    vocab: int
    embed: int
    hidden: int
    layers: int
    seq: int


_CONFIGS: Dict[Tuple[str, str], object] = {
    ("mlp", "small"): _MlpCfg(32, 64, 2, 10),
    ("mlp", "realistic"): _MlpCfg(1024, 2048, 4, 1000),
    ("cnn", "small"): _CnnCfg((8, 16), 16, 10),
    ("cnn", "realistic"): _CnnCfg((32, 64, 128), 32, 100),
    ("transformer", "small"): _TransformerCfg(64, 32, 2, 2, 16),
    ("transformer", "realistic"): _TransformerCfg(2048, 256, 4, 4, 128),
    ("lstm", "small"): _LstmCfg(32, 16, 32, 1, 8),
    ("lstm", "realistic"): _LstmCfg(2048, 256, 512, 2, 64),
}


def _config(name: str, size: str):
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model '{name}'; expected one of {', '.join(MODEL_NAMES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size '{size}' for model '{name}'; expected 'small' or 'realistic'")
    return _CONFIGS[(name, size)]


class Mlp(nn.Module):
    """Linear+ReLU blocks, then a Linear classifier."""

    def __init__(self, cfg: _MlpCfg):
        super().__init__()
        widths = [cfg.in_features] + [cfg.hidden] * cfg.layers
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])])
        self.head = nn.Linear(widths[-1], cfg.classes)

    def forward(self, x):
        return self.head(self.layers(x))


class Cnn(nn.Module):
    """(Conv3x3 + BatchNorm + ReLU + MaxPool2) blocks, then a Linear classifier."""

    def __init__(self, cfg: _CnnCfg):
        super().__init__()
        blocks, c_in = [], 3
        for c in cfg.channels:
            blocks.append(nn.Sequential(nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                        nn.ReLU(), nn.MaxPool2d(2)))
            c_in = c
        self.blocks = nn.Sequential(*blocks)
        side = cfg.image // (2 ** len(cfg.channels))
        self.head = nn.Linear(c_in * side * side, cfg.classes)

    def forward(self, x):
        return self.head(self.blocks(x).flatten(1))


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention written out (q k^T, mask, softmax, @ v)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        return self.proj(y)


class Block(nn.Module):
    """Pre-LayerNorm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x)) with GELU."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Decoder-only language model; the unembedding shares the embedding weight."""

    def __init__(self, cfg: _TransformerCfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.unembed.weight = self.tok.weight  # tied

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


class Lstm(nn.Module):
    """Embedding, a (multi-layer) LSTM, a Linear over every time step."""

    def __init__(self, cfg: _LstmCfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.embed)
        self.lstm = nn.LSTM(cfg.embed, cfg.hidden, num_layers=cfg.layers, batch_first=True)
        self.head = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, idx):
        out, _ = self.lstm(self.embed(idx))
        return self.head(out)


_BUILDERS = {"mlp": Mlp, "cnn": Cnn, "transformer": Transformer, "lstm": Lstm}


def build_model(name: str, size: str = "small", *, device="cpu", seed: int = 0) -> nn.Module:
    """A freshly initialised example model (deterministic for a given seed)."""
    cfg = _config(name, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[name](cfg)
    return model.to(device)


def example_batch(name: str, batch: int, size: str = "small", *, device="cpu", seed: int = 0):
    """(inputs, targets) for one step of `name`; deterministic for a given seed."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    cfg = _config(name, size)
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        x = torch.randn(batch, cfg.in_features, generator=g)
        y = torch.randint(0, cfg.classes, (batch,), generator=g)
    elif name == "cnn":
        x = torch.randn(batch, 3, cfg.image, cfg.image, generator=g)
        y = torch.randint(0, cfg.classes, (batch,), generator=g)
    else:
        tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return x.to(device), y.to(device)


def loss_fn(name: str, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 3:  # sequence models: one prediction per position
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return F.cross_entropy(logits, targets)


def make_step_fn(model: nn.Module, name: str, batch: int, size: str = "small", *, device="cpu",
                 seed: int = 0) -> Callable[[], torch.Tensor]:
    """step() drops .grad, runs forward + loss + backward on a fixed batch, returns the loss (detached)."""
    x, y = example_batch(name, batch, size, device=device, seed=seed)

    def step():
        for p in model.parameters():
            p.grad = None
        loss = loss_fn(name, model(x), y)
        loss.backward()
        return loss.detach()

    return step
