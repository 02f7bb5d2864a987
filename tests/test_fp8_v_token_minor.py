"""The token-minor value cache (storage [NB, Hkv, D, BS] seen as [NB, BS, Hkv, D]): allocation,
the write kernel's bytes, the decode kernel against the reference and against the same values
in the [NB, BS, Hkv, D] layout (interpreter on CPU; the GPU for real), the ops and compile."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_fp8_kv import _assert_within_twice_same_dtype, fp8_gqa_shard, gpu_decode_queries

import cp_modules.cache.paged as paged_cache
import cp_modules.kernels.decode.paged as gqa_kernels
from cp_modules.cache.kv_dtype import FP8_DTYPE, kv_scale
from cp_modules.cache.paged import allocate_kv_cache, is_token_minor, to_token_minor
from cp_modules.kernels.cache import write_kv_cache_kernel
from cp_modules.kernels.decode.paged import DecodeConfig, paged_attention_kernel
from cp_modules.ops.kv_cache import write_kv_cache
from cp_modules.ops.paged_decode import paged_attention
from cp_modules.reference.paged_decode import paged_attention_ref


def test_allocation_layouts_and_the_switch(monkeypatch):
    k8, v8 = allocate_kv_cache(3, 16, 2, 8, dtype=FP8_DTYPE)
    assert v8.shape == k8.shape == (3, 16, 2, 8)
    assert v8.stride() == (2 * 8 * 16, 1, 8 * 16, 16) and is_token_minor(v8)
    assert k8.is_contiguous() and not is_token_minor(k8)
    kb, vb = allocate_kv_cache(3, 16, 2, 8, dtype=torch.bfloat16)
    assert kb.is_contiguous() and vb.is_contiguous()
    assert allocate_kv_cache(3, 16, 2, 8, dtype=FP8_DTYPE, v_token_minor=False)[1].is_contiguous()
    assert is_token_minor(allocate_kv_cache(3, 16, 2, 8, v_token_minor=True)[1])
    monkeypatch.setattr(paged_cache, "FP8_V_TOKEN_MINOR", False)
    assert allocate_kv_cache(3, 16, 2, 8, dtype=FP8_DTYPE)[1].is_contiguous()
    x = torch.randn(3, 16, 2, 8)
    t = to_token_minor(x)
    assert torch.equal(t, x) and is_token_minor(t) and t.stride() == v8.stride()
    assert t._base is not None and t._base.is_contiguous()  # a view of its own storage


def _writes(nb=4, bs=16, h=2, d=32, seed=0, prefill=False):
    """Tokens at random slots (one skipped), or ``prefill``: positions 0.. of one request
    through a shuffled block table (16 consecutive slots of one block, a run with a skipped
    token, a shorter last run)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(nb * bs, generator=g)[: nb * bs - 5]
    if prefill:
        pos = torch.arange(nb * bs - 5)
        slots = torch.randperm(nb, generator=g)[pos // bs] * bs + pos % bs
    slots[40 if prefill else 3] = -1
    k = torch.randn(slots.numel(), h, d, generator=g) * 30
    v = torch.randn(slots.numel(), h, d, generator=g) * 0.05
    return k, v, slots


@pytest.mark.parametrize("prefill", [False, True], ids=["random-slots", "prefill-slots"])
@pytest.mark.parametrize("grouped", [True, False], ids=["16-token-programs", "one-token"])
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.float32], ids=["fp8", "fp32"])
def test_write_kernel_bytes_equal_in_both_layouts_interpreted(dtype, grouped, prefill,
                                                              monkeypatch):  # fmt: skip
    """Both write kernels of a token-minor V cache (WRITE_GROUPED_MIN_TOKENS; the grouped
    one's runs of consecutive slots and its other tokens): 59 tokens (not a multiple of 16),
    one skipped (slot -1), NaN where nothing is written."""
    import cp_modules.kernels.cache as cache_kernels

    monkeypatch.setattr(cache_kernels, "WRITE_GROUPED_MIN_TOKENS", 0 if grouped else 10**9)
    k, v, slots = _writes(prefill=prefill)
    ks = vs = None
    if dtype == FP8_DTYPE:
        ks, vs = kv_scale(torch.tensor([1.0, 0.3]), 2), kv_scale(0.01, 2)
    nan = torch.full((4, 16, 2, 32), float("nan")).to(dtype)
    kc, vc = nan.clone(), nan.clone()
    kt, vt = nan.clone(), to_token_minor(nan)
    write_kv_cache_kernel(k, v, kc, vc, slots, ks, vs)
    write_kv_cache_kernel(k, v, kt, vt, slots, ks, vs)
    kr, vr = nan.clone(), to_token_minor(nan)
    write_kv_cache(k, v, kr, vr, slots, ks, vs)  # CPU: the reference, through the strides
    bits = torch.uint8 if dtype == FP8_DTYPE else torch.int32
    for got in (vt, vr):
        assert is_token_minor(got)
        assert torch.equal(got.contiguous().view(bits), vc.view(bits))  # NaN and -0 included
    assert torch.equal(kt.view(bits), kc.view(bits)) and torch.equal(kr.view(bits), kc.view(bits))
    # The token-minor storage holds each (block, head, dim) row's tokens contiguously.
    blk, off = slots[0] // 16, slots[0] % 16
    assert torch.equal(vt._base[blk, :, :, off].view(bits), vc[blk, off].view(bits))


def _shard(dtype, bs, lengths, hkv=2, d=32, seed=0):
    """Caches (NaN where unwritten) in both value layouts, scales, block table, rows, lengths."""
    kc, vc, ks, vs, bt, rows, lens = fp8_gqa_shard(hkv, d, bs, lengths, seed, dtype=dtype)
    return kc, vc, to_token_minor(vc), ks, vs, bt, rows, lens


def _lse_err(a, b):
    return (a - b).nan_to_num(0.0).abs().max().item()  # (-inf - -inf: an empty range in both)


# block size / tile: one block per tile, two and four whole blocks per tile (their entries
# loaded one per block), a block size that neither divides nor is divided by the tile.
_TILES = {"bs16-N16": (16, 16), "bs16-N32": (16, 32), "bs8-N32": (8, 32), "bs12-N16": (12, 16)}


@pytest.mark.parametrize("tiles", list(_TILES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["q-fp32", "q-fp16"])
def test_fp8_decode_token_minor_equals_old_layout_interpreted(tiles, q_dtype, monkeypatch):
    """The same bits as the [NB, BS, Hkv, D] value cache, for both loops (block-table entries
    ahead with unmasked middle tiles, and the old one), runs of 1 and 2 queries, a window and
    a soft-cap; and within tolerance of the reference (which reads the token-minor cache)."""
    bs, block_n = _TILES[tiles]
    kc, vc, vt, ks, vs, bt, rows, lens = _shard(FP8_DTYPE, bs, (1, 70, 130, 97))
    g = torch.Generator().manual_seed(1)
    cfg = DecodeConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=3)
    for flags, q_len in itertools.product([False, True], [1, 2]):
        monkeypatch.setattr(gqa_kernels, "BT_AHEAD", flags)
        monkeypatch.setattr(gqa_kernels, "UNMASKED_MAIN", flags)
        r = rows.repeat_interleave(q_len)
        n = (lens[:, None] - torch.arange(q_len).flip(0)).clamp_min(0).flatten()
        q = torch.randn(r.numel(), 8, 32, generator=g).to(q_dtype)
        extra = dict(query_kv_start=(n - 40).clamp_min(0), softcap=5.0) if flags else {}
        args = (bt, r, n, 32**-0.5, 3)
        old = paged_attention_kernel(q, kc, vc, *args, config=cfg, k_scale=ks, v_scale=vs,
                                     query_len=q_len, **extra)  # fmt: skip
        new = paged_attention_kernel(q, kc, vt, *args, config=cfg, k_scale=ks, v_scale=vs,
                                     query_len=q_len, **extra)  # fmt: skip
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1]), (flags, q_len)
        assert not new[0].isnan().any()
        ref = paged_attention_ref(q, kc, vt, *args[:4], k_scale=ks, v_scale=vs, **extra)
        same = paged_attention_ref(q, kc, vt, *args[:4], k_scale=ks, v_scale=vs, upcast=False,
                                   **extra)  # fmt: skip
        eo = (new[0].float() - ref[0].float()).abs().max().item()
        bo = (same[0].float() - ref[0].float()).abs().max().item()
        assert eo <= 2 * bo + 1e-5, (flags, q_len, eo, bo)
        assert torch.equal(new[1].isinf(), ref[1].isinf())  # empty ranges: -inf
        assert _lse_err(new[1], ref[1]) <= 2 * _lse_err(same[1], ref[1]) + 1e-5


def test_float_cache_token_minor_matches_reference_interpreted():
    """A token-minor fp32 value cache (not the default, but any strides must be right): hidden
    keys' values (NaN here) are zeroed, the result equals the contiguous cache's."""
    kc, vc, vt, _, _, bt, rows, lens = _shard(torch.float32, 16, (1, 70, 130))
    q = torch.randn(rows.numel(), 8, 32)
    cfg = DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1)
    old = paged_attention_kernel(q, kc, vc, bt, rows, lens, 32**-0.5, 3, config=cfg)
    new = paged_attention_kernel(q, kc, vt, bt, rows, lens, 32**-0.5, 3, config=cfg)
    ref = paged_attention_ref(q, kc, vt, bt, rows, lens, 32**-0.5)
    torch.testing.assert_close(new[0], old[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(new[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(new[1], ref[1], atol=1e-5, rtol=0)


def test_ops_accept_token_minor_values_and_name_bad_layouts():
    kc, vc, vt, ks, vs, bt, rows, lens = _shard(FP8_DTYPE, 16, (5, 40))
    q = torch.randn(2, 8, 32)
    got = paged_attention(q, kc, vt, bt, rows, lens, scale=0.2, k_scale=ks, v_scale=vs)
    want = paged_attention(q, kc, vc, bt, rows, lens, scale=0.2, k_scale=ks, v_scale=vs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Neither the head dim nor the token dim contiguous (heads fastest).
    bad = torch.as_strided(vc.clone(), vc.shape, (vc.stride(0), vc.stride(1), 1, vc.shape[2]))
    with pytest.raises(ValueError, match="v_cache in its last dim or its token dim"):
        paged_attention(q, kc, bad, bt, rows, lens, scale=0.2, k_scale=ks, v_scale=vs)
    k, v, slots = _writes(nb=3, d=32)
    with pytest.raises(ValueError, match="k_cache must be contiguous in its last dim"):
        write_kv_cache(k, v, to_token_minor(kc), vc, slots, ks, vs)


def test_write_and_decode_compile_fullgraph_on_token_minor_cache():
    """torch.compile keeps writing into the token-minor storage in place (the cache is a view
    of it) and decodes the same as eager."""
    k, v, slots = _writes(nb=3, bs=16, d=32)
    kc, vc = allocate_kv_cache(3, 16, 2, 32, dtype=FP8_DTYPE)
    kr, vr = allocate_kv_cache(3, 16, 2, 32, dtype=FP8_DTYPE)
    ks, vs = kv_scale(0.5, 2), kv_scale(0.02, 2)
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    rows, lens = torch.zeros(2, dtype=torch.int32), torch.tensor([48, 30])
    q = torch.randn(2, 8, 32)

    def step(k, v, kc, vc):
        write_kv_cache(k, v, kc, vc, slots, ks, vs)
        return paged_attention(q, kc, vc, bt, rows, lens, scale=0.2, k_scale=ks, v_scale=vs)

    storage = vc._base
    got = torch.compile(step, fullgraph=True)(k, v, kc, vc)
    want = step(k, v, kr, vr)
    assert vc._base is storage and is_token_minor(vc)
    assert torch.equal(storage.view(torch.uint8), vr._base.view(torch.uint8))
    assert storage.view(torch.uint8).any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# GPU


_GPU_SWITCHES = {
    "default": {},
    "int-conversion": dict(FP8_HW_FP16=False),  # bf16 products, the PTX integer conversion
    "old-loop": dict(BT_AHEAD=False, UNMASKED_MAIN=False),
    "N64": dict(FP8_BLOCK_N=64),
}


@pytest.mark.gpu
@pytest.mark.parametrize("switches", list(_GPU_SWITCHES))
@pytest.mark.parametrize("bs", [16, 64, 128], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("case", ["plain-Q1", "window-softcap-Q1", "window-Q4"])
def test_gpu_fp8_decode_token_minor(bs, case, switches, monkeypatch):
    """The op's launch (128-token tiles: 8, 2 or 1 blocks a tile; the kernel's switches) on a
    token-minor fp8 value cache: the 2x rule against the fp32 reference, and the
    [NB, BS, Hkv, D] cache's result within the same bound; written by the Triton kernel byte
    for byte as the reference writes; a CUDA-graph replay equal to the eager call."""
    for name, value in _GPU_SWITCHES[switches].items():
        monkeypatch.setattr(gqa_kernels, name, value)
    torch.manual_seed(2)
    dev, hkv, d, hq = "cuda", 8, 128, 32
    q_len = 4 if case.endswith("Q4") else 1
    ends = [1, 700, 5000, 64, 2049]
    nb = 6000 // bs * len(ends)
    k = torch.randn(nb * bs, hkv, d, device=dev).to(torch.bfloat16) * 4
    v = torch.randn(nb * bs, hkv, d, device=dev).to(torch.bfloat16)
    ks = kv_scale(torch.linspace(0.5, 2.0, hkv), hkv, device=dev)
    vs = kv_scale(0.7, hkv, device=dev)
    kc, vt = allocate_kv_cache(nb, bs, hkv, d, dtype=FP8_DTYPE, device=dev)
    assert is_token_minor(vt)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nb * bs, device=dev)
    write_kv_cache(k, v, kc, vt, slots, ks, vs)
    write_kv_cache(k, v, kc, vc, slots, ks, vs)
    kr, vr = allocate_kv_cache(nb, bs, hkv, d, dtype=FP8_DTYPE)
    write_kv_cache(k.cpu(), v.cpu(), kr, vr, slots.cpu(), ks.cpu(), vs.cpu())
    assert torch.equal(vt.cpu().view(torch.uint8), vr.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), vr.view(torch.uint8))
    bt, rows, lens, q, extra = gpu_decode_queries(case, ends, nb, 6000 // bs, hq, d, q_len)

    def run(vcache):
        return paged_attention(q, kc, vcache, bt, rows, lens, scale=d**-0.5, k_scale=ks,
                               v_scale=vs, query_len=q_len, **extra)  # fmt: skip

    out, lse = run(vt)
    old_out, old_lse = run(vc)
    ref = paged_attention_ref(q, kc, vt, bt, rows, lens, d**-0.5, k_scale=ks, v_scale=vs, **extra)
    same = paged_attention_ref(q, kc, vt, bt, rows, lens, d**-0.5, k_scale=ks, v_scale=vs,
                               upcast=False, **extra)  # fmt: skip
    for o, l_ in ((out, lse), (old_out, old_lse)):  # rows of runs of 4 may see no key (-inf)
        _assert_within_twice_same_dtype(o, l_, ref, same)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = run(vt)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.gpu
def test_gpu_fp8_token_minor_nan_slots_stay_hidden():
    """Unwritten slots holding e4m3 NaN bytes next to the visible keys (the hardware conversion
    turns them into NaN): the result has none and equals the reference."""
    dev, hkv, d, bs = "cuda", 8, 128, 64
    kc, vt = allocate_kv_cache(40, bs, hkv, d, dtype=FP8_DTYPE, device=dev)
    kc.view(torch.uint8).fill_(0x7F)
    vt.view(torch.uint8).fill_(0x7F)
    lens = torch.tensor([1, 100, 191, 1000], device=dev)
    bt = torch.stack([torch.randperm(40, device=dev)[:16] for _ in range(4)]).to(torch.int32)
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device=dev)
        slots = bt[r, pos // bs].to(torch.int64) * bs + pos % bs
        write_kv_cache(torch.randn(n, hkv, d, device=dev), torch.randn(n, hkv, d, device=dev),
                       kc, vt, slots)  # fmt: skip
    rows = torch.arange(4, device=dev, dtype=torch.int32)
    q = torch.randn(4, 32, d, device=dev).to(torch.bfloat16)
    for splits in (None, 1, 3):
        out, lse = paged_attention(q, kc, vt, bt, rows, lens, scale=d**-0.5, num_splits=splits,
                                   query_kv_start=(lens - 150).clamp_min(0))  # fmt: skip
        assert not out.isnan().any() and not lse.isnan().any()
        ref = paged_attention_ref(q, kc, vt, bt, rows, lens, d**-0.5,
                                  query_kv_start=(lens - 150).clamp_min(0))  # fmt: skip
        assert (out.float() - ref[0].float()).abs().max().item() < 2e-2


def test_compiled_engine_on_token_minor_fp8_cache_equals_eager_and_reuses_its_graphs():
    """The engine's compiled decode with an fp8 cache (its value cache a token-minor view;
    view, storage and scales marked static, the block count unbacked): the eager engine's
    tokens, and a larger batch (a larger cache) reuses the graphs."""
    from test_engine import MAX_NEW, _engine, _prompts

    from cp_modules.engine import SamplingParams
    from cp_modules.modules.hf_swap import kv_cache_tensors

    prompts = _prompts()
    params = SamplingParams(max_new_tokens=MAX_NEW)
    eager = _engine("llama", kv_cache_dtype="fp8_e4m3")
    want = eager.generate(prompts, params).outputs
    assert any(is_token_minor(c) for c in kv_cache_tensors(eager.model))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine = _engine("llama", kv_cache_dtype="fp8_e4m3", compile=True, compile_backend="aot_eager")
    engine.generate(_prompts((5, 11), seed=4), SamplingParams(max_new_tokens=3))
    assert counters["stats"]["unique_graphs"] == 3  # prefill, decode, decode of one token
    assert engine.generate(prompts, params).outputs == want
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [True, False], ids=["16-token-programs", "one-token"])
def test_gpu_write_kernels_token_minor_bytes(grouped, monkeypatch):
    """The Triton writes into a token-minor fp8 value cache, random slots and a prefill's runs
    of consecutive slots (block size 64, positions from 5): the reference's bytes."""
    import cp_modules.kernels.cache as cache_kernels

    monkeypatch.setattr(cache_kernels, "WRITE_GROUPED_MIN_TOKENS", 0 if grouped else 10**9)
    dev, nb, bs, hkv, d = "cuda", 64, 64, 8, 128
    ks = kv_scale(torch.linspace(0.5, 2.0, hkv), hkv, device=dev)
    vs = kv_scale(0.02, hkv, device=dev)
    pos = torch.arange(5, nb * bs - 7, device=dev)
    prefill = torch.randperm(nb, device=dev)[pos // bs] * bs + pos % bs
    for slots in (torch.randperm(nb * bs, device=dev)[:1000], prefill):
        slots[7] = -1
        k = torch.randn(slots.numel(), hkv, d, device=dev).to(torch.bfloat16) * 30
        v = torch.randn_like(k) * 0.05
        kc, vt = allocate_kv_cache(nb, bs, hkv, d, dtype=FP8_DTYPE, device=dev)
        kr, vr = allocate_kv_cache(nb, bs, hkv, d, dtype=FP8_DTYPE)
        write_kv_cache(k, v, kc, vt, slots, ks, vs)
        write_kv_cache(k.cpu(), v.cpu(), kr, vr, slots.cpu(), ks.cpu(), vs.cpu())
        assert torch.equal(kc.cpu().view(torch.uint8), kr.view(torch.uint8))
        assert torch.equal(vt._base.cpu().view(torch.uint8), vr._base.view(torch.uint8))
