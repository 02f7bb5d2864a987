"""swap_attention on one process: the model's own forward through the ``cp`` attention
interface gives the original model's logits; what cp cannot serve is refused.

Families (tiny configs, seeded weights, fp32): Llama (also llama3 rope scaling and q/k/v/o
biases), Qwen2 (also yarn), Qwen3 and Qwen3-MoE (q/k norms), Mistral (no window), Mixtral,
Gemma, Granite (multipliers), OLMo2 (full-width q/k norms), Phi-3 (fused qkv_proj), GLM-4 and
StableLM (partial rotary), Cohere (interleaved rope, logit scale), EXAONE 4 (a windowed and a
full layer), GPT-2, GPTBigCode (multi-query), GPT-J, CodeGen and GPT-NeoX (attention modules
named ``attn`` / ``attention``), DeepSeek-V2/V3 (MLA, module swap). The swapped model is fed a ragged batch of prompts flattened into one row
(``input_ids [1, T]``, ``position_ids`` = the step's positions) and its logits, restored to
batch order, are compared with the original model run prompt by prompt; then the same with a
paged KV cache, the prompts prefilled in two chunks (the second attends the cached first).
"""

from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch

from cp_modules.config import ParallelConfig
from cp_modules.modules import (
    CPMLAAttention,
    CPRuntime,
    build_step_metadata,
    cp_step,
    restore_tokens,
)
from cp_modules.modules.hf_attention import cp_attention_forward
from cp_modules.modules.hf_families import FAMILIES, build_tiny, tiny_config
from cp_modules.modules.hf_swap import (
    CP_ATTN_IMPLEMENTATION,
    HFCPMLAAttention,
    allocate_kv_caches,
    cp_attention_layers,
    free_kv_caches,
    kv_cache_tensors,
    swap_attention,
)

LENS = [13, 1, 6]
VARIANTS = {
    **{f: {} for f in FAMILIES},
    "llama_bias": {"attention_bias": True, "num_key_value_heads": 4},
    "cohere_qk_norm": {"use_qk_norm": True},
    "stablelm_qk_norm": {"qk_layernorm": True},
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _build(variant: str):
    family = variant if variant in FAMILIES else variant.rsplit("_", 2)[0]
    return build_tiny(family, **VARIANTS[variant])


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g) for n in LENS]


def _original_logits(model, prompts):
    with torch.no_grad():
        return [model(input_ids=p[None]).logits[0] for p in prompts]


def _run_step(model, prompts, starts, ends, block_table=None, **kw):
    """Logits [N, V] of prompt tokens [start, end) of each request, in batch order."""
    rt = CPRuntime.single()
    meta = build_step_metadata(
        rt, [e - s for s, e in zip(starts, ends)], starts, block_table=block_table, block_size=4
    )
    flat = torch.cat([p[s:e] for p, s, e in zip(prompts, starts, ends)])
    with torch.no_grad(), cp_step(meta):
        logits = model(
            input_ids=flat[meta.token_indices][None],
            position_ids=meta.positions[None],
            use_cache=False,
            **kw,
        ).logits
        return restore_tokens(logits[0], meta)


def _check_over_the_paged_cache(model, prompts, want):
    """Prefill the first part of each prompt into the paged cache, then the rest over the
    cached prefix (the one-token remainder decodes, the others continue in chunked prefill):
    the logits of the rest equal ``want``'s."""
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    split = [n // 2 for n in LENS]
    split[1] = 1  # the one-token prompt is done in the first step
    _run_step(model, prompts, [0, 0, 0], split, table)
    rest = [i for i, (s, n) in enumerate(zip(split, LENS)) if s < n]
    got = _run_step(
        model,
        [prompts[i] for i in rest],
        [split[i] for i in rest],
        [LENS[i] for i in rest],
        table[rest],
    )
    torch.testing.assert_close(got, torch.cat([want[i][split[i] :] for i in rest]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_the_original_model_with_and_without_a_paged_cache(variant):
    prompts = _prompts()
    original = _build(variant)
    want = _original_logits(original, prompts)
    names = list(original.state_dict())

    model = _build(variant)
    modules = dict(model.named_modules())
    swap_attention(model)
    layers = cp_attention_layers(model)
    assert len(layers) == 2
    mla = variant.startswith("deepseek")
    if mla:
        assert all(isinstance(m, HFCPMLAAttention) for m in layers)
    else:  # the model's own modules, bound to the interface: nothing replaced
        assert all(
            not isinstance(m, CPMLAAttention) and m is modules[m.cp_binding.layer_name]
            for m in layers
        )
        assert [m.cp_binding.layer_idx for m in layers] == [0, 1]
    assert model.config._attn_implementation == CP_ATTN_IMPLEMENTATION
    assert list(model.state_dict()) == names  # same parameter names: checkpoints load as they are

    got = _run_step(model, prompts, [0] * len(prompts), [len(p) for p in prompts])
    torch.testing.assert_close(got, torch.cat(want))

    allocate_kv_caches(model, 16, 4, dtype=torch.float32)
    assert len(kv_cache_tensors(model)) == (2 if mla else 4)
    _check_over_the_paged_cache(model, prompts, want)
    free_kv_caches(model)
    assert kv_cache_tensors(model) == []


def test_swap_keeps_the_weights_themselves():
    model = _build("qwen3")
    attn = model.model.layers[0].self_attn
    q, norm = attn.q_proj, attn.q_norm
    swap_attention(model)
    assert model.model.layers[0].self_attn is attn and attn.q_proj is q and attn.q_norm is norm
    mla = _build("deepseek_v3")
    kv_b = mla.model.layers[1].self_attn.kv_b_proj
    swap_attention(mla)
    assert mla.model.layers[1].self_attn.kv_b_proj is kv_b
    assert mla.model.layers[1].self_attn.rope_interleave


def test_swap_is_idempotent():
    model = swap_attention(_build("llama"))
    layers = cp_attention_layers(model)
    bindings = [m.cp_binding for m in layers]
    swap_attention(model)
    assert cp_attention_layers(model) == layers and [m.cp_binding for m in layers] == bindings


def _forward(model, **kw):
    meta = build_step_metadata(CPRuntime.single(), [5, 3])
    with cp_step(meta):
        return model(
            input_ids=torch.arange(8)[meta.token_indices][None],
            position_ids=meta.positions[None],
            **{"use_cache": False, **kw},
        )


def _noncausal():
    config = tiny_config("llama")
    config.is_causal = False
    return build_tiny("llama", config=config)


def _gemma2(**kw):
    import transformers as tf

    config = tf.Gemma2Config(**{**tiny_config("gemma").to_diff_dict(), **kw})
    return tf.Gemma2ForCausalLM(config).eval()


def _gpt_oss(**kw):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        **{"layer_types": ["full_attention"] * 2, **kw},
    )  # fmt: skip
    model = tf.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # sinks start at 0; give them values that matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


# Windows, soft-capping and sinks through the attention interface (CPU reference paths): a
# window of 3 keys is shorter than the prompts, so it changes every logit after the third.
MASKED = {
    "mistral_window": lambda: build_tiny("mistral", sliding_window=3),
    "qwen2_sliding_layers": lambda: build_tiny("qwen2", use_sliding_window=True, sliding_window=3,
                                               max_window_layers=1),
    "gemma2_window_softcap": lambda: _gemma2(sliding_window=3, attn_logit_softcapping=5.0),
    "gpt_oss_sinks_window": lambda: _gpt_oss(layer_types=["sliding_attention", "full_attention"],
                                             sliding_window=3),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(MASKED))
def test_windows_softcap_and_sinks_equal_the_original_model(variant):
    prompts = _prompts()
    original = MASKED[variant]()
    want = _original_logits(original, prompts)
    model = swap_attention(copy.deepcopy(original))
    got = _run_step(model, prompts, [0] * len(prompts), [len(p) for p in prompts])
    torch.testing.assert_close(got, torch.cat(want))
    allocate_kv_caches(model, 16, 4, dtype=torch.float32)
    _check_over_the_paged_cache(model, prompts, want)


REFUSED = {
    # name: (model builder, forward kwargs, training mode, what the message names)
    "non_causal": (
        _noncausal,
        {},
        False,
        ("LlamaForCausalLM", "model.layers.0.self_attn", "non-causal"),
    ),
    "padding_mask": (
        lambda: build_tiny("llama"),
        {"attention_mask": torch.ones(1, 10, dtype=torch.long)},
        False,
        ("LlamaForCausalLM", "model.layers.0.self_attn", "padding attention_mask"),
    ),
    "custom_mask": (
        lambda: build_tiny("llama"),
        {"attention_mask": torch.ones(1, 1, 10, 10, dtype=torch.bool)},
        False,
        ("LlamaForCausalLM", "model.layers.0.self_attn", "explicit attention mask"),
    ),
    "dropout": (
        lambda: build_tiny("qwen3", attention_dropout=0.1),
        {},
        True,
        ("Qwen3ForCausalLM", "model.layers.0.self_attn", "dropout=0.1"),
    ),
}


@pytest.mark.parametrize("feature", sorted(REFUSED))
def test_what_cp_does_not_implement_is_refused(feature):
    build, kw, train, names = REFUSED[feature]
    with pytest.raises(ValueError) as info:
        model = swap_attention(build())
        model.train(train)
        _forward(model, **kw)
    for name in names:
        assert name in str(info.value)


def test_keyword_arguments_are_never_dropped():
    model = swap_attention(_build("llama"))
    attn = model.model.layers[1].self_attn
    q, k = torch.zeros(1, 8, 4, 8), torch.zeros(1, 2, 4, 8)
    for kw, name in [
        ({"sinks": torch.zeros(8)}, "'sinks'"),
        ({"s_aux": torch.zeros(3)}, "sinks of shape (3,)"),
        ({"sliding_window": 4}, "inconsistent sliding windows"),
        ({"is_causal": False}, "is_causal=False"),
        ({"new_feature": 1}, "'new_feature'"),
    ]:
        with pytest.raises(
            ValueError, match="LlamaForCausalLM layer 'model.layers.1.self_attn'"
        ) as info:
            cp_attention_forward(attn, q, k, k, None, scaling=0.3, **kw)
        assert name in str(info.value)
    # Inert arguments (and features switched off) pass the checks; then the op needs a step.
    with pytest.raises(RuntimeError, match="no context-parallel step is active"):
        cp_attention_forward(
            attn,
            q,
            k,
            k,
            None,
            scaling=0.3,
            sliding_window=None,
            softcap=None,
            position_ids=torch.arange(4)[None],
            use_cache=False,
        )
    # Served features pass the checks too.
    with pytest.raises(RuntimeError, match="no context-parallel step is active"):
        cp_attention_forward(attn, q, k, k, None, scaling=0.3, softcap=30.0, s_aux=torch.zeros(8))


def test_attention_outside_the_interface_is_refused():
    class OwnAttention(torch.nn.Module):  # neither the attention interface nor MLA
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = OwnAttention()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tiny_config("llama")
            self.layers = torch.nn.ModuleList([Block()])

    with pytest.raises(
        ValueError, match=r"Model layer 'layers.0.self_attn': OwnAttention does not go through"
    ):
        swap_attention(Model())


def test_attention_modules_the_swap_does_not_know_or_serve_are_refused():
    import transformers as tf

    # BLOOM's `self_attention` (ALiBi, outside the attention interface) is not a module cp knows.
    bloom = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=8))
    with pytest.raises(ValueError, match="BloomForCausalLM has no self-attention modules cp knows"):
        swap_attention(bloom)
    # GPT-2 with cross-attention blocks (`crossattention`, is_cross_attention=True).
    with pytest.raises(
        ValueError, match=r"layer 'transformer.h.0.crossattention': cross-attention"
    ):
        swap_attention(build_tiny("gpt2", add_cross_attention=True))
    # An encoder-decoder (T5: its attention is neither `self_attn` nor causal self-attention).
    t5 = tf.T5ForConditionalGeneration(
        tf.T5Config(vocab_size=256, d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16)
    )
    with pytest.raises(ValueError, match="T5ForConditionalGeneration has no self-attention"):
        swap_attention(t5)

    # A config with neither head counts nor a text model.
    class NoHeads(torch.nn.Module):
        config = types.SimpleNamespace(hidden_size=8)

    with pytest.raises(ValueError, match="NoHeads: its config has no num_attention_heads and no"):
        swap_attention(NoHeads())
    # GPT-2's own configs keep attention dropout on: refused in training, served in eval.
    gpt2 = swap_attention(build_tiny("gpt2", attn_pdrop=0.1))
    _forward(gpt2)
    gpt2.train()
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn'.*dropout=0.1"):
        _forward(gpt2)


def test_multi_query_heads_come_from_the_module():
    model = swap_attention(build_tiny("gpt_bigcode"))
    assert [m.cp_binding.num_kv_heads for m in cp_attention_layers(model)] == [1, 1]
    model = swap_attention(build_tiny("gpt_bigcode", multi_query=False))
    assert [m.cp_binding.num_kv_heads for m in cp_attention_layers(model)] == [8, 8]


def test_exaone4_full_layers_ignore_the_window_their_module_keeps():
    model = swap_attention(build_tiny("exaone4"))
    layers = cp_attention_layers(model)
    assert [m.sliding_window for m in layers] == [4, 4]  # the module keeps it on both layers
    assert [m.cp_binding.sliding_window for m in layers] == [4, None]


def test_swap_rejects_a_layout_that_cannot_serve_the_heads():
    # 2 KV heads, tp=2, pcp=2, dcp=4: a DCP group would span ranks holding different KV heads.
    config = ParallelConfig(
        tensor_parallel_size=2, prefill_context_parallel_size=2, decode_context_parallel_size=4
    )
    with pytest.raises(ValueError, match="KV heads"):
        swap_attention(_build("llama"), config)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        swap_attention(_build("qwen3"), ParallelConfig(tensor_parallel_size=3))


def test_swap_rejects_models_without_attention_and_bad_arguments():
    with pytest.raises(ValueError, match="transformers model"):
        swap_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="ParallelConfig, CPGroups or None"):
        swap_attention(_build("llama"), {"tp": 2})


def test_swapped_attention_takes_one_row_of_tokens_and_no_hf_cache():
    model = swap_attention(_build("llama"))
    meta = build_step_metadata(CPRuntime.single(), [2, 2])
    with (
        torch.no_grad(),
        cp_step(meta),
        pytest.raises(ValueError, match=r"one row of the step's local tokens"),
    ):
        model(
            input_ids=torch.zeros(2, 2, dtype=torch.long),
            position_ids=meta.positions.view(2, 2),
            use_cache=False,
        )
    from transformers import DynamicCache

    # The cache's keyword: ``cache`` in newer transformers, ``past_key_values`` before.
    params = inspect.signature(type(model).forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    cache = {name: DynamicCache(config=model.config)}
    with torch.no_grad():
        _forward(model, use_cache=True, **cache)  # HF fills its own cache
        with pytest.raises(ValueError, match="use_cache=False"):
            _forward(model, use_cache=True, **cache)  # ... and cp refuses to read it


@pytest.mark.parametrize("family", ["llama", "gpt2", "deepseek_v3"])
def test_a_forward_without_the_steps_positions_is_refused(family):
    # HF would number the local tokens 0..T-1 itself: silently wrong under PCP (and for GPT-2's
    # absolute positions, for every request after the first).
    model = swap_attention(build_tiny(family))
    meta = build_step_metadata(CPRuntime.single(), [5, 3])
    ids = torch.arange(8)[meta.token_indices][None]
    with torch.no_grad(), cp_step(meta):
        with pytest.raises(ValueError, match="without position_ids"):
            model(input_ids=ids, use_cache=False)
        with pytest.raises(ValueError, match="position_ids has 7 entries but the step has 8"):
            model(input_ids=ids, position_ids=meta.positions[None, :7], use_cache=False)
        with pytest.raises(ValueError, match="not the step's positions"):
            model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False)
        model(input_ids=ids, position_ids=meta.positions[None].clone(), use_cache=False)
        # HF's own loss would shift the targets within this rank's (reordered) tokens.
        for name in ("labels", "shift_labels"):
            with pytest.raises(ValueError, match=f"{name}= under a cp step"):
                model(input_ids=ids, position_ids=meta.positions[None], use_cache=False,
                      **{name: ids})  # fmt: skip
    # Outside a cp step the hook stays out of the way (cp's attention then asks for a step).
    with pytest.raises(RuntimeError, match="no context-parallel step is active"):
        model(input_ids=ids, use_cache=False)


@pytest.mark.parametrize("variant", ["qwen3", "phi3"])
def test_compiled_prefill_and_decode_have_no_graph_break(variant):
    """The base model's forward compiles with fullgraph=True (no graph break anywhere, the
    attention function included) for a chunked prefill over a cached prefix and for decode."""
    prompts = _prompts()
    want = _original_logits(_build(variant), prompts)
    model = swap_attention(_build(variant))
    allocate_kv_caches(model, 16, 4, dtype=torch.float32)
    torch._dynamo.reset()

    def forward(ids, positions):
        return model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state

    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")
    table = torch.arange(12, dtype=torch.int32).view(3, 4)

    def step(rows, starts, ends):
        meta = build_step_metadata(
            CPRuntime.single(),
            [e - s for s, e in zip(starts, ends)],
            starts,
            block_table=table[rows],
            block_size=4,
        )
        flat = torch.cat([prompts[r][s:e] for r, s, e in zip(rows, starts, ends)])
        with torch.no_grad(), cp_step(meta):
            hidden = compiled(flat[meta.token_indices][None], meta.positions[None].clone())[0]
            return meta.all_decode, model.lm_head(restore_tokens(hidden, meta))

    step([0, 1, 2], [0, 0, 0], [6, 1, 3])
    # Chunked prefill over the cached prefixes, then decode of the last tokens.
    decode, got = step([0, 2], [6, 3], [12, 5])
    assert not decode
    torch.testing.assert_close(got, torch.cat([want[0][6:12], want[2][3:5]]))
    decode, got = step([0, 2], [12, 5], [13, 6])
    assert decode
    torch.testing.assert_close(got, torch.cat([want[0][12:], want[2][5:]]))


def test_tp_shards_only_mlps_whose_forward_is_elementwise_between_the_projections():
    import transformers.models.bitnet.modeling_bitnet as bitnet
    import transformers.models.gemma3n.modeling_gemma3n as gemma3n
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    from cp_modules.modules.hf_tp import _elementwise_mlp

    assert _elementwise_mlp(build_tiny("llama").model.layers[0].mlp)
    assert _elementwise_mlp(build_tiny("deepseek_v3").model.layers[0].mlp)  # its dense layer
    for cls in (llama.LlamaMLP, qwen3.Qwen3MLP):
        assert _elementwise_mlp(cls.__new__(cls))
    # A norm over the intermediate features (BitNet) or their statistics (Gemma 3n's activation
    # sparsity) would see one rank's slice: kept replicated.
    for cls in (bitnet.BitNetMLP, gemma3n.Gemma3nTextMLP):
        assert not _elementwise_mlp(cls.__new__(cls))


def test_an_mla_module_that_does_more_than_deepseeks_is_refused():
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    class GatedMLA(DeepseekV3Attention):  # an output gate (as Bailing's g_proj)
        def forward(self, hidden_states, *args, **kwargs):
            out, weights = super().forward(hidden_states, *args, **kwargs)
            return torch.sigmoid(self.g_proj(hidden_states)) * out, weights

    model = build_tiny("deepseek_v3")
    attn = model.model.layers[1].self_attn
    attn.__class__ = GatedMLA
    attn.g_proj = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"layer 'model.layers.1.self_attn'.*uses \['g_proj'\]"):
        swap_attention(model)
    # DeepSeek-V3.2's sparse indexer, were its layers not typed `indexed_attention`.
    if hasattr(tf, "DeepseekV32ForCausalLM"):
        cfg = tf.DeepseekV32Config(**{**tiny_config("deepseek_v3").to_diff_dict(), "index_topk": 4,
                                      "index_n_heads": 2, "index_head_dim": 16})  # fmt: skip
        v32 = tf.DeepseekV32ForCausalLM(cfg).eval()
        with pytest.raises(ValueError, match="indexed_attention"):
            swap_attention(v32)
        v32.config.layer_types = None
        with pytest.raises(ValueError, match=r"DeepseekV32Attention looks like MLA.*'indexer'"):
            swap_attention(v32)


def test_a_mask_marker_serves_whole_slices_and_refuses_partial_ones():
    from cp_modules.modules.hf_attention import RefusedMask, WindowMask

    window = WindowMask(4)
    assert window[:, :, slice(-0, None), :] is window and window[...] is window
    for index in [(slice(None), slice(None), slice(-1, None), slice(None)), 3]:
        with pytest.raises(ValueError, match="keeping only some query rows or keys"):
            window[index]
    refused = RefusedMask("a feature")
    assert refused[:, :, :, :] is refused
