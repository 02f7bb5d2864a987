"""GenerationEngine on one process: greedy tokens equal HF ``generate``; stops, sampling,
scheduling, compile and errors. (Multi-rank equality: test_hf_engine_distributed.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from recipe_configs import Family, ModelConf
from recipe_models import build_model

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.engine import (
    GenerationEngine,
    Request,
    SamplingParams,
    Scheduler,
    sample_tokens,
)
from cp_modules.modules.hf_swap import swap_attention
from cp_modules.testing import hf_greedy_tokens

LENS = (29, 1, 9, 4, 17)
MAX_NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def _conf(family: str) -> ModelConf:
    if family in ("deepseek_v3", "deepseek_v2"):
        return ModelConf(
            family=Family(family),
            num_kv_heads=8,
            q_lora_rank=32 if family == "deepseek_v3" else None,
        )
    return ModelConf(family=Family(family), num_kv_heads=2)


def _prompts(lens=LENS, seed=3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _hf_generate(model, prompts, max_new_tokens, **kw) -> list[list[int]]:
    return hf_greedy_tokens(model, prompts, max_new_tokens, **kw)


def _engine(family: str, **kw) -> GenerationEngine:
    kw = {"block_size": 4, "max_num_tokens": 8, "max_num_seqs": 3, "progress": False, **kw}
    return GenerationEngine(swap_attention(build_model(_conf(family))), **kw)


@pytest.mark.parametrize("family", [f.value for f in Family])
def test_greedy_generation_equals_hf_generate(family):
    prompts = _prompts()
    want = _hf_generate(build_model(_conf(family)), prompts, max_new_tokens=MAX_NEW)
    # 8 tokens a step, 3 requests in flight: prompts are chunked, requests wait for a row.
    res = _engine(family).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert res.outputs == want
    assert res.finish_reasons == ["length"] * len(prompts)
    s = res.stats
    assert s.num_generated_tokens == MAX_NEW * len(prompts)
    assert s.num_prompt_tokens == sum(LENS)
    assert s.tokens_per_s > 0 and 0 < s.ttft_s <= s.total_s
    # Peak blocks: at most 3 requests hold their full-length reservation at once.
    need = sorted((dcp_num_blocks(n + MAX_NEW, 4, 1) for n in LENS), reverse=True)
    assert s.peak_blocks <= sum(need[:3])


def test_eos_stops_a_request_like_hf_generate():
    prompts = _prompts()
    engine = _engine("llama")
    free = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)).outputs
    eos = free[0][2]  # request 0 stops after its third token
    want = _hf_generate(
        build_model(_conf("llama")), prompts, max_new_tokens=MAX_NEW, eos_token_id=eos
    )
    res = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, eos_token_id=eos))
    assert res.outputs == want
    assert res.outputs[0] == free[0][:3] and res.finish_reasons[0] == "eos"
    for out, why in zip(res.outputs, res.finish_reasons):
        assert why == ("eos" if eos in out else "length")
        assert eos not in out[:-1]


def test_the_engine_stops_at_the_models_eos_by_default():
    prompts = _prompts()
    engine = _engine("qwen3")
    free = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)).outputs
    eos = [free[0][2], free[2][4]]  # a list of ids, as generation configs may hold
    engine.model.generation_config.eos_token_id = eos
    model = build_model(_conf("qwen3"))
    model.generation_config.eos_token_id = eos
    want = _hf_generate(model, prompts, max_new_tokens=MAX_NEW)
    res = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert res.outputs == want and res.outputs[0] == free[0][:3]
    assert [why == "eos" for why in res.finish_reasons] == [
        any(t in eos for t in o) for o in res.outputs
    ]
    assert (
        engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)).outputs
        == free
    )


@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_the_engine_samples_from_the_models_own_logits(family):
    """Cohere scales and Granite divides the LM head's output (greedy cannot tell, sampling can)."""
    engine = _engine(family)
    model = build_model(_conf(family))
    ids = torch.tensor([_prompts(lens=(9,))[0]])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        got = engine.compute_logits(model.model(input_ids=ids).last_hidden_state[0])
        plain = model.lm_head(model.model(input_ids=ids).last_hidden_state[0])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(plain, want)  # the family's post-processing is not the identity


def test_logits_post_processing_the_engine_does_not_know_is_refused():
    model = swap_attention(build_model(_conf("llama")))

    class Shifted(type(model)):
        def forward(self, input_ids=None, **kw):
            hidden_states = self.model(input_ids=input_ids, **kw).last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits + 1.0
            return logits

    model.__class__ = Shifted
    with pytest.raises(
        ValueError, match=r"Shifted.forward post-processes its logits with 'logits = logits \+ 1.0'"
    ):
        GenerationEngine(model)


def test_sampling_is_seeded():
    prompts = _prompts()
    engine = _engine("qwen2")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    a = engine.generate(prompts, params).outputs
    assert engine.generate(prompts, params).outputs == a
    assert engine.generate(prompts, dataclasses.replace(params, seed=6)).outputs != a
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)).outputs
    assert engine.generate(prompts, dataclasses.replace(params, top_k=1)).outputs == greedy


def test_sample_tokens_filters():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_tokens(logits, SamplingParams()).tolist() == [2, 0]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        t = sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2), g).tolist()
        assert t[0] in (2, 3)
        # top_p: row 0 keeps {2, 3} (p(2) = 0.64 < 0.7 <= p(2) + p(3)); row 1 keeps {0}.
        t = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7), g).tolist()
        assert t[0] in (2, 3) and t[1] == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"eos_token_id": -3}, "eos_token_id"),
    ],
)
def test_sampling_params_reject_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_compiled_engine_equals_eager_and_reuses_its_graphs():
    prompts = _prompts()
    want = _engine("llama").generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)).outputs
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine = _engine("llama", compile=True, compile_backend="aot_eager")
    engine.generate(_prompts((5, 11), seed=4), SamplingParams(max_new_tokens=3))
    # Prefill, decode, and decode of a single token (dynamic shapes specialize sizes 0 and 1).
    assert counters["stats"]["unique_graphs"] == 3
    # A larger batch: other token counts and decode batch sizes, a larger KV cache: no new graph.
    assert engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)).outputs == want
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]


def _requests(lens, max_new):
    return [Request(i, list(range(n)), max_new) for i, n in enumerate(lens)]


def test_scheduler_budget_chunks_and_blocks():
    reqs = _requests((10, 3, 7), 2)
    s = Scheduler(reqs, num_blocks=8, block_size=2, dcp_size=2, max_num_tokens=5, max_num_seqs=2)
    steps = []
    while not s.done:
        b = s.schedule()
        assert sum(b.num_new) <= 5
        # Decodes come first, one token each.
        n_dec = sum(r.is_decoding for r in b.requests)
        assert b.num_new[:n_dec] == [1] * n_dec and not any(
            r.is_decoding for r in b.requests[n_dec:]
        )
        steps.append([(r.index, n) for r, n in zip(b.requests, b.num_new)])
        s.update(b, [7] * len(b.sample_requests), frozenset(), 0.0)
    assert steps[0] == [(0, 5)] and steps[1] == [(0, 5)]
    assert all(len(r.output) == 2 and r.finish_reason == "length" for r in reqs)
    # 2 rows: request 2 waits for a free row; every block is returned at the end.
    assert all(idx != 2 for idx, _ in steps[2]) and s.allocator.num_used == 0
    assert s.peak_blocks_used == dcp_num_blocks(12, 2, 2) + dcp_num_blocks(5, 2, 2)


def test_scheduler_waits_for_blocks_and_rejects_a_request_that_never_fits():
    reqs = _requests((6, 6), 2)  # 8 tokens each: 2 blocks of 4
    s = Scheduler(reqs, num_blocks=3, block_size=4, dcp_size=1, max_num_tokens=16, max_num_seqs=2)
    b = s.schedule()
    assert [r.index for r in b.requests] == [0]
    with pytest.raises(ValueError, match="num_blocks=1"):
        Scheduler(
            _requests((6,), 2),
            num_blocks=1,
            block_size=4,
            dcp_size=1,
            max_num_tokens=8,
            max_num_seqs=1,
        )
    with pytest.raises(ValueError, match="max_num_tokens=2"):
        Scheduler(
            _requests((6,), 2),
            num_blocks=4,
            block_size=4,
            dcp_size=1,
            max_num_tokens=2,
            max_num_seqs=3,
        )


def test_engine_rejects_bad_inputs():
    with pytest.raises(ValueError, match="swap_attention"):
        GenerationEngine(build_model(_conf("llama")))
    engine = _engine("llama")
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1, 2], []])
    with pytest.raises(ValueError, match="vocab_size=256"):
        engine.generate([[1, 256]])
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        engine.generate([[1] * 4000], SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([])
    with pytest.raises(ValueError, match="max_num_tokens"):
        _engine("llama", max_num_tokens=0)
    with pytest.raises(ValueError, match="block_size"):
        _engine("llama", block_size=0)
    with pytest.raises(ValueError, match="float64"):
        GenerationEngine(swap_attention(build_model(_conf("llama")).double()))


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1.5, 2.0]], r"prompts\[0\]\[0\] is float 1\.5, not a token id"),
        ([[1, 2], [3, 2.0]], r"prompts\[1\]\[1\] is float 2\.0, not a token id"),
        (["hello"], r"prompts\[0\] is a string \('hello'\): tokenize it first"),
        ("hello", r"prompts must be a list of prompts, .* got str"),
        ([[[1, 2], [3]]], r"prompts\[0\]\[0\] is list \[1, 2\], not a token id"),
        ([1, 2, 3], r"prompts\[0\] is int 1; a prompt is a list"),
        ([[1, True]], r"prompts\[0\]\[1\] is bool True"),
        ([torch.tensor([1.0, 2.0])], r"prompts\[0\] is a 1-D torch\.float32 tensor"),
        ([torch.ones(1, 2, dtype=torch.long)], r"prompts\[0\] is a 2-D torch\.int64 tensor"),
    ],
)
def test_engine_names_a_malformed_prompt(prompts, match):
    # Float ids used to be truncated silently, strings and nested lists hit a TypeError.
    engine = _engine("llama")
    with pytest.raises(ValueError, match=match) as info:
        engine.generate(prompts, SamplingParams(max_new_tokens=1))
    assert "token ids in [0, 256)" in str(info.value)


def test_engine_takes_prompts_as_lists_tuples_and_integer_tensors():
    import numpy as np

    engine = _engine("llama")
    params = SamplingParams(max_new_tokens=2)
    want = engine.generate([[5, 6, 7]], params).outputs
    for prompt in ((5, 6, 7), torch.tensor([5, 6, 7]), np.array([5, 6, 7]), [np.int64(5), 6, 7]):
        assert engine.generate([prompt], params).outputs == want
