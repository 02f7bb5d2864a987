"""Shard-only loading, one process: box reads of safetensors, transformers' expert fusion read
a box at a time, world size 1 equal to ``from_pretrained`` + ``swap_attention``, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import cp_modules.loading.checkpoint as ckpt
from cp_modules import ParallelConfig, load_pretrained
from cp_modules.loading import CheckpointIndex, global_shapes, meta_causal_lm, plan_sources

BOXES = [
    (slice(0, 7), slice(0, 5), slice(0, 3)),
    (slice(2, 5), slice(1, 4), slice(0, 3)),
    (slice(6, 7), slice(0, 5), slice(2, 3)),
    (slice(3, 3), slice(0, 5), slice(0, 3)),  # empty
]


@pytest.fixture
def sharded_dir(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, 3),
        "b": torch.randn(11, 4).to(torch.bfloat16),
        "c": torch.arange(13, dtype=torch.int64),
        "s": torch.tensor(2.5),
    }
    save_file(
        {k: tensors[k] for k in ("a", "s")}, str(tmp_path / "model-00001-of-00002.safetensors")
    )
    save_file(
        {k: tensors[k] for k in ("b", "c")}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    weight_map = {"a": "model-00001-of-00002.safetensors", "s": "model-00001-of-00002.safetensors",
                  "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, tensors


@pytest.mark.parametrize("chunk_bytes", [16 * 2**20, 24, 1])
def test_box_reads_equal_slices(sharded_dir, monkeypatch, chunk_bytes):
    path, tensors = sharded_dir
    monkeypatch.setattr(ckpt, "READ_CHUNK_BYTES", chunk_bytes)  # many chunks of a few rows
    with CheckpointIndex(path) as index:
        assert sorted(index.entries) == ["a", "b", "c", "s"]
        assert index.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
        for box in BOXES:
            out = torch.full([s.stop - s.start for s in box], float("nan"), dtype=torch.float64)
            index.read("a", box, out)
            assert torch.equal(out, tensors["a"][box].double())
        out = torch.empty(3, 2, dtype=torch.bfloat16)
        index.read("b", (slice(8, 11), slice(1, 3)), out)
        assert torch.equal(out, tensors["b"][8:11, 1:3])
        out = torch.empty(4, dtype=torch.int64)
        index.read("c", (slice(9, 13),), out)
        assert torch.equal(out, tensors["c"][9:])
        s = torch.empty(())
        index.read("s", (), s)
        assert s.item() == 2.5


def _qwen3_moe(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=6,
                            num_experts_per_tok=2)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    return AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32), config


def test_fused_experts_read_by_box(tmp_path):
    """Per-expert checkpoint tensors, fused by transformers' conversion mapping: any box of the
    fused tensor reads what transformers' own load puts there."""
    hf, config = _qwen3_moe(tmp_path)
    with CheckpointIndex(tmp_path) as index:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in index
        meta = meta_causal_lm(config, dtype=torch.float32)
        sources = plan_sources(meta, index, global_shapes(meta))
        full = dict(hf.named_parameters())
        for name in (
            "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
        ):
            src = sources[name]
            assert src.stacked and len(src.keys[0]) == 6
            ref = full[name].detach()
            e, rows, cols = ref.shape
            for box in [
                (slice(0, e), slice(0, rows), slice(0, cols)),
                (slice(2, 4), slice(0, rows), slice(0, cols)),
                (slice(1, 5), slice(rows // 4, rows // 2 + 3), slice(1, cols - 1)),
                (slice(5, 6), slice(rows - 3, rows), slice(0, 2)),
            ]:
                out = torch.full([b.stop - b.start for b in box], float("nan"))
                src.read(index, box, out)
                assert torch.equal(out, ref[box]), (name, box)


def test_world_one_equals_from_pretrained_and_swap(tmp_path):
    from cp_modules import swap_attention
    from cp_modules.modules import CPRuntime
    from cp_modules.step import build_step_metadata, cp_step

    hf, _ = _qwen3_moe(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    theirs = swap_attention(hf)
    ids = torch.arange(9) * 5 % 96
    logits = []
    for model in (ours, theirs):
        meta = build_step_metadata(CPRuntime.single(), num_new_tokens=[9], num_computed_tokens=[0])
        with cp_step(meta), torch.no_grad():
            logits.append(model(input_ids=ids[None], position_ids=meta.positions[None]).logits)
    assert torch.equal(logits[0], logits[1])


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        CheckpointIndex(tmp_path / "empty")
    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "empty" / "model.safetensors"))
    data = (tmp_path / "empty" / "model.safetensors").read_bytes()
    (tmp_path / "empty" / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        CheckpointIndex(tmp_path / "empty")

    _qwen3_moe(tmp_path / "moe")
    # 6 experts over tp=4 (4 query heads split, 2 KV heads replicated): refused before any
    # process group is needed.
    with pytest.raises(
        ValueError, match="6 routed experts cannot be split over tensor_parallel_size=4"
    ):
        load_pretrained(tmp_path / "moe", ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="device_map"):
        load_pretrained(tmp_path / "moe", ParallelConfig(tensor_parallel_size=2), device_map="auto")
