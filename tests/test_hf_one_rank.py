"""World size 1: a swapped transformers Llama trains like the original, and its attention moves
no tokens.

At pcp = dcp = 1 the swapped model's logits, loss and every parameter's gradient equal HF's
eager attention (float64), for one sequence and for several (several requests of the step),
on the CPU op's reference path and on the varlen path. The profile of the swapped attention's
forward and backward shows no gather, reorder, concatenation or gradient buffer around the
attention kernel (the one-rank layout needs none).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cp_modules.config import ParallelConfig
from cp_modules.modules.hf_swap import swap_attention
from cp_modules.policy import CPPolicy
from cp_modules.step import CPRuntime, cp_step
from cp_modules.training import CPTrainingContext, lm_cross_entropy

transformers = pytest.importorskip("transformers")

POLICIES = {"reference": CPPolicy(), "varlen": CPPolicy(pcp_varlen="always")}
# Data movement an attention op could add around its kernel.
MOVES = {
    "aten::cat", "aten::stack", "aten::index_select", "aten::index_copy_", "aten::index_add_",
    "aten::index_fill_", "aten::copy_", "aten::clone", "aten::zeros", "aten::zeros_like",
    "aten::new_zeros", "aten::zero_", "aten::fill_", "aten::index",
}  # fmt: skip


def _models():
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, num_hidden_layers=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    hf = hf.double()
    return hf, swap_attention(copy.deepcopy(hf))


def _context(policy: CPPolicy) -> CPTrainingContext:
    return CPTrainingContext(
        config=ParallelConfig(), runtime=CPRuntime.single(policy=policy), device=torch.device("cpu")
    )


def _cp_step(model, ctx, ids):
    cb = ctx.shard_batch({"input_ids": ids})
    with cp_step(cb.meta):
        logits = model(
            input_ids=cb.input_ids[None], position_ids=cb.positions[None], use_cache=False
        ).logits[0]
        loss = lm_cross_entropy(logits, cb)
    loss.backward()
    return logits.detach(), loss.detach()


@pytest.mark.parametrize("rows", [1, 3], ids=["one-sequence", "three-sequences"])
@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_training_step_equals_hf_eager(policy, rows):
    hf, cp = _models()
    ids = torch.randint(0, 64, (rows, 13), generator=torch.Generator().manual_seed(rows))
    logits, loss = _cp_step(cp, _context(POLICIES[policy]), ids)
    ref_logits = hf(input_ids=ids, use_cache=False).logits
    # The mean over every next-token target of each sequence, in float64.
    ref_loss = torch.nn.functional.cross_entropy(
        ref_logits[:, :-1].reshape(-1, ref_logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    ref_loss.backward()
    # At P = 1 the local tokens are the batch's tokens in order.
    torch.testing.assert_close(logits, ref_logits.detach().reshape(logits.shape))
    torch.testing.assert_close(loss, ref_loss.detach())
    named = dict(hf.named_parameters())
    for name, p in cp.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, named[name].grad, msg=name)


def _moves_around_the_kernel(prof) -> dict[str, int]:
    """Data-movement ops inside the swapped attention's forward op and its backward node,
    outside the attention kernel op (``cp::pcp_prefill_attention*``)."""
    found: dict[str, int] = {}
    for e in prof.events():
        if e.name not in MOVES:
            continue
        inside = in_kernel = False
        p = e.cpu_parent
        while p is not None:
            in_kernel |= p.name.startswith("cp::pcp_prefill_attention")
            inside |= p.name == "cp::gqa_attention" or "cp_gqa_attention" in p.name
            p = p.cpu_parent
        if inside and not in_kernel:
            found[e.name] = found.get(e.name, 0) + 1
    return found


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_one_rank_attention_moves_no_tokens(policy):
    from torch.profiler import ProfilerActivity, profile

    _, cp = _models()
    ctx = _context(POLICIES[policy])
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    _cp_step(cp, ctx, ids)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _cp_step(cp, ctx, ids)
    names = {e.name for e in prof.events()}
    # The profile holds the op's forward and its backward node (the check looks inside both).
    assert "cp::gqa_attention" in names
    assert any("cp_gqa_attention" in n and "Backward" in n for n in names)
    assert _moves_around_the_kernel(prof) == {}


def test_packed_sequence_detection_skipped_for_cp_models_only():
    # HF's packed-sequence test reads a device value on the host (one synchronisation per
    # mask); cp models skip it (their requests come from the step metadata), other models keep
    # it: a plain HF model fed packed position ids still masks across its packed sequences.
    import types

    import transformers.masking_utils as mu

    from cp_modules.modules.hf_attention import register_cp_attention

    register_cp_attention()
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    want = mu.find_packed_sequence_indices.__wrapped__(pos)

    def called_with(impl):
        config = types.SimpleNamespace(_attn_implementation=impl)  # noqa: F841 (read by frame)
        return mu.find_packed_sequence_indices(pos)

    assert called_with("cp") is None
    assert torch.equal(called_with("sdpa"), want) and want[0, -1] == 2
    # A plain model: packed rows attend within their own sequence (as two separate calls).
    from cp_modules.modules.hf_families import build_tiny

    model = build_tiny("llama")
    ids = torch.randint(
        0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        parts = [model(input_ids=ids[:, a:b]).logits[0] for a, b in ((0, 3), (3, 5), (5, 9))]
    torch.testing.assert_close(packed, torch.cat(parts), atol=1e-5, rtol=1e-5)
