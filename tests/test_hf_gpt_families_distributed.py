"""GPT-style families (attention in ``attn`` / ``attention`` modules), EXAONE 4 and Gemma 4 on gloo
ranks: greedy generation through the engine at pcp2 x dcp2 equals HF ``generate`` on one
process, and the gradients of a ragged training batch at pcp2 equal the same model's on one
process.

GPT-2 (learned absolute positions, scaling by the inverse layer index), GPTBigCode (multi-query:
one KV head, which only its module says), GPT-NeoX (partial rotary) and EXAONE 4 (a window of 3
keys on its sliding layer and, on its full layer, no rope; the module keeps the config's window
on both layers), Gemma 4 (its last two layers attend with the K/V of the first two, so one
layer's local K/V feed two context-parallel attentions, forward and backward) and Qwen2.5-VL's
language model (text only, multimodal rope on 1-D positions). Prompts are longer than the window and than one step's token budget.
"""

from __future__ import annotations

import pytest

# The ragged training batch and loss of the HF engine tests (gradients summed over PCP).
from test_hf_engine_distributed import _train_grads

from cp_modules.testing import hf_greedy_tokens, run_distributed

pytestmark = pytest.mark.distributed

PROMPT_LENS = (11, 5, 8)
MAX_NEW_TOKENS = 5
FAMILIES = ("gpt2", "gpt_bigcode", "gpt_neox", "exaone4", "gemma4", "qwen2_5_vl")


def _model(family: str, dtype: str = "float32"):
    import torch

    from cp_modules.modules.hf_families import build_tiny

    if family == "gemma4":  # K/V-shared layers: one layer's local K/V feed two cp attentions
        import transformers as tf
        from test_hf_more_families import GEMMA4

        torch.manual_seed(3)
        config = tf.Gemma4TextConfig(**{**GEMMA4, "sliding_window": 3})
        return tf.Gemma4ForCausalLM(config).to(getattr(torch, dtype)).eval()
    if family == "qwen2_5_vl":  # the language model of a multimodal model, text only
        from test_hf_more_families import _multimodal

        return _multimodal("qwen2_5_vl").to(getattr(torch, dtype))
    extra = {"sliding_window": 3} if family == "exaone4" else {}
    return build_tiny(family, seed=3, dtype=getattr(torch, dtype), **extra)


def _prompts(lens=PROMPT_LENS, seed=11) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _hf_generate(family: str) -> list[list[int]]:
    return hf_greedy_tokens(_model(family), _prompts(), MAX_NEW_TOKENS)


def _rank_body(rank: int, world_size: int, families):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention
    from cp_modules.step import CPRuntime

    out = {}
    config = ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2)
    groups = init_cp_groups(config)
    for family in families:
        model = swap_attention(_model(family), groups)
        engine = GenerationEngine(model, groups, block_size=4, max_num_tokens=8, progress=False)
        tokens = engine.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
        model = swap_attention(_model(family, "float64"), groups)
        grads = _train_grads(model, groups, CPRuntime.from_groups(groups))
        out[family] = (tokens.outputs, grads)
    return out


def test_gpt_style_and_exaone4_models_generate_like_hf_and_train_like_one_process_at_pcp2():
    import torch

    from cp_modules.modules.hf_swap import swap_attention
    from cp_modules.step import CPRuntime

    results = run_distributed(_rank_body, 2, FAMILIES, timeout_s=900)
    for family in FAMILIES:
        want_tokens = _hf_generate(family)
        want_grads = _train_grads(
            swap_attention(_model(family, "float64")), None, CPRuntime.single()
        )
        for rank, per_rank in enumerate(results):
            tokens, grads = per_rank[family]
            assert tokens == want_tokens, (family, rank, tokens, want_tokens)
            assert grads.keys() == want_grads.keys()
            # The loss reaches the language model's parameters (Gemma 4's shared layers have
            # unused k/v; a vision tower sees no image).
            text = [g for n, g in want_grads.items() if "visual" not in n]
            reached = sum(bool(abs(g).sum() > 0) for g in text)
            assert reached >= 0.75 * len(text), (family, reached, len(text))
            for n, g in want_grads.items():
                # Gemma 4 computes q/k/v and its norms in float32 whatever the model's dtype
                # (.float()), so its float64 gradients agree to float32 accuracy: relative to
                # each tensor's scale (measured: 6e-8 of its largest entry at most).
                tol = {}
                if family == "gemma4":
                    tol = dict(rtol=1.3e-6, atol=1e-6 * float(abs(g).max()))
                torch.testing.assert_close(
                    torch.from_numpy(grads[n]), torch.from_numpy(g), **tol,
                    msg=f"{family} rank {rank} {n}",
                )  # fmt: skip


def _swap_at_tp2(rank: int, world_size: int, families):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules.hf_swap import swap_attention

    groups = init_cp_groups(ParallelConfig(tensor_parallel_size=2))
    out = {}
    for family in families:
        try:
            swap_attention(_model(family), groups)
            out[family] = None
        except ValueError as e:
            out[family] = str(e)
    return out


def test_gpt_style_models_are_refused_at_tp2_on_every_rank():
    # Their fused or renamed projections (c_attn, query_key_value, qkv_proj + out_proj) are not
    # in a TP plan cp follows (CodeGen's fused qkv is not even laid out by heads).
    families = ("gpt2", "gpt_bigcode", "gpt_neox", "gptj", "codegen")
    results = run_distributed(_swap_at_tp2, 2, families, timeout_s=300)
    for family in families:
        for rank, per_rank in enumerate(results):
            msg = per_rank[family]
            assert msg is not None and "TP plan does not say how to shard" in msg, (family, rank)


def _sub_norm_llama():
    """Llama whose MLPs normalise the intermediate features (as BitNet's ffn_sub_norm does):
    column-wise sharding would normalise each rank's slice."""
    import torch
    from torch import nn

    from cp_modules.modules.hf_families import build_tiny

    model = build_tiny("llama", seed=4)
    torch.manual_seed(5)
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.__class__ = type("SubNormMLP", (type(mlp),), {"forward": _sub_norm_forward})
        mlp.sub_norm = nn.RMSNorm(mlp.gate_proj.out_features, eps=1e-6)
        nn.init.normal_(mlp.sub_norm.weight, 1.0, 0.5)
    return model.eval()


def _sub_norm_forward(self, x):
    return self.down_proj(self.sub_norm(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def _sub_norm_at_tp2(rank: int, world_size: int):
    import warnings

    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    groups = init_cp_groups(ParallelConfig(tensor_parallel_size=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = swap_attention(_sub_norm_llama(), groups)
    engine = GenerationEngine(model, groups, block_size=4, max_num_tokens=8, progress=False)
    out = engine.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW_TOKENS)).outputs
    return out, [str(w.message) for w in caught]


def test_an_mlp_tp_cannot_shard_exactly_stays_replicated_and_generation_is_exact():

    want = hf_greedy_tokens(_sub_norm_llama(), _prompts(), MAX_NEW_TOKENS)
    for rank, (got, messages) in enumerate(run_distributed(_sub_norm_at_tp2, 2, timeout_s=300)):
        assert got == want, (rank, got, want)
        assert any("MLPs kept replicated" in m and "model.layers.0.mlp" in m for m in messages)


def _checkpointed_grads(rank: int, world_size: int, cases):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules.hf_swap import swap_attention
    from cp_modules.step import CPRuntime

    groups = init_cp_groups(ParallelConfig(prefill_context_parallel_size=2))
    out = {}
    for family, reentrant in cases:
        model = swap_attention(_model(family, "float64"), groups)
        # HF's own switch: its replay in the backward runs after the step's forward has ended.
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        out[family, reentrant] = _train_grads(model, groups, CPRuntime.from_groups(groups))
    return out


def test_hf_gradient_checkpointing_trains_like_one_process_at_pcp2():
    import torch

    from cp_modules.modules.hf_swap import swap_attention
    from cp_modules.step import CPRuntime

    cases = [("gpt_neox", False), ("gpt_neox", True), ("exaone4", False)]
    results = run_distributed(_checkpointed_grads, 2, cases, timeout_s=300)
    for family, reentrant in cases:
        # One process, no checkpointing.
        want = _train_grads(swap_attention(_model(family, "float64")), None, CPRuntime.single())
        for rank, per_rank in enumerate(results):
            got = per_rank[family, reentrant]
            assert got.keys() == want.keys()
            for n, g in want.items():
                torch.testing.assert_close(
                    torch.from_numpy(got[n]), torch.from_numpy(g),
                    msg=f"{family} reentrant={reentrant} rank {rank} {n}",
                )  # fmt: skip
