"""CP attention modules on one process: exactness vs dense attention, compile, bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from cp_modules import ParallelConfig
from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
from cp_modules.modules import (
    CPFlashAttention,
    CPMLAAttention,
    CPRuntime,
    apply_tensor_parallel,
    build_step_metadata,
    cp_step,
    restore_tokens,
)
from cp_modules.modules.rope import apply_rotary

RT = CPRuntime.single()


def dense_gqa(m: CPFlashAttention, x: torch.Tensor) -> torch.Tensor:
    """One request, plain causal SDPA over the layer's own projections."""
    t = x.shape[0]
    q = m.q_proj(x).view(t, -1, m.head_dim)
    k = m.k_proj(x).view(t, -1, m.head_dim)
    v = m.v_proj(x).view(t, -1, m.head_dim)
    cos, sin = m.rotary(torch.arange(t))
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return m.o_proj(o.transpose(0, 1).reshape(t, -1))


def run(m, x, new, comp=None, bt=None, block_size=4):
    meta = build_step_metadata(RT, new, comp, block_table=bt, block_size=block_size)
    with cp_step(meta):
        return restore_tokens(m(x[meta.token_indices], meta.positions), meta)


@pytest.fixture
def gqa():
    torch.manual_seed(0)
    return CPFlashAttention(64, 8, 2, bias=True)


def test_ragged_prefill_equals_dense(gqa):
    x = torch.randn(7 + 13 + 1, 64)
    y = run(gqa, x, [7, 13, 1])
    ref = torch.cat([dense_gqa(gqa, x[:7]), dense_gqa(gqa, x[7:20]), dense_gqa(gqa, x[20:])])
    torch.testing.assert_close(y, ref, atol=2e-6, rtol=0)


@torch.no_grad()
def test_prefill_chunked_prefill_and_decode_with_cache(gqa):
    gqa.kv_cache = allocate_kv_cache(16, 4, 2, 8, dtype=torch.float32)
    bt = torch.arange(12).view(2, 6)
    xa, xb = torch.randn(17, 64), torch.randn(11, 64)
    run(gqa, torch.cat([xa[:9], xb[:6]]), [9, 6], [0, 0], bt)
    # Request 0 continues with a chunk of 7 over its 9 cached tokens; request 1 decodes.
    y = run(gqa, torch.cat([xa[9:16], xb[6:7]]), [7, 1], [9, 6], bt)
    torch.testing.assert_close(y[:7], dense_gqa(gqa, xa[:16])[9:], atol=2e-6, rtol=0)
    torch.testing.assert_close(y[7], dense_gqa(gqa, xb[:7])[6], atol=2e-6, rtol=0)


@torch.no_grad()
def test_compiled_equals_eager_without_recompiles(gqa):
    """Five steps of different batch compositions: one graph, no graph breaks."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(gqa, fullgraph=True, dynamic=True)
    gqa.kv_cache = allocate_kv_cache(64, 4, 2, 8, dtype=torch.float32)
    bt = torch.arange(60).view(3, 20)
    schedule = [
        ([9, 5, 3], [0, 0, 0]),
        ([1, 1, 1], [9, 5, 3]),
        ([4, 1, 1], [10, 6, 4]),
        ([1, 1, 6], [14, 7, 5]),
        ([1, 1, 1], [15, 8, 11]),
    ]
    cache_eager = [c.clone() for c in gqa.kv_cache]
    for new, comp in schedule:
        x = torch.randn(sum(new), 64)
        meta = build_step_metadata(RT, new, comp, block_table=bt, block_size=4)
        with cp_step(meta):
            y_c = compiled(x[meta.token_indices], meta.positions)
            saved = gqa.kv_cache
            gqa.kv_cache = cache_eager
            y_e = gqa(x[meta.token_indices], meta.positions)
            gqa.kv_cache = saved
        torch.testing.assert_close(y_c, y_e, atol=1e-6, rtol=0)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_training_matches_eager(gqa):
    torch._dynamo.reset()
    compiled = torch.compile(gqa, fullgraph=True, dynamic=True)
    x = torch.randn(23, 64, requires_grad=True)
    y_e = run(gqa, x, [15, 8])
    g_e = torch.autograd.grad(y_e.square().sum(), [x, gqa.q_proj.weight])
    y_c = run(compiled, x, [15, 8])
    g_c = torch.autograd.grad(y_c.square().sum(), [x, gqa.q_proj.weight])
    torch.testing.assert_close(y_c, y_e, atol=1e-6, rtol=0)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_training_gradients_equal_dense(gqa):
    x = torch.randn(20, 64, requires_grad=True)
    y = run(gqa, x, [12, 8])
    gy = torch.randn_like(y)
    g = torch.autograd.grad(y, [x, gqa.k_proj.weight, gqa.v_proj.bias], gy)
    ref = torch.cat([dense_gqa(gqa, x[:12]), dense_gqa(gqa, x[12:])])
    g_ref = torch.autograd.grad(ref, [x, gqa.k_proj.weight, gqa.v_proj.bias], gy)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_mla_decode_absorbed_equals_prefill_path():
    torch.manual_seed(0)
    m = CPMLAAttention(
        64,
        4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    x = torch.randn(10, 64)
    full = run(m, x, [10])  # no cache: up-projected K/V
    m.kv_cache = allocate_mla_cache(8, 4, 32, 8, dtype=torch.float32)
    bt = torch.arange(4).view(1, 4)
    run(m, x[:9], [9], [0], bt)
    last = run(m, x[9:], [1], [9], bt)  # absorbed decode against the latent cache
    torch.testing.assert_close(last[0], full[9], atol=2e-6, rtol=0)


@pytest.mark.parametrize("grad", [False, True])
def test_mla_keys_by_copies_equal_the_concatenation(grad, monkeypatch):
    """``KEYS_BY_COPIES`` builds MLA's per-head keys by two copies instead of one
    concatenation: the same bits forward (the one-rank local path, and the op's path through
    a chunked prefill) and the same gradients."""
    import cp_modules.ops.mla_attention as mla_ops

    torch.manual_seed(0)
    m = CPMLAAttention(64, 4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
    x = torch.randn(10, 64, requires_grad=grad)
    outs = []
    for by_copies in (False, True):
        monkeypatch.setattr(mla_ops, "KEYS_BY_COPIES", by_copies)
        with torch.set_grad_enabled(grad):
            y = run(m, x, [6, 4])  # one rank, no cache: the local path
        got = [y]
        if grad:
            got += list(torch.autograd.grad(y.square().sum(), [x, m.kv_b_proj.weight]))
        else:
            m.kv_cache = allocate_mla_cache(8, 4, 32, 8, dtype=torch.float32)
            bt = torch.arange(4).view(1, 4)
            with torch.no_grad():
                run(m, x[:6], [6], [0], bt)
                got.append(run(m, x[6:], [4], [6], bt))  # the prefix: the op's up-projection
            m.kv_cache = None
        outs.append(got)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ bad inputs: clear errors


def test_cache_path_refuses_gradients(gqa):
    gqa.kv_cache = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="inference-only"):
        run(gqa, torch.randn(5, 64), [5], [0], torch.arange(2).view(1, 2))


@torch.no_grad()
def test_cache_too_small(gqa):
    gqa.kv_cache = allocate_kv_cache(2, 4, 2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="block id 4 but the KV cache has only 2 blocks"):
        run(gqa, torch.randn(9, 64), [9], [0], torch.tensor([[0, 1, 4]]))


@torch.no_grad()
def test_cache_dtype_mismatch(gqa):
    gqa.kv_cache = allocate_kv_cache(8, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KV cache dtype torch.bfloat16 differs"):
        run(gqa, torch.randn(5, 64), [5], [0], torch.arange(2).view(1, 2))


@torch.no_grad()
def test_cache_head_shape_mismatch(gqa):
    gqa.kv_cache = allocate_kv_cache(8, 4, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"KV cache holds \[heads, dim\] = \[1, 8\]"):
        run(gqa, torch.randn(5, 64), [5], [0], torch.arange(2).view(1, 2))


def test_block_table_too_narrow(gqa):
    with pytest.raises(
        ValueError, match="block_table has 2 blocks per request but the longest request needs 3"
    ):
        build_step_metadata(RT, [9], [0], block_table=torch.arange(2).view(1, 2), block_size=4)


def test_prefix_needs_block_table():
    with pytest.raises(ValueError, match="pass the block_table"):
        build_step_metadata(RT, [3], [5])


@pytest.mark.parametrize(
    "new,comp,msg",
    [([0, 3], [0, 0], ">= 1 new token"), ([3], [-1], ">= 0"), ([3, 4], [0], "equal length")],
)
def test_bad_batches(new, comp, msg):
    with pytest.raises(ValueError, match=msg):
        build_step_metadata(RT, new, comp)


def test_wrong_number_of_local_tokens(gqa):
    meta = build_step_metadata(RT, [6])
    with cp_step(meta), pytest.raises(ValueError, match="has 5 tokens but this rank's step has 6"):
        gqa(torch.randn(5, 64), torch.arange(5))


def test_no_step_is_a_clear_error(gqa):
    import cp_modules.step as ctx

    saved, ctx._CURRENT = ctx._CURRENT, None
    try:
        with pytest.raises(RuntimeError, match="no context-parallel step is active"):
            gqa(torch.randn(4, 64), torch.arange(4))
    finally:
        ctx._CURRENT = saved


def test_heads_the_layout_cannot_serve_are_rejected_before_sharding():
    m = CPFlashAttention(64, 8, 4)
    cfg = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=4)
    with pytest.raises(ValueError, match="same KV heads"):
        apply_tensor_parallel(m, tp_mesh=None, config=cfg)
