"""Training pieces on one process: batch sharding, loss, dataset, safe checkpoints, argument checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from cp_modules.config import ParallelConfig
from cp_modules.models import TinyLM, TinyLMConfig
from cp_modules.modules import cp_step
from cp_modules.training import (
    IGNORE_INDEX,
    ByteTextDataset,
    CheckpointFormatError,
    CPTrainingContext,
    full_model_state_dict,
    full_optimizer_state_dict,
    lm_cross_entropy,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    read_checkpoint,
    write_checkpoint,
)

CORPUS = Path(__file__).parent.parent / "recipes" / "data" / "tiny_corpus.txt"


# ---- batches and loss ----------------------------------------------------------------------


def test_shard_batch_single_process_keeps_every_token_and_shifts_labels():
    ids = torch.arange(2 * 6).view(2, 6)
    cb = CPTrainingContext.single().shard_batch({"input_ids": ids, "index": torch.tensor([3, 4])})
    assert torch.equal(cb.input_ids, ids.reshape(-1))
    assert torch.equal(cb.positions, torch.arange(6).repeat(2))
    want = torch.tensor([1, 2, 3, 4, 5, IGNORE_INDEX, 7, 8, 9, 10, 11, IGNORE_INDEX])
    assert torch.equal(cb.labels, want)
    assert cb.num_global_tokens.item() == 10
    assert cb.num_sequences == 2 and torch.equal(cb.extra["index"], torch.tensor([3, 4]))


def test_lm_cross_entropy_is_the_mean_over_labelled_tokens():
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(num_layers=1))
    ids = torch.randint(0, 256, (3, 7))
    labels = torch.randint(0, 256, (3, 7))
    labels[0, :2] = IGNORE_INDEX
    cb = CPTrainingContext.single().shard_batch({"input_ids": ids, "labels": labels})
    with cp_step(cb.meta):
        logits = model(cb.input_ids, cb.positions)
    loss = lm_cross_entropy(logits, cb)
    # One rank keeps each row whole (no padding; with pcp > 1 odd lengths are padded to a
    # multiple of 2 * pcp and padding slots carry no label: test_packed_documents.py).
    valid = cb.meta.plan.local_valid
    assert bool(valid.all()) and cb.input_ids.shape[0] == ids.numel()
    real_labels = labels.reshape(-1)[cb.meta.token_indices[valid]]
    want = torch.nn.functional.cross_entropy(logits[valid], real_labels, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "batch, match",
    [
        ({"ids": torch.zeros(2, 3, dtype=torch.long)}, "mapping with 'input_ids'"),
        ((torch.zeros(2, 3, dtype=torch.long),), "mapping with 'input_ids'"),
        ({"input_ids": torch.zeros(6, dtype=torch.long)}, r"integer tensor \[B, S\]"),
        ({"input_ids": torch.zeros(2, 3)}, r"integer tensor \[B, S\]"),
        (
            {
                "input_ids": torch.zeros(2, 3, dtype=torch.long),
                "labels": torch.zeros(2, 4, dtype=torch.long),
            },
            r"batch\['labels'\] must have the shape of input_ids \(2, 3\)",
        ),
    ],
    ids=["no-input_ids", "tuple", "1d", "float", "labels-shape"],
)
def test_shard_batch_rejects_bad_batches(batch, match):
    with pytest.raises(ValueError, match=match):
        CPTrainingContext.single().shard_batch(batch)


def test_byte_dataset_windows_and_errors(tmp_path):
    ds = ByteTextDataset(CORPUS, 64)
    data = CORPUS.read_bytes()
    assert len(ds) == (len(data) - 1) // 64
    s = ds[3]
    assert s["input_ids"].tolist() == list(data[192:256])
    assert s["labels"].tolist() == list(data[193:257])
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        ByteTextDataset(CORPUS, 0)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="holds 3 bytes; seq_len=8 needs at least 9"):
        ByteTextDataset(short, 8)


def test_tiny_lm_config_validation():
    with pytest.raises(ValueError, match=r"attention must be one of \['gqa', 'mla'\], got 'mha'"):
        TinyLMConfig(attention="mha")
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1, got 0"):
        TinyLMConfig(num_layers=0)


# ---- checkpoints ---------------------------------------------------------------------------


def test_checkpoint_roundtrip_of_nested_state(tmp_path):
    state = {
        "w": torch.randn(3, 4),
        "nested": {
            "step": 7,
            "lr": 1e-3,
            "name": "run",
            "none": None,
            "flag": True,
            "betas": (0.9, 0.999),
            "inf": float("inf"),
            "ints": {0: torch.ones(2), 5: "x"},
        },
        "list": [torch.zeros(0), torch.tensor(3.5), [1, 2]],
    }
    state["tied"] = state["w"]  # shared storage must not break the writer
    path = tmp_path / "c.safetensors"
    write_checkpoint(path, state)
    got = read_checkpoint(path)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["tied"], state["w"])
    n = got["nested"]
    assert (n["step"], n["lr"], n["name"], n["none"], n["flag"]) == (7, 1e-3, "run", None, True)
    assert n["betas"] == (0.9, 0.999) and isinstance(n["betas"], tuple) and n["inf"] == float("inf")
    assert torch.equal(n["ints"][0], torch.ones(2)) and n["ints"][5] == "x"
    assert (
        got["list"][0].shape == (0,) and got["list"][1].item() == 3.5 and got["list"][2] == [1, 2]
    )


def test_checkpoint_writer_refuses_objects_it_cannot_store_safely(tmp_path):
    with pytest.raises(
        CheckpointFormatError, match=r"'a.b' is a PosixPath, which a checkpoint cannot hold"
    ):
        write_checkpoint(tmp_path / "c.safetensors", {"a": {"b": Path("x")}})
    assert not (tmp_path / "c.safetensors").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what an attacker's pickle would run on load
        return (Path.touch, (Path(self.marker),))


def test_loading_refuses_a_pickle_of_arbitrary_objects(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": _Payload(str(marker))}, evil)
    with pytest.raises(ValueError, match="refusing to unpickle arbitrary objects"):
        read_checkpoint(evil)
    assert not marker.exists()
    # A tensors-only torch.save file is fine (weights_only=True accepts it).
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "step": 3}, plain)
    assert read_checkpoint(plain)["step"] == 3
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(os.urandom(64))
    with pytest.raises(ValueError, match="neither a safetensors checkpoint"):
        read_checkpoint(garbage)


def test_lightning_checkpoint_io_refuses_pickles_and_weights_only_false(tmp_path):
    from cp_modules.integrations.lightning import SafeCheckpointIO

    io = SafeCheckpointIO()
    evil = tmp_path / "evil.ckpt"
    torch.save({"x": _Payload(str(tmp_path / "ran"))}, evil)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        io.load_checkpoint(evil)
    with pytest.raises(ValueError, match="weights_only=False is not supported"):
        io.load_checkpoint(evil, weights_only=False)
    assert not (tmp_path / "ran").exists()


def test_model_and_optimizer_state_roundtrip_single_process(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(attention="mla", num_layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    write_checkpoint(
        tmp_path / "c.safetensors",
        {
            "model": full_model_state_dict(model),
            "optimizer": full_optimizer_state_dict(model, opt),
        },
    )
    ckpt = read_checkpoint(tmp_path / "c.safetensors")
    torch.manual_seed(1)
    model2 = TinyLM(TinyLMConfig(attention="mla", num_layers=1))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    load_full_model_state_dict(model2, ckpt["model"])
    load_full_optimizer_state_dict(model2, opt2, ckpt["optimizer"])
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"][0]["lr"] == 1e-3
    for i in s1["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)


# ---- strategy arguments (checked before any process starts) ---------------------------------


@pytest.mark.parametrize("kind", ["fabric", "trainer"])
def test_strategies_reject_bad_arguments(kind):
    import lightning as L

    from cp_modules.integrations.lightning import CPFabricStrategy, CPTrainerStrategy

    cls = CPFabricStrategy if kind == "fabric" else CPTrainerStrategy
    with pytest.raises(
        ValueError, match="parallel_config must be a cp_modules.ParallelConfig, got dict"
    ):
        cls({"tp": 2})
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=2 is not supported for training; valid: 1"
    ):
        cls(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(
        ValueError, match=r"start_method must be one of \['subprocess', 'spawn'\], got 'fork'"
    ):
        cls(ParallelConfig(), start_method="fork")
    strategy = cls(ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2))
    match = r"devices=2 x num_nodes=1 = 2 processes, but the parallel config needs dp\*pp\*pcp\*tp = 1\*1\*2\*2 = 4"
    with pytest.raises(ValueError, match=match):
        if kind == "fabric":
            L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        else:
            L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)


# ---- FSDP2 units, the deprecated gradient sum, the transformers export ---------------------


def test_apply_fsdp_units_are_the_blocks_then_the_roots():
    import lightning as L

    from cp_modules.training.fsdp import _blocks, _roots

    model = TinyLM(TinyLMConfig(num_layers=2))
    assert _blocks(model) == list(model.layers)
    assert _roots(model) == [model]

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.no_params = torch.nn.ReLU()

    assert _roots(Lit()) == [model]  # its own forward is not what training_step calls

    class LitWithOwnParameter(Lit):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

    with pytest.raises(ValueError, match="holds parameters directly"):
        _roots(LitWithOwnParameter())


def test_reduce_gradients_is_deprecated():
    model = TinyLM(TinyLMConfig(num_layers=1))
    with pytest.deprecated_call(match="apply_fsdp"):
        CPTrainingContext.single().reduce_gradients(model.parameters())


def test_export_hf_of_a_tiny_lm_loads_as_llama_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from cp_modules.modules import restore_tokens
    from cp_modules.training import export_hf

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(attention="gqa", num_layers=2))
    export_hf(model, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    cb = CPTrainingContext.single().shard_batch({"input_ids": ids})
    with cp_step(cb.meta), torch.no_grad():
        want = restore_tokens(model(cb.input_ids, cb.positions), cb.meta)
        got = hf(input_ids=ids).logits.reshape(-1, 256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_export_hf_refuses_models_it_cannot_map(tmp_path):
    from cp_modules.training import export_hf

    with pytest.raises(ValueError, match="needs a transformers config"):
        export_hf(TinyLM(TinyLMConfig(attention="mla", num_layers=1)), tmp_path / "mla")
    with pytest.raises(ValueError, match="qkv_bias=True"):
        export_hf(TinyLM(TinyLMConfig(qkv_bias=True, num_layers=1)), tmp_path / "bias")
    assert not (tmp_path / "mla").exists() and not (tmp_path / "bias").exists()


def test_export_hf_splits_files_as_save_pretrained_and_loads(tmp_path):
    # Past max_shard_size: save_pretrained's file names, split and index; a tied head is
    # written once; an earlier export's files the new one does not use are removed.
    from transformers import AutoModelForCausalLM, LlamaConfig

    from cp_modules.training import export_hf

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    export_hf(model, tmp_path / "one")
    export_hf(model, tmp_path / "one", max_shard_size="100KB")
    model.save_pretrained(str(tmp_path / "sp"), max_shard_size="100KB")
    ours = json.loads((tmp_path / "one" / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "sp" / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert "lm_head.weight" not in ours["weight_map"]
    files = sorted(f for f in os.listdir(tmp_path / "one") if f.endswith(".safetensors"))
    assert files == sorted(set(theirs["weight_map"].values())) and len(files) > 1
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "one", dtype=torch.float32)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name


def test_export_hf_of_fused_experts_loads_in_transformers(tmp_path):
    # The model's fused expert tensors are written as they are; from_pretrained loads them.
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from cp_modules.training import export_hf

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    export_hf(model, tmp_path / "moe")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).state_dict()
    assert any("experts" in name for name in got)
    for name, value in model.state_dict().items():
        assert torch.equal(got[name], value), name
