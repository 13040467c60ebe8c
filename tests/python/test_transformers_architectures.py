"""Never a wrong gradient, on Hugging Face architectures: tiny models built from transformers configs
(no download, no weights) train three AdamW steps plainly and under memsched from the same weights,
inputs and RNG seed, and end with bitwise equal parameters.

Each model has its dropout on (0.1), so a recompute that replayed another random mask, or an offload
that moved the RNG, changes the result. The architectures take different paths through memsched:
Llama (rotary embeddings, grouped-query attention, a padded batch), BERT (masked LM, padding mask),
T5 (encoder-decoder, relative position bias, tied embeddings), Mixtral and Qwen2-MoE (mixture of
experts: routing, grouped_mm, a shared expert) and ViT (patch Conv2d). The configurations are the informative ones of the wider sweep
(scratch harness, 40 architectures x 13 configurations, all bitwise equal):

- hybrid planned for copies that take seconds (device_helpers.slow_copies), so it recomputes wherever
  it can: every dropout mask is replayed (Note [Unpack-time recompute]); also under bf16 autocast,
  with an evaluation forward under no_grad between steps (Note [Forwards that save nothing]), and
  with two micro-batches per step;
- offload_all_prefetch: every saved activation goes through the offload pack/unpack path; also with
  Hugging Face gradient checkpointing (non-reentrant) on;
- ooo with the fused AdamW update (fuse_optimizer=True).

Every planned step must run the plan: offload_all offloads, the hybrid plan's recomputes are all
recomputed (none kept) -- a plain fallback would pass the gradient check without testing anything.
"""
import contextlib
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import memsched  # noqa: E402
from device_helpers import slow_copies  # noqa: E402

STEPS = 3
B, S, V = 2, 16, 96


def _tokens(step, pad=False, mlm=False):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, V, (B, S), generator=g)
    d = {"input_ids": ids}
    labels = ids.clone()
    if pad:  # the second row is padded: the attention takes its masked path in every step
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, S - 5:] = 0
        ids[1, S - 5:] = 0
        d["attention_mask"] = mask
        labels[mask == 0] = -100
    if mlm:
        labels[:, ::2] = -100
    d["labels"] = labels
    return d


def _seq2seq(step):
    d = _tokens(step, pad=True)
    d["labels"] = torch.randint(3, V, (B, 10), generator=torch.Generator().manual_seed(200 + step))
    return d


def _images(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (B,), generator=g)}


T = transformers
ARCHITECTURES = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)),
        lambda s: _tokens(s, pad=True)),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
        lambda s: _tokens(s, pad=True, mlm=True)),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)),
        _seq2seq),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        attention_dropout=0.1, output_router_logits=True, router_aux_loss_coef=0.01)),
        _tokens),
    "qwen2moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, attention_dropout=0.1, output_router_logits=True, decoder_sparse_step=1)),
        _tokens),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=5)),
        _images),
}

# name -> (optimize() keyword arguments, loop variant)
CONFIGS = {
    "hybrid-recompute": (dict(budget=0.3, planner="hybrid", device_model="slow-copies"), ""),
    "hybrid-recompute-bf16": (dict(budget=0.3, planner="hybrid", device_model="slow-copies"), "bf16"),
    "hybrid-recompute-eval": (dict(budget=0.3, planner="hybrid", device_model="slow-copies"), "eval"),
    "hybrid-recompute-accumulate2": (dict(budget=0.3, planner="hybrid", device_model="slow-copies"), "accumulate2"),
    "offload_all_prefetch": (dict(budget="1GiB", planner="offload_all_prefetch"), ""),
    "offload_all_prefetch-checkpointed": (dict(budget="1GiB", planner="offload_all_prefetch"), "checkpoint"),
    "ooo-fused": (dict(budget=0.5, planner="dp", ooo=True, fuse_optimizer=True), ""),
    # deferral under autocast begins at the profiled step's second micro-batch: that profile is dropped too
    "ooo-bf16-accumulate2": (dict(budget=0.7, planner="dp", ooo=True, grad_accumulation_steps=2), "bf16-accumulate2"),
}

CASES = [(a, c) for a in ARCHITECTURES for c in ("hybrid-recompute", "offload_all_prefetch", "ooo-fused")]
CASES += [("llama", "hybrid-recompute-bf16"), ("t5", "hybrid-recompute-bf16"),
          ("llama", "hybrid-recompute-eval"), ("bert", "hybrid-recompute-accumulate2"),
          ("llama", "offload_all_prefetch-checkpointed"), ("llama", "ooo-bf16-accumulate2")]

_BASE = {}


def _build(arch):
    if arch not in _BASE:
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        _BASE[arch] = ARCHITECTURES[arch][0]()
    model = copy.deepcopy(_BASE[arch])
    model.train()
    return model, ARCHITECTURES[arch][1], torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(arch, variant, kwargs=None):
    model, inputs, opt = _build(arch)
    if variant == "checkpoint":  # the checkpointed layers' saves are torch.utils.checkpoint's, the rest memsched's
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the other is deprecated there)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    accumulate = 2 if "accumulate2" in variant else 1
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if "bf16" in variant else contextlib.nullcontext
    if kwargs is not None and kwargs.get("device_model") == "slow-copies":
        kwargs = dict(kwargs, device_model=slow_copies())
    torch.manual_seed(1)
    with (memsched.optimize(model, optimizer=opt, **kwargs) if kwargs is not None
          else contextlib.nullcontext()) as run:
        for step in range(STEPS):
            if variant == "eval" and step in (0, 2):  # an evaluation under no_grad before the step's forward
                model.eval()
                with torch.no_grad():
                    model(**inputs(50 + step))
                model.train()
            for micro in range(accumulate):
                with autocast():
                    loss = model(**inputs(accumulate * step + micro)).loss
                (loss / accumulate).backward()
            if run is not None:
                run.step()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return model, run


_PLAIN = {}


def _plain(arch, variant):
    if (arch, variant) not in _PLAIN:
        model, _ = _train(arch, variant)
        _PLAIN[arch, variant] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _PLAIN[arch, variant]


@pytest.mark.parametrize("arch,config", CASES)
def test_architecture_trains_bitwise_as_plain(arch, config):
    kwargs, variant = CONFIGS[config]
    want = _plain(arch, variant)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # memsched warns when a step falls back to plain
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="transformers")
        model, run = _train(arch, variant, kwargs)
    got = model.state_dict()
    diff = [k for k in want if not torch.equal(got[k], want[k])]
    assert not diff, (f"{arch} under {config}: {len(diff)} tensors differ from plain PyTorch after {STEPS} "
                      f"AdamW steps, e.g. {diff[:3]}")
    executed = list(run.step_stats)
    # ooo under autocast profiles again the step after deferral began (Note [Deferred calls under autocast])
    profiled = 2 if kwargs.get("ooo") and "bf16" in variant else 1
    assert run.steps_profiled == profiled and run.mismatches == 0, run.report()
    assert len(executed) == STEPS - profiled and all(s.mode == "planned" for s in executed), \
        [(s.mode, s.mismatch) for s in executed]
    if kwargs["planner"] == "offload_all_prefetch":
        assert all(s.offloaded > 0 for s in executed)
    if kwargs["planner"] == "hybrid":
        assert run.schedule.recompute, f"{arch}: the hybrid plan recomputes nothing"
        for s in executed:
            assert s.recomputed == len(run.schedule.recompute) and s.recompute_kept == 0, \
                (s.recomputed, len(run.schedule.recompute), s.recompute_kept_reasons)
