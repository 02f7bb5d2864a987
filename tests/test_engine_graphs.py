"""The engine's decode steps on static buffers (cp_modules.engine.graphs): the path the CUDA
graphs capture, run eagerly on CPU, equals the plain engine and HF ``generate`` token for token
(greedy), across batch-size buckets, requests joining after others finish, early stops; the
GPU tier replays real CUDA graphs and checks that steady state does not capture again.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from recipe_configs import Family, ModelConf
from recipe_models import build_model

from cp_modules.engine import GenerationEngine, SamplingParams
from cp_modules.engine.graphs import BUCKETS, bucket_of, graph_width
from cp_modules.modules.hf_swap import swap_attention
from cp_modules.testing import hf_greedy_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(lens, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _model(family="llama", device="cpu", dtype=torch.float32, moe=True):
    kv = 8 if family == "deepseek_v3" else 2
    conf = ModelConf(family=Family(family), num_kv_heads=kv)
    if device != "cpu":
        # The CUDA decode kernels take head dims >= 16 (tensor-core tiles).
        heads = 16 if family == "deepseek_v3" else 4
        conf = ModelConf(
            family=Family(family), num_heads=heads, num_kv_heads=heads if kv == 8 else 2,
            qk_rope_head_dim=16,
        )  # fmt: skip
    if not moe:  # every layer dense (no expert routing)
        conf = dataclasses.replace(conf, first_k_dense_replace=conf.num_layers)
    return build_model(conf).to(device, dtype)


def _hf_generate(model, prompts, max_new, device="cpu", **kw):
    return hf_greedy_tokens(model, prompts, max_new, device, **kw)


def test_buckets_and_widths():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 9, 13, 17)] == [1, 2, 4, 8, 12, 16, 24]
    assert bucket_of(BUCKETS[-1] + 1) is None
    assert [graph_width(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_static_buffer_decode_equals_the_plain_engine_and_hf(family):
    # 7 prompts, 3 rows in flight: requests join as others finish (the runs break on every
    # finish), ragged lengths and max_new_tokens change the bucket (3 -> 2 -> 1 rows).
    prompts = _prompts([29, 1, 9, 4, 17, 6, 11])
    hf = _model(family)
    want = _hf_generate(hf, prompts, 9)
    kw = dict(block_size=4, max_num_tokens=16, max_num_seqs=3, progress=False)
    plain = GenerationEngine(swap_attention(_model(family)), decode_graphs=False, **kw)
    graphs = GenerationEngine(swap_attention(_model(family)), decode_graphs=True, **kw)
    params = SamplingParams(max_new_tokens=9)
    a, b = plain.generate(prompts, params), graphs.generate(prompts, params)
    assert a.outputs == want
    assert b.outputs == want and b.finish_reasons == a.finish_reasons
    assert b.stats.num_generated_tokens == a.stats.num_generated_tokens
    assert b.stats.num_steps == a.stats.num_steps
    # One graph per (bucket, width) that occurred; none on the plain engine.
    assert plain._graphs == {} and 1 <= len(graphs._graphs) <= 3
    assert graphs.num_graph_captures == 0  # CPU: the same steps, eagerly


def test_early_stops_drop_the_token_computed_ahead():
    prompts = _prompts([12, 5, 8, 3])
    kw = dict(block_size=4, max_num_tokens=32, max_num_seqs=4, progress=False)
    engine = GenerationEngine(swap_attention(_model()), decode_graphs=True, **kw)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=10)).outputs
    eos = free[1][3]  # request 1 stops after its fourth token (mid-run)
    want = _hf_generate(_model(), prompts, 10, eos_token_id=eos)
    res = engine.generate(prompts, SamplingParams(max_new_tokens=10, eos_token_id=eos))
    assert res.outputs == want and res.outputs[1] == free[1][:4]
    assert res.finish_reasons[1] == "eos"
    plain = GenerationEngine(swap_attention(_model()), decode_graphs=False, **kw)
    assert plain.generate(prompts, SamplingParams(max_new_tokens=10, eos_token_id=eos)).outputs == (
        res.outputs
    )


def test_sampled_decode_is_seeded_on_static_buffers():
    prompts = _prompts([7, 3])
    kw = dict(block_size=4, max_num_tokens=16, max_num_seqs=2, progress=False)
    engine = GenerationEngine(swap_attention(_model()), decode_graphs=True, **kw)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=4)
    assert engine.generate(prompts, params).outputs == engine.generate(prompts, params).outputs


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_gpu_graph_replayed_decode_equals_eager_and_does_not_recapture(family):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    prompts = _prompts([29, 1, 9, 4, 17, 6, 11, 40, 2])
    kw = dict(block_size=16, max_num_tokens=64, max_num_seqs=4, progress=False)
    # Dense layers: HF's grouped-expert routing is not capturable (the next test).
    model = functools.partial(_model, family, dev, moe=False)
    want = _hf_generate(model(), prompts, 12, device=dev)
    eager = GenerationEngine(swap_attention(model()), decode_graphs=False, **kw)
    graphs = GenerationEngine(swap_attention(model()), decode_graphs=True, **kw)
    params = SamplingParams(max_new_tokens=12)
    a = eager.generate(prompts, params)
    b = graphs.generate(prompts, params)
    assert a.outputs == want
    assert b.outputs == a.outputs  # fp32: token for token
    captures = graphs.num_graph_captures
    assert 1 <= captures <= 4  # buckets 4, 2, 1 (and 3 -> 4)
    # Steady state: the same shapes again capture nothing new.
    assert graphs.generate(prompts, params).outputs == a.outputs
    assert graphs.num_graph_captures == captures


@pytest.mark.gpu
def test_gpu_uncapturable_model_decodes_eagerly_or_raises_when_graphs_requested():
    # HF's grouped-expert MoE copies host data during the forward: no CUDA graph. By default
    # the engine warns and decodes eagerly (same tokens); decode_graphs=True raises.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    prompts = _prompts([9, 4, 17])
    kw = dict(block_size=16, max_num_tokens=64, max_num_seqs=4, progress=False)
    params = SamplingParams(max_new_tokens=6)
    want = (
        GenerationEngine(swap_attention(_model("deepseek_v3", dev)), decode_graphs=False, **kw)
        .generate(prompts, params)
        .outputs
    )
    auto = GenerationEngine(swap_attention(_model("deepseek_v3", dev)), **kw)
    with pytest.warns(UserWarning, match="cannot be captured"):
        assert auto.generate(prompts, params).outputs == want
    assert auto.num_graph_captures == 0 and not auto.decode_graphs
    forced = GenerationEngine(swap_attention(_model("deepseek_v3", dev)), decode_graphs=True, **kw)
    with pytest.raises(RuntimeError, match="decode_graphs=True"):
        forced.generate(prompts, params)
