"""Shard-only training loads and the streaming export on gloo ranks, against one process.

A random Llama (~250 MiB fp32, untied) written by ``save_pretrained`` is loaded by
``load_for_training`` under dp=2 (FSDP2 over 2 ranks) and dp=2 x tp=2 (FSDP2 x TP, 4 shards),
one SGD step is taken and the model is exported by ``export_hf`` (several files with an index).
Each rank's peak RSS growth during the load and during the export must stay within
``checkpoint bytes / shards x 1.3 + the largest tensor + 96 MiB`` (shards = FSDP x TP); the
logits before the step and the step's loss must equal the one-process transformers model's
(fp32, 1e-4), and the export must load with ``from_pretrained`` and hold the one-process
model's weights after the same step. Bad checkpoints raise the same ``ValueError`` on every
rank before any collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cp_modules.testing import run_distributed

pytestmark = pytest.mark.distributed

MIB = 2**20
ROWS, SEQ = 2, 16  # per dp replica
LR = 0.5


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip


def _batch(dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 8192, (dp * ROWS, SEQ), generator=g)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("train_load")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    model.save_pretrained(str(root / "llama"), max_shard_size="100MB")
    # A checkpoint whose tensor does not match its config.json.
    bad = root / "bad"
    model.save_pretrained(str(bad))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 2048
    (bad / "config.json").write_text(json.dumps(cfg))
    return root


def _rank(rank, world_size, root, dp, tp, out_dir):
    import transformers.models.llama.modeling_llama  # noqa: F401 - imports outside the measure

    from cp_modules import ParallelConfig
    from cp_modules.step import restore_tokens
    from cp_modules.testing import peak_rss_growth
    from cp_modules.training import (
        export_hf,
        init_cp_training,
        lm_cross_entropy,
        load_for_training,
    )
    from cp_modules.step import cp_step

    errors = {}
    for bad in ("missing", "bad"):
        try:
            load_for_training(root / bad, ParallelConfig(), device="cpu")
        except ValueError as e:
            errors[bad] = str(e)
    ctx = init_cp_training(ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp), "cpu")
    try:
        load_for_training(root / "bad", ctx, device="cpu")
    except ValueError as e:
        errors["bad_distributed"] = str(e)
    model, load_growth = peak_rss_growth(load_for_training, root / "llama", ctx, device="cpu")
    rows = _batch(dp)[ctx.dp_rank * ROWS : (ctx.dp_rank + 1) * ROWS]
    cb = ctx.shard_batch({"input_ids": rows})

    def forward():
        with cp_step(cb.meta):
            return model(input_ids=cb.input_ids[None], position_ids=cb.positions[None]).logits[0]

    with torch.no_grad():
        logits = restore_tokens(forward(), cb.meta)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss = lm_cross_entropy(forward(), cb)
    loss.backward()
    optimizer.step()
    global_loss = ctx.reduce_loss(loss).item()
    _, export_growth = peak_rss_growth(export_hf, model, out_dir, max_shard_size="100MB")
    return {
        "errors": errors,
        "load": load_growth,
        "export": export_growth,
        "loss": global_loss,
        # Plain lists: a tensor would travel to the parent by a file descriptor of this process.
        "logits": logits.tolist() if ctx.dp_rank == 0 and ctx.groups.tp_rank == 0 else None,
    }


def _reference(root: Path, dp: int):
    """One process: the logits of replica 0's rows, the global loss, the weights after a step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root / "llama"), dtype=torch.float32)
    ids = _batch(dp)
    with torch.no_grad():
        logits = model(ids[:ROWS]).logits.reshape(ROWS * SEQ, -1)
    out = model(ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return logits, out.loss.item(), model.state_dict()


@pytest.mark.parametrize("dp,tp", [(2, 1), (2, 2)])
def test_training_load_and_export_stay_within_the_memory_contract(checkpoints, tmp_path, dp, tp):
    from transformers import AutoModelForCausalLM

    from cp_modules.loading import CheckpointIndex

    root = checkpoints
    out_dir = tmp_path / "export"
    results = run_distributed(_rank, dp * tp, root, dp, tp, out_dir, timeout_s=600)
    with CheckpointIndex(root / "llama") as index:
        total, largest = index.total_bytes, index.largest_tensor_bytes
    limit = total / (dp * tp) * 1.3 + largest + 96 * MIB
    for rank, r in enumerate(results):
        print(
            f"dp={dp} tp={tp} rank {rank}: checkpoint {total / MIB:.0f} MiB, largest "
            f"{largest / MIB:.0f} MiB; RSS growth: load {r['load'] / MIB:.0f} MiB, export "
            f"{r['export'] / MIB:.0f} MiB; limit {limit / MIB:.0f} MiB"
        )
    for r in results:
        assert r["load"] <= limit, (r["load"] / MIB, limit / MIB)
        assert r["export"] <= limit, (r["export"] / MIB, limit / MIB)
        assert "does not exist" in r["errors"]["missing"]
        for key in ("bad", "bad_distributed"):
            assert "mlp.gate_proj.weight" in r["errors"][key], r["errors"][key]
            assert "model-0000" not in r["errors"][key] or ".safetensors" in r["errors"][key]
    ref_logits, ref_loss, ref_state = _reference(root, dp)
    torch.testing.assert_close(
        torch.tensor(results[0]["logits"]), ref_logits, atol=1e-4, rtol=1e-4
    )
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-4, (r["loss"], ref_loss)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    got = exported.state_dict()
    assert set(got) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(got[name], value, atol=1e-4, rtol=1e-4, msg=name)
