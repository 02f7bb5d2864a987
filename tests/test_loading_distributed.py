"""Shard-only loading on gloo ranks: ``load_pretrained`` keeps a rank's host memory within the
contract and gives the logits of the one-process transformers model.

Each rank's peak RSS growth during the load must stay within ``checkpoint bytes / tp x 1.3 +
the largest tensor + 96 MiB`` (SPEC §8). Checkpoints: a random Llama (dense, ~230 MiB fp32,
tied to nothing) and a random Qwen3-MoE (64 routed experts, ~200 MiB), written by
``save_pretrained`` (the MoE one per expert, as transformers writes it; the Llama one split
into several files with an index), and tiny DeepSeek-V3 (MLA), Mixtral, gpt-oss and GLM-4-MoE
checkpoints whose experts are split too. Logits of an 11-token prompt through a cp step must equal
HF's (fp32, 1e-4). One spawn per world size runs every layout of that size, and the bad
checkpoints, which every rank must refuse with the same ``ValueError`` before any collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cp_modules.testing import run_distributed

pytestmark = pytest.mark.distributed

MIB = 2**20
PROMPT = 11


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip


def _moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=64, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


def _write(config, path: Path, max_shard_size: str | None = None) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)


def _family_configs():
    """Tiny MoE families whose experts are split over TP (logits only, no memory check)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig, GptOssConfig, MixtralConfig

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {
        "deepseek_v3": DeepseekV3Config(
            **common, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
        ),
        "mixtral": MixtralConfig(
            **common, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "gpt_oss": GptOssConfig(
            **common, intermediate_size=64, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "glm4_moe": Glm4MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2,
            n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, head_dim=16,
            n_group=1, topk_group=1,
        ),
    }  # fmt: skip


FAMILIES = ("deepseek_v3", "mixtral", "gpt_oss", "glm4_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    _write(_llama_config(), root / "llama", max_shard_size="100MB")
    _write(_moe_config(), root / "moe")
    for name, config in _family_configs().items():
        _write(config, root / name)
    _bad_checkpoints(root)
    return root


def _bad_checkpoints(root: Path) -> None:
    """A checkpoint whose shapes differ from its config, and one missing a tensor."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    small = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    for name in ("bad_shape", "missing"):
        d = root / name
        _write(small, d)
        from safetensors.torch import load_file

        tensors = load_file(str(d / "model.safetensors"))
        if name == "bad_shape":
            tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(48, 32)
        else:
            del tensors["model.layers.0.self_attn.k_proj.weight"]
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    # Heads the layout cannot split: 6 query heads at tp=4.
    d = root / "six_heads"
    _write(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=6, num_key_value_heads=2), d)  # fmt: skip
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_attention_heads"] == 6


def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.arange(PROMPT)[None] * 7 % 128).logits[0]


def _checkpoint_bytes(path: Path) -> tuple[int, int]:
    from cp_modules.loading import CheckpointIndex

    with CheckpointIndex(path) as index:
        return index.total_bytes, index.largest_tensor_bytes


def _rank(rank, world_size, root, layouts, bad):
    import transformers.models.llama.modeling_llama  # noqa: F401 - imports outside the measure
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    import cp_modules
    from cp_modules import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules import CPRuntime
    from cp_modules.step import build_step_metadata, cp_step, restore_tokens
    from cp_modules.testing import peak_rss_growth

    out = {}
    for name, tp, pcp in layouts:
        groups = init_cp_groups(
            ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp)
        )
        model, grew = peak_rss_growth(cp_modules.load_pretrained, root / name, groups, device="cpu")
        local = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
            for p in model.parameters()
        )
        ids = torch.arange(PROMPT) * 7 % 128
        meta = build_step_metadata(
            CPRuntime.from_groups(groups), num_new_tokens=[PROMPT], num_computed_tokens=[0]
        )
        with cp_step(meta), torch.no_grad():
            logits = model(
                input_ids=ids[meta.token_indices][None],
                position_ids=meta.positions[None],
                use_cache=False,
            ).logits[0]
        # Plain lists: a tensor would travel to the parent by a file descriptor of this process.
        out[(name, tp, pcp)] = (grew, local, restore_tokens(logits, meta).tolist())
        del model
    errors = {}
    for name, tp in bad:
        try:
            cp_modules.load_pretrained(
                root / name, ParallelConfig(tensor_parallel_size=tp), device="cpu"
            )
        except ValueError as e:
            errors[name] = str(e)
    return out, errors


def _check(root, results, layouts):
    for name, tp, pcp in layouts:
        total, largest = _checkpoint_bytes(root / name)
        limit = total / tp * 1.3 + largest + 96 * MIB
        ref = _hf_logits(root / name)
        for rank, (out, _) in enumerate(results):
            grew, local, logits = out[(name, tp, pcp)]
            torch.testing.assert_close(torch.tensor(logits), ref, atol=1e-4, rtol=1e-4)
            if name in FAMILIES:
                assert local <= total / tp * 1.1 + largest / tp, (name, local, total)
                continue
            print(
                f"{name} tp={tp} pcp={pcp} rank {rank}: checkpoint {total / MIB:.0f} MiB, local "
                f"{local / MIB:.0f} MiB, RSS growth {grew / MIB:.0f} MiB, limit {limit / MIB:.0f} MiB"
            )
            assert grew <= limit, (name, tp, pcp, rank, grew / MIB, limit / MIB)
            assert local <= total / tp * 1.1 + largest / tp


def test_load_pretrained_two_ranks(checkpoints):
    layouts = [("llama", 2, 1), ("moe", 2, 1), *((f, 2, 1) for f in FAMILIES)]
    bad = [("bad_shape", 2), ("missing", 2), ("nowhere", 2)]
    results = run_distributed(_rank, 2, checkpoints, layouts, bad, timeout_s=600)
    _check(checkpoints, results, layouts)
    for _, errors in results:
        assert "model.layers.0.mlp.up_proj.weight" in errors["bad_shape"]
        assert "model.safetensors" in errors["bad_shape"]
        assert "model.layers.0.self_attn.k_proj.weight" in errors["missing"]
        assert "does not exist" in errors["nowhere"]
    assert results[0][1] == results[1][1]  # every rank refuses with the same message


def test_load_pretrained_four_ranks(checkpoints):
    layouts = [("llama", 4, 1), ("llama", 2, 2), ("moe", 4, 1)]
    bad = [("six_heads", 4)]
    results = run_distributed(_rank, 4, checkpoints, layouts, bad, timeout_s=600)
    _check(checkpoints, results, layouts)
    for _, errors in results:
        assert "num_heads=6" in errors["six_heads"]


def _one_rank_lacks_the_checkpoint(rank, world_size, root):
    import cp_modules
    from cp_modules import ParallelConfig

    path = root / ("bad_shape" if rank == 1 else "mixtral")
    cp_modules.load_pretrained(path, ParallelConfig(tensor_parallel_size=2), device="cpu")


def test_a_rank_that_fails_alone_does_not_hang_the_others(checkpoints):
    """Rank 1 refuses its checkpoint before any collective; rank 0, already in the groups'
    set-up, fails within the collective timeout instead of waiting for it."""
    import time

    from cp_modules.testing import DistributedTestError

    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(
            _one_rank_lacks_the_checkpoint, 2, checkpoints, timeout_s=120, collective_timeout_s=5
        )
    msg = str(err.value)
    assert "2 of 2 ranks failed" in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert time.monotonic() - t0 < 60
