"""Packed documents (transformers' flattening convention) in CPTrainingContext.shard_batch.

A row whose ``position_ids`` restart at 0 holds several documents; each is a PCP segment of its
own, no query attends another document, and a document's last token has no target. Through a
swapped HF Llama and an MLA model (DeepSeek-V3) on gloo ranks (pcp 2 and 4, tp 2 once, dp 2 once), the
loss and every parameter gradient equal one process running each document alone (float64).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cp_modules.config import ParallelConfig
from cp_modules.step import cp_step
from cp_modules.testing import run_distributed
from cp_modules.training import IGNORE_INDEX, CPTrainingContext, lm_cross_entropy
from cp_modules.training.context import document_lengths

# Two packed rows of 24 tokens: documents of 9, 3, 12 and 1, 16, 7.
DOCS = [[9, 3, 12], [1, 16, 7]]
VOCAB = 64


def _packed_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (len(DOCS), sum(DOCS[0])), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return {"input_ids": ids, "position_ids": pos}


def test_document_lengths_follow_position_resets():
    b = _packed_batch()
    assert document_lengths(b["input_ids"].shape, b["position_ids"]).tolist() == [
        9,
        3,
        12,
        1,
        16,
        7,
    ]
    assert document_lengths((2, 5), None).tolist() == [5, 5]


@pytest.mark.parametrize(
    "pos, match",
    [
        ([[1, 2, 3, 4]], r"row 0 starts at 1 \(index 0\)"),
        ([[0, 1, 2, 3], [0, 1, 3, 4]], r"row 1 index 2: 1 -> 3"),
        ([[0, 1, 0, 0], [0, 1, 1, 2]], r"row 1 index 2: 1 -> 1"),
    ],
)
def test_malformed_position_ids_name_the_row_and_index(pos, match):
    pos = torch.tensor(pos)
    with pytest.raises(ValueError, match=match):
        CPTrainingContext.single().shard_batch(
            {"input_ids": torch.zeros_like(pos), "position_ids": pos}
        )


def test_packed_labels_stop_at_document_ends():
    b = _packed_batch()
    cb = CPTrainingContext.single().shard_batch(b)
    ids = b["input_ids"].reshape(-1)
    want = torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)])
    ends = torch.tensor([9, 12, 24, 25, 41, 48]) - 1
    want[ends] = IGNORE_INDEX
    order, valid = cb.meta.token_indices, cb.meta.plan.local_valid
    assert torch.equal(cb.labels, want[order].masked_fill(~valid, IGNORE_INDEX))
    assert torch.equal(cb.positions[valid], b["position_ids"].reshape(-1)[order][valid])
    assert int(cb.num_global_tokens) == 48 - 6
    # Explicit labels are the targets as given (a document's last token may have one).
    labels = torch.arange(48).view(2, 24)
    cb = CPTrainingContext.single().shard_batch({**b, "labels": labels})
    assert torch.equal(cb.labels, labels.reshape(-1)[order].masked_fill(~valid, IGNORE_INDEX))


def _model(family):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    if family == "llama":
        cfg, cls = tf.LlamaConfig(num_key_value_heads=2, **common), tf.LlamaForCausalLM
    else:
        mla = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                   n_group=1, topk_group=1, first_k_dense_replace=2, q_lora_rank=16)  # fmt: skip
        cfg, cls = tf.DeepseekV3Config(**mla, **common), tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(cfg)).double()


def _documents_alone(family):
    """Loss and gradients of one process running every document alone (the reference)."""
    model = _model(family)
    ids = _packed_batch()["input_ids"].reshape(-1)
    total, count, start = 0.0, 0, 0
    for n in (n for row in DOCS for n in row):
        doc = ids[start : start + n]
        start += n
        logits = model(input_ids=doc[None]).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum")
        count += n - 1
    loss = total / count
    loss.backward()
    return loss.detach(), {
        k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None
    }


def _packed_on_ranks(family, config):
    from torch.distributed.tensor import DTensor

    from cp_modules import swap_attention
    from cp_modules.training import init_cp_training

    ctx = init_cp_training(config, "cpu")
    model = swap_attention(_model(family), ctx.groups)
    cb = ctx.shard_batch(_packed_batch())
    with cp_step(cb.meta):
        logits = model(
            input_ids=cb.input_ids[None], position_ids=cb.positions[None]
        ).logits.squeeze(0)
        loss = lm_cross_entropy(logits, cb)
    loss.backward()
    # Gradients of every rank's loss share, summed over the dp x pcp ranks of its TP position.
    sum_group = ctx.replica_group
    grads = {}
    for k, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        if sum_group is not None:
            torch.distributed.all_reduce(g, group=sum_group)
        grads[k] = g
    return ctx.reduce_loss(loss), grads


def _rank_body(rank, world_size, layouts):
    failures = []
    for family, tp, pcp, dp in layouts:
        want_loss, want = _documents_alone(family)
        config = ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                                data_parallel_size=dp)  # fmt: skip
        # Every dp replica is fed the same packed rows here: the global mean is theirs.
        loss, got = _packed_on_ranks(family, config)
        name = f"{family} tp{tp} pcp{pcp} dp{dp}"
        if set(got) != set(want):
            failures.append(f"{name}: parameters with gradients differ: {set(got) ^ set(want)}")
            continue
        try:
            torch.testing.assert_close(loss, want_loss, atol=1e-12, rtol=1e-10)
            for k in want:
                torch.testing.assert_close(
                    got[k], want[k], atol=1e-12, rtol=1e-10, msg=f"{name} {k}"
                )
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, layouts",
    [
        (2, [("llama", 1, 2, 1), ("deepseek_v3", 1, 2, 1)]),
        (
            4,
            [
                ("llama", 1, 4, 1),
                ("deepseek_v3", 1, 4, 1),
                ("llama", 2, 2, 1),
                ("deepseek_v3", 1, 2, 2),
            ],
        ),
    ],
    ids=["world2", "world4"],
)
def test_packed_rows_equal_documents_alone(world_size, layouts):
    results = run_distributed(_rank_body, world_size, layouts, timeout_s=900)
    assert results == [[]] * world_size, results
