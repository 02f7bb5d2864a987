"""Fabric and Trainer strategies (FSDP2 over dp x pcp, TP) on 4 gloo ranks == one process.

One spawn of 4 ranks runs the training cases; the main process then replays each on one
process from the samples the ranks actually read and compares losses and parameters:

- Fabric, GQA: 2 steps under tp=2 x pcp=2, a distributed (DCP) checkpoint, then 1 step under
  dp=2 x pcp=2 after loading it (model and optimizer resharded across layouts).
- Fabric, MLA: 2 steps under dp=2 x pcp=2 (sampler and loss normalisation over dp), saved as
  one full-tensor safetensors file (``save_distributed_checkpoint=False``).
- Trainer, MLA: 2 steps under tp=2 x pcp=2, a DCP checkpoint, then ``fit(ckpt_path=...)``
  under dp=2 x pcp=2 for one more step.
- Trainer, GQA: 2 steps under dp=2 x pcp=2.
- transformers export: a tiny Llama (from a config, offline) swapped with ``swap_attention``,
  trained 2 steps under tp=2 x pcp=2 with FSDP2, exported with ``export_hf``; plain
  transformers loads it and its logits equal the trained model's and a one-process run's.

Sequences of 13 tokens do not divide into 2*pcp chunks, so DualChunkSwap padding is exercised.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from cp_modules.config import ParallelConfig
from cp_modules.models import TinyLM, TinyLMConfig, parallelize_model
from cp_modules.modules import cp_step
from cp_modules.testing import run_distributed
from cp_modules.training import (
    CPTrainingContext,
    apply_fsdp,
    export_hf,
    init_cp_training,
    lm_cross_entropy,
    read_checkpoint,
)

pytestmark = pytest.mark.distributed

SEQ_LEN = 13
BATCH = 3  # sequences per dp replica
NUM_SAMPLES = 12
LR = 0.5
MODEL_SEED = 1234
RTOL, ATOL = 1e-5, 1e-6


class _Tokens(Dataset):
    """Deterministic random byte sequences (input, next-token labels, sample index)."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, 256, (NUM_SAMPLES, SEQ_LEN + 1), generator=g)

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, i):
        w = self.data[i]
        return {"input_ids": w[:-1], "labels": w[1:], "index": torch.tensor(i)}


def _model_config(attention):
    return TinyLMConfig(attention=attention)


def _new_model(attention, seed=MODEL_SEED):
    torch.manual_seed(seed)
    return TinyLM(_model_config(attention))


def _optimizer(params):
    # SGD with momentum: its state (momentum buffers) must survive a change of layout too.
    # Adam is left out of the equality checks: on its first step it divides a gradient by its
    # own magnitude, so fp32 summation-order noise in near-zero gradients becomes an O(lr)
    # update difference regardless of how exact the parallel run is.
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)


def _full_params(model, prefix=""):
    """Full parameter tensors by name (a collective for TP-sharded ones: every rank calls)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name[len(prefix) :] if name.startswith(prefix) else name] = t.detach().clone()
    return out


def _layout(tp=1, pcp=1, dp=1):
    return ParallelConfig(
        tensor_parallel_size=tp, prefill_context_parallel_size=pcp, data_parallel_size=dp
    )


# ---- Fabric -----------------------------------------------------------------------------


def _fabric_run(config, attention, steps, *, seed=MODEL_SEED, save=None, load=None, dcp=True):
    from cp_modules.integrations.lightning import CPFabricStrategy

    strategy = CPFabricStrategy(config, parallelize_model, save_distributed_checkpoint=dcp)
    fabric = L.Fabric(accelerator="cpu", devices=config.world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_new_model(attention, seed))
    optimizer = fabric.setup_optimizers(_optimizer(model.parameters()))
    if load is not None:
        rest = fabric.load(load, {"model": model, "optimizer": optimizer})
        assert rest == {"step": 2}, rest
    loader = fabric.setup_dataloaders(DataLoader(_Tokens(), batch_size=BATCH, shuffle=True))
    seen, losses, params = [], [], []
    for _, batch in zip(range(steps), loader):
        seen.append(batch["index"].tolist())
        cb = strategy.shard_batch(batch)
        with cp_step(cb.meta):
            loss = lm_cross_entropy(model(cb.input_ids, cb.positions), cb)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(strategy.reduce_loss(loss).item())
        params.append(_full_params(model.module))
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer, "step": steps})
    return {"seen": seen, "losses": losses, "params": params, "dp_rank": strategy.cp.dp_rank}


# ---- Trainer ----------------------------------------------------------------------------


class LitLM(L.LightningModule):
    """A TinyLM whose training step records what each rank saw and the global loss."""

    def __init__(self, attention, seed=MODEL_SEED):
        super().__init__()
        self.model = _new_model(attention, seed)
        self.seen, self.losses, self.params = [], [], []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.extra["index"].tolist())
        loss = lm_cross_entropy(self.model(batch.input_ids, batch.positions), batch)
        self.losses.append(self.trainer.strategy.reduce_loss(loss).item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.params.append(_full_params(self.model))

    def configure_optimizers(self):
        return _optimizer(self.parameters())


def _trainer_run(config, attention, max_steps, *, seed=MODEL_SEED, save=None, ckpt_path=None):
    from cp_modules.integrations.lightning import CPTrainerStrategy

    lit = LitLM(attention, seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=config.world_size,
        strategy=CPTrainerStrategy(config, parallelize_model),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(lit, DataLoader(_Tokens(), batch_size=BATCH, shuffle=True), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return {
        "seen": lit.seen,
        "losses": lit.losses,
        "params": lit.params,
        "dp_rank": trainer.strategy.cp.dp_rank,
        "global_step": trainer.global_step,
    }


def _lightning_cases(rank, world_size, tmpdir):
    torch.manual_seed(0)
    fabric_ckpt = os.path.join(tmpdir, "fabric_dcp")
    fabric_full = os.path.join(tmpdir, "fabric.safetensors")
    trainer_ckpt = os.path.join(tmpdir, "trainer_dcp")
    out = {
        "fabric_gqa_a": _fabric_run(_layout(tp=2, pcp=2), "gqa", 2, save=fabric_ckpt),
        # A different seed: every weight must come from the checkpoint.
        "fabric_gqa_b": _fabric_run(_layout(dp=2, pcp=2), "gqa", 1, seed=99, load=fabric_ckpt),
        "fabric_mla_dp": _fabric_run(_layout(dp=2, pcp=2), "mla", 2, save=fabric_full, dcp=False),
        "trainer_mla_a": _trainer_run(_layout(tp=2, pcp=2), "mla", 2, save=trainer_ckpt),
        "trainer_mla_b": _trainer_run(
            _layout(dp=2, pcp=2), "mla", 3, seed=99, ckpt_path=trainer_ckpt
        ),
        "trainer_gqa_dp": _trainer_run(_layout(dp=2, pcp=2), "gqa", 2),
    }
    for r in out.values():
        # Rank 0's copy is enough (every rank gathers the same tensors). Sent as numpy: the
        # result queue would share tensor storage with a process that is about to exit.
        r["params"] = (
            [{k: v.numpy() for k, v in p.items()} for p in r["params"]] if rank == 0 else None
        )
    out["hf"] = _hf_export_case(rank, tmpdir)
    out["mixed_precision"] = _mixed_precision_case(rank)
    return out


# ---- transformers export ----------------------------------------------------------------

HF_STEPS = 2


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _hf_batches():
    data = _Tokens()
    return [
        {
            k: torch.stack([data[i][k] for i in range(s * BATCH, (s + 1) * BATCH)])
            for k in ("input_ids", "labels")
        }
        for s in range(HF_STEPS)
    ]


def _hf_eval_ids():
    return _Tokens().data[-2:, :-1]


def _hf_local_logits(model, cb):
    with cp_step(cb.meta):
        out = model(input_ids=cb.input_ids[None], position_ids=cb.positions[None])
        return out.logits.squeeze(0)


def _hf_train(ctx, model):
    """HF_STEPS steps on fixed batches; then the logits [B*S, V] of the eval sequences."""
    from cp_modules.modules import restore_tokens

    optimizer = _optimizer(model.parameters())
    for batch in _hf_batches():
        cb = ctx.shard_batch(batch)
        lm_cross_entropy(_hf_local_logits(model, cb), cb).backward()
        optimizer.step()
        optimizer.zero_grad()
    cb = ctx.shard_batch({"input_ids": _hf_eval_ids()})
    with torch.no_grad():
        return restore_tokens(_hf_local_logits(model, cb), cb.meta)


def _hf_export_case(rank, tmpdir):
    from cp_modules import swap_attention

    ctx = init_cp_training(_layout(tp=2, pcp=2), "cpu")
    model = apply_fsdp(swap_attention(_hf_model(), ctx.groups), ctx.mesh)
    logits = _hf_train(ctx, model)
    export_hf(model, os.path.join(tmpdir, "hf"))
    # The deprecated hand-written sum refuses FSDP2 parameters (it would sum them twice).
    with (
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(ValueError, match="already summed"),
    ):
        warnings.simplefilter("always")
        ctx.reduce_gradients(model.parameters())
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    return logits.numpy() if rank == 0 else None


def _mixed_precision_case(rank):
    """FSDP2's policy: compute in bf16, fp32 parameters and fp32 gradient reduction."""
    from cp_modules.training import mixed_precision_policy

    ctx = init_cp_training(_layout(dp=2, pcp=2), "cpu")
    model = apply_fsdp(
        _new_model("gqa"), ctx.mesh, mp_policy=mixed_precision_policy(torch.bfloat16, torch.float32)
    )
    batch = {
        k: torch.stack([_Tokens()[i][k] for i in range(BATCH)]) for k in ("input_ids", "labels")
    }
    cb = ctx.shard_batch(batch)
    with cp_step(cb.meta):
        logits = model(cb.input_ids, cb.positions)
    loss = lm_cross_entropy(logits, cb)
    loss.backward()
    assert apply_fsdp(model, ctx.mesh) is model  # applied once
    from torch.distributed.fsdp import fully_shard

    own = fully_shard(_new_model("gqa"), mesh=ctx.mesh["dp"])  # would average over dp only
    with pytest.raises(ValueError, match="already holds fully_shard modules"):
        apply_fsdp(own, ctx.mesh)
    return {
        "logits_dtype": str(logits.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "loss": ctx.reduce_loss(loss).item(),
    }


# ---- the one-process replay -------------------------------------------------------------


def _global_batches(per_rank, dp_ranks):
    """Global batch of each step: the samples of dp replica 0, then replica 1, ..."""
    first_of_replica = {}
    for r, dp_rank in enumerate(dp_ranks):
        first_of_replica.setdefault(dp_rank, r)
    data = _Tokens()
    steps = len(per_rank[0]["seen"])
    batches = []
    for s in range(steps):
        idx = [
            i for d in sorted(first_of_replica) for i in per_rank[first_of_replica[d]]["seen"][s]
        ]
        samples = [data[i] for i in idx]
        batches.append({k: torch.stack([x[k] for x in samples]) for k in ("input_ids", "labels")})
    return batches


def _replay(attention, batches):
    """One process: losses and parameters after each step on the given global batches."""
    ctx = CPTrainingContext.single()
    model = _new_model(attention)
    optimizer = _optimizer(model.parameters())
    losses, params = [], []
    for batch in batches:
        cb = ctx.shard_batch(batch)
        with cp_step(cb.meta):
            loss = lm_cross_entropy(model(cb.input_ids, cb.positions), cb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        params.append(_full_params(model))
    return model, losses, params


def _assert_params_close(got, want, what):
    assert sorted(got) == sorted(want), what
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def _max_rel_err(got, want):
    return max(
        float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want
    )


def _check_run(results, name, attention, *, expect_steps, prefix_runs=()):
    """Compare the ranks' run ``name`` (continuing ``prefix_runs``) with the one-process replay."""
    runs = [*prefix_runs, name]
    per_rank_runs = [[r[k] for r in results] for k in runs]
    batches = []
    for per_rank in per_rank_runs:
        batches += _global_batches(per_rank, [r["dp_rank"] for r in per_rank])
    losses = [x for per_rank in per_rank_runs for x in per_rank[0]["losses"]]
    params = [
        {k: torch.from_numpy(v) for k, v in p.items()}
        for k_run in runs
        for p in results[0][k_run]["params"]
    ]
    assert len(losses) == len(batches) == expect_steps, (name, len(losses), len(batches))
    _, ref_losses, ref_params = _replay(attention, batches)
    for per_rank in per_rank_runs:
        for r in per_rank:  # every rank reports the same global loss
            assert r["losses"] == per_rank[0]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for step, (got, want) in enumerate(zip(params, ref_params)):
        _assert_params_close(got, want, f"{name} step {step + 1}")
    return {
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_rel_err": max(_max_rel_err(g, w) for g, w in zip(params, ref_params)),
    }


def _check_sampler(per_rank, dp):
    """Ranks of one dp replica read the same samples; replicas read disjoint ones."""
    by_replica = {}
    for r in per_rank:
        by_replica.setdefault(r["dp_rank"], []).append(r["seen"])
    assert sorted(by_replica) == list(range(dp))
    for seen in by_replica.values():
        assert all(s == seen[0] for s in seen)
    for step in range(len(per_rank[0]["seen"])):
        sets = [set(by_replica[d][0][step]) for d in range(dp)]
        assert all(len(s) == BATCH for s in sets)
        assert len(set.union(*sets)) == BATCH * dp  # different samples across replicas


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("lightning"))
    results = run_distributed(_lightning_cases, 4, tmpdir, timeout_s=900, collective_timeout_s=120)
    return results, tmpdir


def _read_dcp(directory, tmpdir):
    """A DCP directory's tensors on one process (through torch's converter, weights only)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tmpdir, os.path.basename(directory) + ".pt")
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=True)


def test_fabric_steps_and_cross_layout_checkpoint_match_one_process(lightning_results):
    results, tmpdir = lightning_results
    err = _check_run(results, "fabric_gqa_b", "gqa", expect_steps=3, prefix_runs=("fabric_gqa_a",))
    print("fabric gqa tp2pcp2 -> dp2pcp2:", err)
    # The DCP checkpoint (saved under tp2 x pcp2 with FSDP2) holds the step-2 weights.
    ckpt = _read_dcp(os.path.join(tmpdir, "fabric_dcp"), tmpdir)
    model = _new_model("gqa", seed=5)
    model.load_state_dict(ckpt["model"])
    for name, p in model.named_parameters():
        assert torch.equal(p, torch.from_numpy(results[0]["fabric_gqa_a"]["params"][1][name])), name


def test_fabric_dp2_pcp2_matches_one_process_and_full_checkpoint(lightning_results):
    results, tmpdir = lightning_results
    _check_sampler([r["fabric_mla_dp"] for r in results], dp=2)
    print("fabric mla dp2pcp2:", _check_run(results, "fabric_mla_dp", "mla", expect_steps=2))
    # save_distributed_checkpoint=False: one safetensors file of full tensors.
    ckpt = read_checkpoint(os.path.join(tmpdir, "fabric.safetensors"))
    assert ckpt["step"] == 2
    model = _new_model("mla", seed=5)
    model.load_state_dict(ckpt["model"])
    for name, p in model.named_parameters():
        assert torch.equal(p, torch.from_numpy(results[0]["fabric_mla_dp"]["params"][1][name])), (
            name
        )


def test_trainer_steps_and_cross_layout_resume_match_one_process(lightning_results):
    results, tmpdir = lightning_results
    assert all(r["trainer_mla_b"]["global_step"] == 3 for r in results)
    err = _check_run(
        results, "trainer_mla_b", "mla", expect_steps=3, prefix_runs=("trainer_mla_a",)
    )
    print("trainer mla tp2pcp2 -> dp2pcp2:", err)
    ckpt = _read_dcp(os.path.join(tmpdir, "trainer_dcp"), tmpdir)
    model = _new_model("mla", seed=5)
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    for name, p in model.named_parameters():
        assert torch.equal(p, torch.from_numpy(results[0]["trainer_mla_a"]["params"][1][name])), (
            name
        )


def test_trainer_dp2_pcp2_matches_one_process_and_samples_per_replica(lightning_results):
    results, _ = lightning_results
    _check_sampler([r["trainer_gqa_dp"] for r in results], dp=2)
    print("trainer gqa dp2pcp2:", _check_run(results, "trainer_gqa_dp", "gqa", expect_steps=2))


def test_hf_export_loads_in_plain_transformers_with_the_trained_logits(lightning_results):
    from transformers import AutoModelForCausalLM

    from cp_modules import swap_attention
    from cp_modules.modules.hf_attention import CP_ATTN_IMPLEMENTATION

    results, tmpdir = lightning_results
    trained = torch.from_numpy(results[0]["hf"])
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(tmpdir, "hf"), dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config._attn_implementation != CP_ATTN_IMPLEMENTATION  # a plain transformers model
    with torch.no_grad():
        logits = hf(input_ids=_hf_eval_ids()).logits.reshape(-1, hf.config.vocab_size)
    torch.testing.assert_close(logits, trained, rtol=RTOL, atol=ATOL)
    # The same training on one process: the export holds its weights.
    ref = swap_attention(_hf_model())
    ref_logits = _hf_train(CPTrainingContext.single(), ref)
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            hf.get_parameter(name), p.detach(), rtol=RTOL, atol=ATOL, msg=name
        )
    # Training moved the weights (the comparison is not of two untrained models).
    assert not torch.equal(hf.lm_head.weight, _hf_model().lm_head.weight)


def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_state(lightning_results):
    results, _ = lightning_results
    got = results[0]["mixed_precision"]
    assert got["logits_dtype"] == "torch.bfloat16"
    assert got["param_dtypes"] == ["torch.float32"] and got["grad_dtypes"] == ["torch.float32"]
    assert all(r["mixed_precision"]["loss"] == got["loss"] for r in results)
    # The loss of the same batch in fp32 on one process, to bf16 precision (8 mantissa bits
    # through two layers: a relative error of a few 2^-8).
    batch = {
        k: torch.stack([_Tokens()[i][k] for i in range(BATCH)]) for k in ("input_ids", "labels")
    }
    ctx = CPTrainingContext.single()
    cb = ctx.shard_batch(batch)
    with cp_step(cb.meta), torch.no_grad():
        ref = lm_cross_entropy(_new_model("gqa")(cb.input_ids, cb.positions), cb).item()
    assert abs(got["loss"] - ref) <= 4 * 2**-8 * abs(ref)
