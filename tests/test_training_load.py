"""Shard-only training loads and the streaming export on gloo ranks, against one process.

A random Llama (~250 MiB fp32, untied) written by ``save_pretrained`` is loaded by
``load_for_training`` on 4 ranks under dp=2 x tp=2 (FSDP2 x TP) and dp=4 (FSDP2 alone), 4 shards
each, and exported by ``export_hf`` (several files with an index). Each rank's peak RSS growth
during the load and during the export must stay within ``checkpoint bytes / shards x 1.3 + the
largest tensor + 96 MiB`` (shards = FSDP x TP). Under dp=2 x tp=2 the logits before a step and
the step's loss must equal the one-process transformers model's (fp32, 1e-4), and the export
after one SGD step must load with ``from_pretrained`` and hold the one-process model's weights
after the same step; the dp=4 export must hold the checkpoint's. A checkpoint that does not
match its config raises the same ``ValueError`` (file, tensor, shapes) on every rank before any
collective; so does a missing directory. A tiny Qwen3-MoE (experts split over TP, then FSDP2)
loads under dp=2 x tp=2 with the one-process loss and exports its checkpoint's weights.
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


def _moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


MOE_IDS = (torch.arange(2 * SEQ).reshape(2, SEQ) * 7) % 128  # one row per dp replica


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("train_load")
    torch.manual_seed(0)
    # Tiny Qwen3-MoE (per-expert checkpoint tensors): experts split over TP, then FSDP2.
    AutoModelForCausalLM.from_config(_moe_config(), dtype=torch.float32).save_pretrained(
        str(root / "moe")
    )
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    model.save_pretrained(str(root / "llama"), max_shard_size="100MB")
    # A checkpoint whose tensor does not match its config.json.
    bad = root / "bad"
    model.save_pretrained(str(bad))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 2048
    (bad / "config.json").write_text(json.dumps(cfg))
    return root


LAYOUTS = ((2, 2), (4, 1))  # (dp, tp) on 4 ranks: FSDP2 x TP, then FSDP2 alone; 4 shards each


def _rank(rank, world_size, root, out_root):
    import transformers.models.llama.modeling_llama  # noqa: F401 - imports outside the measure

    from cp_modules import ParallelConfig
    from cp_modules.step import cp_step, restore_tokens
    from cp_modules.testing import peak_rss_growth
    from cp_modules.training import (
        export_hf,
        init_cp_training,
        lm_cross_entropy,
        load_for_training,
    )

    errors = {}
    for bad in ("missing", "bad"):
        try:
            load_for_training(root / bad, ParallelConfig(), device="cpu")
        except ValueError as e:
            errors[bad] = str(e)
    out = {"errors": errors}
    for dp, tp in LAYOUTS:
        ctx = init_cp_training(
            ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp), "cpu"
        )
        try:
            load_for_training(root / "bad", ctx, device="cpu")
        except ValueError as e:
            errors[f"bad dp={dp} tp={tp}"] = str(e)
        model, load_growth = peak_rss_growth(load_for_training, root / "llama", ctx, device="cpu")
        r = {"load": load_growth}
        if tp > 1:  # the full check under FSDP2 x TP: logits, the step's loss, the export after
            rows = _batch(dp)[ctx.dp_rank * ROWS : (ctx.dp_rank + 1) * ROWS]
            cb = ctx.shard_batch({"input_ids": rows})

            def forward(cb=cb, model=model):
                with cp_step(cb.meta):
                    ids, pos = cb.input_ids[None], cb.positions[None]
                    return model(input_ids=ids, position_ids=pos).logits[0]

            with torch.no_grad():
                logits = restore_tokens(forward(), cb.meta)
            loss = lm_cross_entropy(forward(), cb)
            loss.backward()
            torch.optim.SGD(model.parameters(), lr=LR).step()
            r["loss"] = ctx.reduce_loss(loss).item()
            # Plain lists: a tensor would travel to the parent by a file descriptor.
            r["logits"] = logits.tolist() if ctx.dp_rank == 0 and ctx.groups.tp_rank == 0 else None
        _, r["export"] = peak_rss_growth(
            export_hf, model, out_root / f"dp{dp}tp{tp}", max_shard_size="100MB"
        )
        out[(dp, tp)] = r
        del model
    ctx = init_cp_training(ParallelConfig(data_parallel_size=2, tensor_parallel_size=2), "cpu")
    model = load_for_training(root / "moe", ctx, device="cpu")
    cb = ctx.shard_batch({"input_ids": MOE_IDS[ctx.dp_rank : ctx.dp_rank + 1]})
    with cp_step(cb.meta):
        ids, pos = cb.input_ids[None], cb.positions[None]
        loss = lm_cross_entropy(model(input_ids=ids, position_ids=pos).logits[0], cb)
    out["moe_loss"] = ctx.reduce_loss(loss.detach()).item()
    export_hf(model, out_root / "moe")
    return out


def _reference(root: Path, dp: int):
    """One process: the logits of replica 0's rows, the global loss, the weights after a step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root / "llama"), dtype=torch.float32)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _batch(dp)
    with torch.no_grad():
        logits = model(ids[:ROWS]).logits.reshape(ROWS * SEQ, -1)
    out = model(ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return logits, out.loss.item(), start, model.state_dict()


def _assert_export_holds(directory: Path, state: dict) -> None:
    from transformers import AutoModelForCausalLM

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).state_dict()
    assert set(got) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, atol=1e-4, rtol=1e-4, msg=name)


def test_training_load_and_export_stay_within_the_memory_contract(checkpoints, tmp_path):
    from cp_modules.loading import CheckpointIndex

    root = checkpoints
    results = run_distributed(_rank, 4, root, tmp_path, timeout_s=600)
    with CheckpointIndex(root / "llama") as index:
        total, largest = index.total_bytes, index.largest_tensor_bytes
    limit = total / 4 * 1.3 + largest + 96 * MIB  # 4 shards in both layouts
    for dp, tp in LAYOUTS:
        for rank, out in enumerate(results):
            r = out[(dp, tp)]
            print(
                f"dp={dp} tp={tp} rank {rank}: checkpoint {total / MIB:.0f} MiB, largest "
                f"{largest / MIB:.0f} MiB; RSS growth: load {r['load'] / MIB:.0f} MiB, export "
                f"{r['export'] / MIB:.0f} MiB; limit {limit / MIB:.0f} MiB"
            )
    for out in results:
        errors = out["errors"]
        assert "does not exist" in errors["missing"], errors
        bad = [v for k, v in errors.items() if k.startswith("bad")]
        assert len(bad) == 1 + len(LAYOUTS), errors
        for e in bad:  # the file, the tensor, its shape and the config's
            assert "model.safetensors" in e and "mlp.gate_proj.weight" in e, e
            assert "(2048, 1024)" in e and "(2816, 1024)" in e, e
        for layout in LAYOUTS:
            r = out[layout]
            assert r["load"] <= limit, (layout, r["load"] / MIB, limit / MIB)
            assert r["export"] <= limit, (layout, r["export"] / MIB, limit / MIB)
    dp = LAYOUTS[0][0]
    ref_logits, ref_loss, start, stepped = _reference(root, dp)
    torch.testing.assert_close(
        torch.tensor(results[0][LAYOUTS[0]]["logits"]), ref_logits, atol=1e-4, rtol=1e-4
    )
    for out in results:
        assert abs(out[LAYOUTS[0]]["loss"] - ref_loss) < 1e-4, (out[LAYOUTS[0]]["loss"], ref_loss)
    _assert_export_holds(tmp_path / f"dp{dp}tp{LAYOUTS[0][1]}", stepped)
    _assert_export_holds(tmp_path / "dp4tp1", start)  # exported as loaded
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_pretrained(str(root / "moe"), dtype=torch.float32)
    with torch.no_grad():
        ref = moe(MOE_IDS, labels=MOE_IDS).loss.item()
    for out in results:
        assert abs(out["moe_loss"] - ref) < 1e-5, (out["moe_loss"], ref)
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe"), dtype=torch.float32)
    for name, value in moe.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name
