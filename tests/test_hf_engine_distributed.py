"""HF models with swapped attention generate on gloo ranks exactly what HF ``generate`` does.

Tiny Llama, Qwen2 (q/k/v bias) and DeepSeek-V3 (MLA, interleaved rope, MoE) models are built
from configs with seeded weights on every rank, swapped, tensor-parallelised (attention, MLPs,
embeddings, LM head) and run by the engine on a batch of prompts of different lengths with a
small per-step budget, so prompts are prefilled in chunks over a cached prefix, then decoded
with the KV cache sharded over DCP. Greedy tokens must equal HF's own ``generate`` run on one
process prompt by prompt, and each rank's KV-cache blocks must be the DCP share. One spawn per
world size runs every family and configuration.
"""

from __future__ import annotations

import dataclasses

import pytest

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.testing import run_distributed

pytestmark = pytest.mark.distributed

PROMPT_LENS = (37, 3, 12, 1)
MAX_NEW_TOKENS = 6
BLOCK_SIZE = 4
BUDGET = 16  # tokens per step: the 37-token prompt is prefilled over several steps


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    tp: int
    pcp: int
    dcp: int
    backend: str = "ag_rs"
    interleave: int = 1
    num_kv_heads: int = 2
    bias: bool = False  # Llama: biases on q/k/v and o_proj
    tied: bool = False  # embedding and LM head share their weight

    @property
    def name(self) -> str:
        extra = ("-bias" if self.bias else "") + ("-tied" if self.tied else "")
        return (f"{self.family}-kv{self.num_kv_heads}{extra}-tp{self.tp}-pcp{self.pcp}-"
                f"dcp{self.dcp}-{self.backend}-I{self.interleave}")

    @property
    def model_key(self) -> tuple:
        return (self.family, self.num_kv_heads if self.family != "deepseek_v3" else 8, self.bias, self.tied)


def _model_conf(family: str, num_kv_heads: int, bias: bool = False, tied: bool = False):
    from cp_modules.recipe_configs import Family, ModelConf

    if family == "deepseek_v3":
        return ModelConf(family=Family.deepseek_v3, num_kv_heads=8, q_lora_rank=32, tie_word_embeddings=tied)
    return ModelConf(family=Family(family), num_kv_heads=num_kv_heads, attention_bias=bias,
                     tie_word_embeddings=tied)


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _rank_body(rank: int, world_size: int, cases: list[Case], prompts):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams, build_model
    from cp_modules.modules.hf_swap import swap_attention

    out = []
    for c in cases:
        config = ParallelConfig(
            tensor_parallel_size=c.tp, prefill_context_parallel_size=c.pcp,
            decode_context_parallel_size=c.dcp, dcp_comm_backend=c.backend,
            dcp_kv_cache_interleave_size=c.interleave,
        )
        groups = init_cp_groups(config)
        model = swap_attention(build_model(_model_conf(*c.model_key)), groups)
        engine = GenerationEngine(model, groups, block_size=BLOCK_SIZE, max_num_tokens=BUDGET, progress=False)
        res = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
        out.append((c.name, res.outputs, res.stats.peak_blocks))
    return out


@pytest.fixture(scope="module")
def hf_reference():
    """Greedy tokens of HF's own generate (original attention, one process), per model."""
    import torch

    from cp_modules.engine import build_model

    prompts = _prompts()
    cache = {}

    def get(key: tuple):
        if key not in cache:
            model = build_model(_model_conf(*key))
            with torch.no_grad():
                cache[key] = [
                    model.generate(
                        torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    )[0, len(p):].tolist()
                    for p in prompts
                ]
        return cache[key]

    return prompts, get


def _check(results, cases, get_reference):
    for c in cases:
        want = get_reference(c.model_key)
        assert all(len(w) == MAX_NEW_TOKENS for w in want)
        # KV memory per rank: a request of L tokens takes ceil(L / (block_size * dcp)) blocks.
        blocks = sum(dcp_num_blocks(n + MAX_NEW_TOKENS, BLOCK_SIZE, c.dcp) for n in PROMPT_LENS)
        for rank, per_rank in enumerate(results):
            name, outputs, peak_blocks = per_rank[cases.index(c)]
            assert name == c.name
            assert outputs == want, (name, rank, outputs, want)
            assert peak_blocks == blocks, (name, rank, peak_blocks, blocks)


WORLD4 = [
    *(Case(f, 2, 2, 2) for f in ("llama", "qwen2", "deepseek_v3")),
    *(Case(f, 1, 4, 4, "a2a", interleave=2) for f in ("llama", "qwen2", "deepseek_v3")),
    Case("llama", 4, 1, 2, bias=True),  # 2 KV heads over 4 TP positions: replicated KV heads
    Case("qwen2", 4, 1, 2, "a2a", tied=True),
    Case("deepseek_v3", 4, 1, 4, "a2a"),
    Case("llama", 2, 2, 4, "a2a", num_kv_heads=1),  # DCP over both TP positions: MQA only
    Case("deepseek_v3", 2, 2, 4, "ag_rs", interleave=2),
]

WORLD8 = [
    *(Case(f, 2, 4, 4, "a2a") for f in ("llama", "qwen2", "deepseek_v3")),
    Case("llama", 4, 2, 4),
    Case("qwen2", 4, 2, 4, "a2a", interleave=2),
    Case("deepseek_v3", 4, 2, 8, "a2a"),
]


def test_world4_greedy_generation_equals_hf_generate(hf_reference):
    prompts, get = hf_reference
    for c in WORLD4:  # the parent builds the references before the ranks start
        get(c.model_key)
    results = run_distributed(_rank_body, 4, WORLD4, prompts, timeout_s=900, collective_timeout_s=120)
    _check(results, WORLD4, get)


@pytest.mark.slow
def test_world8_greedy_generation_equals_hf_generate(hf_reference):
    prompts, get = hf_reference
    for c in WORLD8:
        get(c.model_key)
    results = run_distributed(_rank_body, 8, WORLD8, prompts, timeout_s=1200, collective_timeout_s=180)
    _check(results, WORLD8, get)
