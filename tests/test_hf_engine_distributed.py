"""HF models served by cp on gloo ranks: generation equals HF ``generate``, gradients equal the
original model's.

Tiny models (seeded weights, the same on every rank) of Llama, Qwen2, Qwen3 (q/k norms),
Phi-3 (fused qkv_proj, heads gathered over TP by its own TP plan), GLM-4 (partial rotary) and
DeepSeek-V3 (MLA, module swap) go through ``swap_attention`` (tensor parallelism of the
projections, MLPs, embeddings, LM head) and the engine, on a batch of prompts of different
lengths with a small per-step budget, so prompts are prefilled in chunks over a cached prefix,
then decoded with the KV cache sharded over DCP. Greedy tokens must equal HF's own
``generate`` run on one process prompt by prompt, and each rank's KV-cache blocks must be the
DCP share. Training: a cache-less forward and backward of a ragged batch (float64) must give
the parameter gradients of the same model on one process (summed over PCP, full tensors over
TP). One spawn per
world size runs every case.
"""

from __future__ import annotations

import dataclasses

import pytest

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.testing import hf_greedy_tokens, run_distributed

pytestmark = pytest.mark.distributed

PROMPT_LENS = (37, 3, 12, 1)
TRAIN_LENS = (13, 1, 7)
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
    train: bool = False  # gradients instead of generation
    graphs: bool = False  # decode on the engine's static buffers (the CUDA-graph code path)

    @property
    def name(self) -> str:
        extra = (
            ("-bias" if self.bias else "")
            + ("-tied" if self.tied else "")
            + ("-train" if self.train else "")
            + ("-graphs" if self.graphs else "")
        )
        return (
            f"{self.family}-kv{self.num_kv_heads}{extra}-tp{self.tp}-pcp{self.pcp}-"
            f"dcp{self.dcp}-{self.backend}-I{self.interleave}"
        )

    @property
    def model_key(self) -> tuple:
        kv = 8 if self.family == "deepseek_v3" else self.num_kv_heads
        return (self.family, kv, self.bias, self.tied, "float64" if self.train else "float32")


def _model_conf(
    family: str, num_kv_heads: int, bias: bool = False, tied: bool = False, dtype: str = "float32"
):
    from recipe_configs import Family, ModelConf

    if family == "deepseek_v3":
        return ModelConf(
            family=Family.deepseek_v3,
            num_kv_heads=8,
            q_lora_rank=32,
            tie_word_embeddings=tied,
            dtype=dtype,
        )
    return ModelConf(
        family=Family(family),
        num_kv_heads=num_kv_heads,
        attention_bias=bias,
        tie_word_embeddings=tied,
        dtype=dtype,
    )


def _prompts(lens=PROMPT_LENS, seed=1234) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _loss_weights():
    import torch

    g = torch.Generator().manual_seed(99)
    return torch.randn(sum(TRAIN_LENS), 256, generator=g, dtype=torch.float64)


def _train_grads(model, groups, runtime):
    """Gradients of sum(logits * W) over a ragged batch: one forward of this rank's tokens."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from cp_modules.distributed.collectives import resolve_group
    from cp_modules.modules import build_step_metadata, cp_step, restore_tokens

    flat = torch.tensor([t for p in _prompts(TRAIN_LENS, seed=5) for t in p])
    meta = build_step_metadata(runtime, list(TRAIN_LENS))
    model.train()
    with cp_step(meta):
        logits = model(
            input_ids=flat[meta.token_indices][None],
            position_ids=meta.positions[None],
            use_cache=False,
        ).logits[0]
    # Every PCP rank holds the same restored logits; the restore's backward sums over PCP.
    loss = (restore_tokens(logits, meta) * _loss_weights()).sum() / runtime.pcp_size
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        g = g.full_tensor() if isinstance(g, DTensor) else g
        g = torch.zeros(p.shape, dtype=p.dtype) if g is None else g.clone()
        if runtime.pcp_size > 1:
            dist.all_reduce(g, group=resolve_group(groups.pcp_name))
        grads[name] = g.numpy()  # by value: tensors would travel as shared memory of a dead process
    return grads


def _rank_body(rank: int, world_size: int, cases: list[Case], prompts):
    from recipe_models import build_model

    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention
    from cp_modules.step import CPRuntime

    out = []
    for c in cases:
        config = ParallelConfig(
            tensor_parallel_size=c.tp,
            prefill_context_parallel_size=c.pcp,
            decode_context_parallel_size=c.dcp,
            dcp_comm_backend=c.backend,
            dcp_kv_cache_interleave_size=c.interleave,
        )
        groups = init_cp_groups(config)
        model = swap_attention(build_model(_model_conf(*c.model_key)), groups)
        if c.train:
            out.append((c.name, _train_grads(model, groups, CPRuntime.from_groups(groups)), None))
            continue
        engine = GenerationEngine(
            model, groups, block_size=BLOCK_SIZE, max_num_tokens=BUDGET, progress=False,
            decode_graphs=c.graphs,
        )  # fmt: skip
        res = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
        out.append((c.name, res.outputs, res.stats.peak_blocks))
    return out


@pytest.fixture(scope="module")
def hf_reference():
    """One process's results per model: greedy tokens of HF's own ``generate`` (original
    attention), or the gradients of the training loss."""
    import torch
    from recipe_models import build_model

    from cp_modules.modules.hf_swap import swap_attention
    from cp_modules.step import CPRuntime

    prompts = _prompts()
    cache = {}

    def get(key: tuple, train: bool = False):
        if (key, train) in cache:
            return cache[key, train]
        model = build_model(_model_conf(*key))
        if train:
            # One process: the swapped model (the op's backward recomputes the softmax from an
            # fp32 LSE, so the original model's fp64 gradients agree to fp32 accuracy only).
            grads = _train_grads(swap_attention(model), None, CPRuntime.single())
            cache[key, train] = {n: torch.from_numpy(g) for n, g in grads.items()}
        else:
            cache[key, train] = hf_greedy_tokens(model, prompts, MAX_NEW_TOKENS)
        return cache[key, train]

    return prompts, get


def _check(results, cases, get_reference):
    import torch

    for c in cases:
        want = get_reference(c.model_key, c.train)
        for rank, per_rank in enumerate(results):
            name, got, peak_blocks = per_rank[cases.index(c)]
            assert name == c.name
            if c.train:
                assert got.keys() == want.keys()
                for n in want:
                    where = f"{name} rank {rank} {n}"
                    torch.testing.assert_close(
                        torch.from_numpy(got[n]), want[n], msg=lambda m, w=where: f"{w}: {m}"
                    )
                continue
            assert all(len(w) == MAX_NEW_TOKENS for w in want)
            assert got == want, (name, rank, got, want)
            # KV memory per rank: a request of L tokens takes ceil(L / (block_size * dcp)) blocks.
            blocks = sum(dcp_num_blocks(n + MAX_NEW_TOKENS, BLOCK_SIZE, c.dcp) for n in PROMPT_LENS)
            assert peak_blocks == blocks, (name, rank, peak_blocks, blocks)


WORLD4 = [
    *(Case(f, 2, 2, 2) for f in ("llama", "qwen2", "qwen3", "phi3", "glm4", "deepseek_v3")),
    *(
        Case(f, 1, 4, 4, "a2a", interleave=2)
        for f in ("llama", "qwen3", "phi3", "glm4", "deepseek_v3")
    ),
    # The decode graphs' static buffers under PCP x DCP sharding (run eagerly on CPU).
    Case("llama", 2, 2, 2, graphs=True),
    Case("deepseek_v3", 1, 4, 4, "a2a", interleave=2, graphs=True),
    Case("llama", 4, 1, 2, bias=True),  # 2 KV heads over 4 TP positions: replicated KV heads
    Case("qwen3", 4, 1, 2, "a2a", tied=True),  # replicated KV heads after q/k norms
    Case("deepseek_v3", 4, 1, 4, "a2a"),
    Case("llama", 2, 2, 4, "a2a", num_kv_heads=1),  # DCP over both TP positions: MQA only
    Case("deepseek_v3", 2, 2, 4, "ag_rs", interleave=2),
    *(Case(f, 2, 2, 2, train=True) for f in ("llama", "qwen3")),
    *(Case(f, 1, 4, 1, train=True) for f in ("llama", "qwen3")),
    Case("qwen3", 4, 1, 1, train=True),  # replicated KV heads: the k norm's gradient summed once
]

WORLD2 = [
    *(Case(f, 1, 2, 2) for f in ("llama", "qwen3", "phi3", "glm4")),
    # DCP over both TP positions: they must share their KV head (one, replicated).
    *(Case(f, 2, 1, 2, "a2a", num_kv_heads=1) for f in ("llama", "qwen3", "glm4")),
    Case("phi3", 2, 1, 1),  # heads gathered over TP: DCP may span only PCP ranks
    *(Case(f, 2, 1, 1, train=True) for f in ("llama", "qwen3", "deepseek_v3")),
    Case("qwen3", 1, 2, 1, train=True),
]

WORLD8 = [
    *(Case(f, 2, 4, 4, "a2a") for f in ("llama", "qwen2", "qwen3", "deepseek_v3")),
    Case("llama", 4, 2, 4),
    Case("qwen2", 4, 2, 4, "a2a", interleave=2),
    Case("deepseek_v3", 4, 2, 8, "a2a"),
]


def _run(hf_reference, world_size, cases, timeout_s):
    prompts, get = hf_reference
    for c in cases:  # the parent builds the references before the ranks start
        get(c.model_key, c.train)
    results = run_distributed(
        _rank_body, world_size, cases, prompts, timeout_s=timeout_s, collective_timeout_s=120
    )
    _check(results, cases, get)


def test_world4_generation_equals_hf_generate_and_gradients_equal_the_original(hf_reference):
    _run(hf_reference, 4, WORLD4, 1500)


def test_world2_generation_equals_hf_generate_and_gradients_equal_the_original(hf_reference):
    _run(hf_reference, 2, WORLD2, 900)


def _refused_layout(rank: int, world_size: int):
    from recipe_models import build_model

    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules.hf_swap import swap_attention

    groups = init_cp_groups(ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2))
    try:
        swap_attention(build_model(_model_conf("phi3", 1)), groups)
    except ValueError as e:
        return str(e)
    return None


def test_a_layout_the_tp_plan_cannot_serve_is_refused_on_every_rank():
    # Phi-3's TP plan gathers q/k/v (every head on every TP rank): a DCP group spanning TP
    # positions would gather the query heads again.
    for msg in run_distributed(_refused_layout, 2, timeout_s=300):
        assert msg is not None and "Phi3ForCausalLM" in msg and "self_attn" in msg
        assert "decode_context_parallel_size <= prefill_context_parallel_size" in msg


@pytest.mark.slow
def test_world8_greedy_generation_equals_hf_generate(hf_reference):
    _run(hf_reference, 8, WORLD8, 1500)
