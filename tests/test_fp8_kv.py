"""fp8 (e4m3) KV cache: options and scales, the quantizing writes and dequantizing decode kernels
against the reference (interpreter on CPU, the GPU for real), DCP on gloo equal to one process,
and the engine's byte-sized pool."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from cp_modules.cache.kv_dtype import (
    FP8_DTYPE,
    check_kv_cache_dtype,
    dequantize_fp8,
    kv_cache_storage_dtype,
    kv_scale,
    quantize_fp8,
)
from cp_modules.kernels.cache import write_kv_cache_kernel, write_mla_cache_kernel
from cp_modules.kernels.decode.fp8 import fp8_bias, fp8_bits_kind, fp8_e4m3_bits_to
from cp_modules.kernels.decode.mla import paged_mla_attention_kernel
from cp_modules.kernels.decode.paged import DecodeConfig, paged_attention_kernel
from cp_modules.ops.kv_cache import write_kv_cache, write_mla_cache
from cp_modules.ops.paged_decode import paged_attention, paged_mla_attention
from cp_modules.reference.paged_decode import paged_attention_ref, paged_mla_attention_ref
from cp_modules.testing.distributed import run_distributed
from cp_modules.verify import TOLERANCE, VerifyArgs, verify_rank

# ---------------------------------------------------------------------------------------------
# Options and scales


def _assert_within_twice_same_dtype(out, lse, ref, same, atol=1e-4):
    """Output and LSE within 2x the same-dtype reference's error of the fp32 one (+ atol)."""
    eo = (out.float() - ref[0].float()).abs().max().item()
    bo = (same[0].float() - ref[0].float()).abs().max().item()
    assert eo <= 2 * bo + atol, (eo, bo)
    # Rows that see no key (a window past every cached token) have LSE -inf: the kernel must
    # give -inf exactly there, and the finite rows are compared.
    empty = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(lse), empty), "-inf LSE rows differ from the reference"
    assert torch.equal(torch.isneginf(same[1]), empty)
    el = (lse - ref[1])[~empty].abs().max().item() if (~empty).any() else 0.0
    bl = (same[1] - ref[1])[~empty].abs().max().item() if (~empty).any() else 0.0
    assert el <= 2 * bl + atol, (el, bl)


def test_bad_options_raise_naming_the_option():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        check_kv_cache_dtype("fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_storage_dtype("int8", torch.bfloat16)
    assert kv_cache_storage_dtype("bf16", torch.float32) == torch.float32
    assert kv_cache_storage_dtype("fp8_e4m3", torch.bfloat16, "cpu") == FP8_DTYPE
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.tensor([1.0, 0.0])):
        with pytest.raises(ValueError, match="layers.3.k_scale must hold positive finite"):
            kv_scale(bad, 2, name="layers.3.k_scale")
    with pytest.raises(
        ValueError, match=r"v_scale must be a scalar or one value per KV head \(\[4\]\)"
    ):
        kv_scale(torch.ones(3), 4, name="v_scale")
    with pytest.raises(ValueError, match="k_scale must be a number or a tensor"):
        kv_scale("1.0", 4)  # type: ignore[arg-type]
    assert kv_scale(None, 3).tolist() == [1.0] * 3
    assert kv_scale(torch.tensor(0.5), 2).tolist() == [0.5, 0.5]
    assert kv_scale(torch.tensor([0.5, 2.0]), 2).tolist() == [0.5, 2.0]


def test_op_scale_checks():
    kc = torch.zeros(2, 4, 2, 16, dtype=FP8_DTYPE)
    k = torch.randn(3, 2, 16)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match=r"k_scale must be an fp32 tensor of shape \[1\] or \[2\]"):
        write_kv_cache(k, k, kc, kc.clone(), slots, torch.ones(3), None)
    with pytest.raises(ValueError, match="k_scale is given but the cache is torch.float32"):
        write_kv_cache(k, k, kc.float(), kc.float(), slots, torch.ones(2), None)
    q = torch.randn(1, 4, 16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache dtype torch.float16 must equal q's dtype"):
        paged_attention(q, kc.half(), kc.half(), bt, one - 1, one, scale=1.0)


# ---------------------------------------------------------------------------------------------
# Quantization: the write kernel (interpreter) equals the reference; scale semantics


def test_write_kernel_quantizes_like_the_reference_interpreted():
    torch.manual_seed(0)
    t, h, d = 40, 2, 32
    # Values on and between fp8 grid points, ties, subnormals and beyond +-448 (saturated).
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].sort().values
    special = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([500.0, -1e4])])
    k = torch.randn(t, h, d) * 40
    k.view(-1)[: special.numel()] = special
    v = torch.randn(t, h, d) * 0.01
    ks, vs = kv_scale(torch.tensor([1.0, 0.37]), h), kv_scale(0.003, h)
    caches = [torch.zeros(3, 16, h, d, dtype=FP8_DTYPE) for _ in range(4)]
    slots = torch.randperm(48)[:t]
    slots[5] = -1
    write_kv_cache(k, v, caches[0], caches[1], slots, ks, vs)  # CPU: the reference
    write_kv_cache_kernel(k, v, caches[2], caches[3], slots, ks, vs)
    # The same bytes (-0 included).
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    flat = caches[0].flatten(0, 1)
    assert torch.equal(flat[slots[0]].float(), quantize_fp8(k[0], ks).float())
    assert flat[slots[0]].float().abs().max() <= 448
    # MLA: one scale for the whole row.
    c_ref, c_ker = (torch.zeros(3, 16, 48, dtype=FP8_DTYPE) for _ in range(2))
    kv_c, k_pe = torch.randn(t, 32) * 3, torch.randn(t, 16) * 3
    sc = kv_scale(0.25, 1)
    write_mla_cache(kv_c, k_pe, c_ref, slots, sc)
    write_mla_cache_kernel(kv_c, k_pe, c_ker, slots, sc)
    assert torch.equal(c_ref.view(torch.uint8), c_ker.view(torch.uint8))


def test_quantization_error_is_e4m3_rounding():
    x = torch.randn(4096, 2, 64)
    s = kv_scale(torch.tensor([0.25, 1.0]), 2)
    y = dequantize_fp8(quantize_fp8(x, s), s, torch.float32)
    normal = (x / s[None, :, None]).abs() >= 2**-6  # below: subnormals, a fixed step of 2^-9
    rel = ((y - x).abs() / x.abs())[normal].max()
    assert 0 < rel <= 2**-4 + 1e-6  # half an ulp of a 3-bit mantissa
    assert ((y - x).abs() / s[None, :, None])[~normal].max() <= 2**-10


# ---------------------------------------------------------------------------------------------
# Decode kernels on an fp8 cache vs the reference (interpreter)


def fp8_gqa_shard(hkv=2, d=32, bs=16, lengths=(1, 70, 130), seed=0, dtype=FP8_DTYPE):
    """Caches of ``dtype`` (NaN where unwritten; scales for fp8, else None), a block table
    of distinct random blocks, rows and lengths of the requests."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lengths) + 2
    kc = torch.full((nb, bs, hkv, d), float("nan")).to(dtype)
    vc = kc.clone()
    fp8 = dtype == FP8_DTYPE
    ks = kv_scale(torch.tensor([0.5, 1.5])[:hkv], hkv) if fp8 else None
    vs = kv_scale(0.8, hkv) if fp8 else None
    perm = torch.randperm(nb, generator=g)
    rows, nxt = [], 0
    width = max(-(-n // bs) for n in lengths)
    bt = torch.zeros(len(lengths), width, dtype=torch.int32)
    for r, n in enumerate(lengths):
        m = -(-n // bs)
        bt[r, :m] = perm[nxt : nxt + m].to(torch.int32)
        nxt += m
        pos = torch.arange(n)
        slots = bt[r, pos // bs].to(torch.int64) * bs + pos % bs
        k = torch.randn(n, hkv, d, generator=g)
        v = torch.randn(n, hkv, d, generator=g)
        write_kv_cache(k, v, kc, vc, slots, ks, vs)
        rows.append(r)
    return kc, vc, ks, vs, bt, torch.tensor(rows, dtype=torch.int32), torch.tensor(lengths)


@pytest.fixture(params=[False, True], ids=["K-NxD", "K-DxN"])
def k_transposed(request, monkeypatch):
    """Both key-tile loads of the fp8 decode kernels (FP8_K_TRANSPOSED)."""
    import cp_modules.kernels.decode.mla as mla_kernels
    import cp_modules.kernels.decode.paged as gqa_kernels

    monkeypatch.setattr(gqa_kernels, "FP8_K_TRANSPOSED", request.param)
    monkeypatch.setattr(mla_kernels, "FP8_K_TRANSPOSED", request.param)
    return request.param


@triton.jit
def _convert_bytes(
    X, Y, N: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr, PACK: tl.constexpr
):
    offs = tl.arange(0, N)
    tl.store(Y + offs, fp8_e4m3_bits_to(tl.load(X + offs), KIND, ASM, PACK))


def _converted(dtype, asm, device="cpu", pack=4, hw_fp16=False):
    x = torch.arange(256, dtype=torch.uint8, device=device)
    y = torch.empty(256, dtype=torch.float16 if hw_fp16 else dtype, device=device)
    kind = fp8_bits_kind(dtype, hw_fp16)
    _convert_bytes[(1,)](x, y, N=256, KIND=kind, ASM=asm, PACK=pack)
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_byte_conversion_is_exact_interpreted(dtype):
    x, y = _converted(dtype, asm=False)
    want = x.view(FP8_DTYPE).double()
    finite = want.isfinite()  # 0x7F / 0xFF are NaN in e4m3fn; writes saturate to +-448
    got = y.double() * 2.0 ** fp8_bias(dtype)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())  # -0 stays -0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_hardware_kind_conversion_is_exact_interpreted(dtype):
    """Kind 3 (the hardware's e4m3 -> fp16, bias 0) for bf16 and fp16 queries alike."""
    assert fp8_bits_kind(dtype, hw_fp16=True) == 3 and fp8_bias(dtype, hw_fp16=True) == 0
    assert fp8_bits_kind(torch.float32, hw_fp16=True) == 0  # fp32 queries keep fp32 products
    x, y = _converted(dtype, asm=False, hw_fp16=True)
    want = x.view(FP8_DTYPE).double()
    finite = want.isfinite()
    assert y.dtype == torch.float16
    assert torch.equal(y.double()[finite], want[finite])
    assert torch.equal(y.double()[finite].signbit(), want[finite].signbit())


@pytest.fixture(params=[False, True], ids=["old-loop", "ahead-unmasked"])
def loop_flags(request, monkeypatch):
    """The GQA kernel's loop with and without block-table entries one tile ahead and the
    unmasked middle tiles (BT_AHEAD, UNMASKED_MAIN)."""
    import cp_modules.kernels.decode.paged as gqa_kernels

    monkeypatch.setattr(gqa_kernels, "BT_AHEAD", request.param)
    monkeypatch.setattr(gqa_kernels, "UNMASKED_MAIN", request.param)
    return request.param


@pytest.mark.parametrize("block_n", [16, 32], ids=["tile=block", "tile=2-blocks"])
@pytest.mark.parametrize("window_softcap", [False, True], ids=["plain", "window-softcap"])
def test_gqa_kernel_fp8_hardware_kind_interpreted(window_softcap, block_n, loop_flags):
    """The kind-3 path (each query row brought into fp16's range by a power of two) with both
    loops: within twice a same-dtype reference's error, and the same bits for queries 2**13
    times larger under a 2**13 times smaller scale (whose q * k overflow fp16 as they are).
    fp16 queries: the interpreter truncates fp32 -> bf16 stores (bf16 runs on the GPU)."""
    kc, vc, ks, vs, bt, rows, lens = fp8_gqa_shard(lengths=(1, 70, 130, 97))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(rows.numel(), 8, 32, generator=g)
    q[2] *= 1e-4  # fp16 subnormals
    q = q.to(torch.float16)
    extra = {}
    if window_softcap:
        extra = dict(query_kv_start=(lens - 40).clamp_min(0), softcap=5.0)
    # 3 stages: BT_AHEAD applies (the interpreter has no software pipeline).
    cfg = DecodeConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=3)
    args = (q, kc, vc, bt, rows, lens, 32**-0.5)
    out, lse = paged_attention_kernel(*args, 3, config=cfg, k_scale=ks, v_scale=vs, **extra)
    ref_out, ref_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs, **extra)
    same_out, same_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs, upcast=False,
                                             **extra)  # fmt: skip
    eo = (out.float() - ref_out.float()).abs().max().item()
    bo = (same_out.float() - ref_out.float()).abs().max().item()
    assert eo <= 2 * bo + 1e-6, (eo, bo)
    assert (lse - ref_lse).abs().max().item() <= 2 * (same_lse - ref_lse).abs().max().item() + 1e-5
    big = (q.float() * 2.0**13).to(torch.float16)
    assert torch.equal(big.float(), q.float() * 2.0**13)
    out2, lse2 = paged_attention_kernel(big, *args[1:6], 32**-0.5 * 2.0**-13, 3, config=cfg,
                                        k_scale=ks, v_scale=vs, **extra)  # fmt: skip
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_gqa_kernel_on_fp8_cache_half_queries_interpreted():
    """fp16 queries (products on half inputs; bf16's, whose powers of two move onto q and P,
    run on the GPU: the interpreter multiplies bf16 tiles as their raw bits): within twice a
    same-dtype reference's error of the fp32 reference."""
    dtype = torch.float16
    kc, vc, ks, vs, bt, rows, lens = fp8_gqa_shard()
    q = torch.randn(rows.numel(), 8, 32).to(dtype)
    cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    args = (q, kc, vc, bt, rows, lens, 32**-0.5)
    out, lse = paged_attention_kernel(*args, 3, config=cfg, k_scale=ks, v_scale=vs)
    ref_out, ref_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs)
    same_out, same_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs, upcast=False)
    eo = (out.float() - ref_out.float()).abs().max().item()
    bo = (same_out.float() - ref_out.float()).abs().max().item()
    assert eo <= 2 * bo + 1e-6, (eo, bo)
    assert (lse - ref_lse).abs().max().item() <= 2 * (same_lse - ref_lse).abs().max().item() + 1e-5


@pytest.mark.parametrize("window_softcap", [False, True], ids=["plain", "window-softcap"])
def test_gqa_kernel_on_fp8_cache_matches_reference_interpreted(window_softcap, k_transposed):
    kc, vc, ks, vs, bt, rows, lens = fp8_gqa_shard()
    q = torch.randn(rows.numel(), 8, 32)
    extra = {}
    if window_softcap:
        extra = dict(query_kv_start=(lens - 40).clamp_min(0), softcap=5.0)
    cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    out, lse = paged_attention_kernel(q, kc, vc, bt, rows, lens, 32**-0.5, 3, config=cfg,
                                      k_scale=ks, v_scale=vs, **extra)  # fmt: skip
    ref_out, ref_lse = paged_attention_ref(q, kc, vc, bt, rows, lens, 32**-0.5, k_scale=ks,
                                           v_scale=vs, **extra)  # fmt: skip
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    # The reference reads the cache as fp8 * scale: the same as a float cache of those values.
    kf, vf = dequantize_fp8(kc, ks, torch.float32), dequantize_fp8(vc, vs, torch.float32)
    f_out, _ = paged_attention_ref(q, kf, vf, bt, rows, lens, 32**-0.5, **extra)
    torch.testing.assert_close(ref_out, f_out, atol=1e-6, rtol=0)


def test_mla_kernel_on_fp8_cache_matches_reference_interpreted(k_transposed):
    g = torch.Generator().manual_seed(1)
    bs, rk, rope = 16, 64, 16
    cache = torch.full((6, bs, rk + rope), float("nan")).to(FP8_DTYPE)
    sc = kv_scale(0.3, 1)
    bt = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([37, 48])
    for r in range(2):
        pos = torch.arange(int(lens[r]))
        slots = bt[r, pos // bs].to(torch.int64) * bs + pos % bs
        write_mla_cache(torch.randn(pos.numel(), rk, generator=g),
                        torch.randn(pos.numel(), rope, generator=g), cache, slots, sc)  # fmt: skip
    rows = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(2, 16, rk + rope, generator=g)
    cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    out, lse = paged_mla_attention_kernel(q, cache, bt, rows, lens, 0.1, rk, 2, config=cfg,
                                          kv_scale=sc)  # fmt: skip
    ref = paged_mla_attention(q, cache, bt, rows, lens, scale=0.1, kv_lora_rank=rk, kv_scale=sc)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref[1], atol=1e-5, rtol=0)
    f_out, _ = paged_mla_attention_ref(q, dequantize_fp8(cache, sc, torch.float32), bt, rows,
                                       lens, 0.1, rk)  # fmt: skip
    torch.testing.assert_close(ref[0], f_out, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# DCP (ag_rs, a2a, packed a2a) with fp8 == one process with fp8, through the layers


def _layout(backend, interleave=1, world=2):
    from cp_modules.config import ParallelConfig

    if world == 1:
        return ParallelConfig()
    return ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2,
                          dcp_comm_backend=backend,
                          dcp_kv_cache_interleave_size=interleave)  # fmt: skip


def _fp8_cases():
    base = dict(mode="mixed", seq_lens=[19, 3, 8], decode_steps=2, block_size=4,
                kv_cache_dtype="fp8_e4m3")  # fmt: skip
    # a2a with interleave 2, gpt-oss sinks, a sliding window and soft-capping
    masked = dict(parallel=_layout("a2a", interleave=2), attention="gqa", sinks=True,
                  sliding_window=5, softcap=3.0)  # fmt: skip
    return [
        VerifyArgs(parallel=_layout("ag_rs"), attention="gqa", **base),
        VerifyArgs(parallel=_layout("a2a"), attention="gqa", packed_a2a=False, **base),
        VerifyArgs(**masked, **base),
        VerifyArgs(parallel=_layout("ag_rs"), attention="mla", **base),
        VerifyArgs(parallel=_layout("a2a"), attention="mla", **base),
        # The bf16 window of the sink and the newest tokens (cache.exact_window).
        VerifyArgs(parallel=_layout("ag_rs"), attention="gqa", fp8_window=(1, 3), **base),
        VerifyArgs(**masked, fp8_window=(2, 4), **base),
        VerifyArgs(parallel=_layout("a2a"), attention="mla", fp8_window=(1, 5), **base),
    ]


def _fp8_rank(rank, world_size, cases):
    return [verify_rank(rank, world_size, a)["errors"] for a in cases]


@pytest.mark.distributed
def test_dcp_fp8_equals_one_process_fp8():
    cases = _fp8_cases()
    per_rank = run_distributed(_fp8_rank, 2, cases, timeout_s=600)
    for errs in per_rank:
        assert len(errs) == len(cases)
        for a, e in zip(cases, errs):
            assert e and max(e.values()) <= TOLERANCE["float32"], (a, e)


def test_fp8_cache_changes_the_decode_result_one_process():
    # The fp8 run is not silently a float one: its outputs differ from the fp32 cache's by
    # about the e4m3 rounding, and not by more.
    a = VerifyArgs(parallel=_layout("ag_rs", world=1), attention="gqa", mode="decode",
                   seq_lens=[12, 5], decode_steps=1, block_size=4)  # fmt: skip
    r8 = _outputs(a, "fp8_e4m3")
    r32 = _outputs(a, "bf16")
    diff = max(float((x - y).abs().max()) for x, y in zip(r8, r32))
    scale = max(float(y.abs().max()) for y in r32)
    assert 1e-4 * scale < diff < 0.1 * scale


def _outputs(a: VerifyArgs, kv_cache_dtype: str):
    import dataclasses

    from cp_modules.modules import CPRuntime
    from cp_modules.verify import _allocate_cache, _build_layer, _config, _run, _steps

    a = dataclasses.replace(a, kv_cache_dtype=kv_cache_dtype)
    cfg = _config(a)
    steps = _steps(a)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)  # the same weights for both runs
    layer = _build_layer(a, cfg, torch.float32)
    hidden = layer.hidden_size
    inputs = [torch.randn(sum(new), hidden, generator=g) for new, _ in steps]
    max_len = max(n + c for new, comp in steps for n, c in zip(new, comp))
    per = -(-max_len // a.block_size)
    bt = (torch.arange(len(a.seq_lens) * per, dtype=torch.int32) + 1).view(-1, per)
    layer.kv_cache = _allocate_cache(layer, bt.numel() + 1, a.block_size, torch.float32, "cpu",
                                     kv_cache_dtype)  # fmt: skip
    saved = _run(layer, CPRuntime.single(), a, inputs, torch.device("cpu"), layer, bt, False)
    return [y for y, _, _, _ in saved][1:]  # the decode steps


# ---------------------------------------------------------------------------------------------
# GPU: kernels vs the reference


@pytest.mark.gpu
@pytest.mark.parametrize("pack", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fp8_byte_conversion_ptx_equals_integer_ops(dtype, pack):
    _, hw = _converted(dtype, asm=True, device="cuda", pack=pack, hw_fp16=True)
    _, hw_ops = _converted(dtype, asm=False, device="cuda", hw_fp16=True)
    nan = torch.arange(256, device="cuda").remainder(128) == 127  # e4m3fn's NaN bytes
    assert hw[nan].isnan().all()  # (the integer operations give 480 there; no write makes them)
    assert torch.equal(hw.view(torch.int16)[~nan], hw_ops.view(torch.int16)[~nan])
    _, ptx = _converted(dtype, asm=True, device="cuda", pack=pack)
    _, ops = _converted(dtype, asm=False, device="cuda")
    assert torch.equal(ptx.view(torch.int16), ops.view(torch.int16))
    want = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).double()
    finite = want.isfinite()
    assert torch.equal((ops.cpu().double() * 2.0 ** fp8_bias(dtype))[finite], want[finite])


@pytest.mark.gpu
@pytest.mark.parametrize("k_transposed", [False, True], ids=["K-NxD", "K-DxN"])
@pytest.mark.parametrize("window_softcap", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_gpu_fp8_kernels_match_reference(window_softcap, splits, k_transposed, monkeypatch):
    import cp_modules.kernels.decode.mla as mla_kernels
    import cp_modules.kernels.decode.paged as gqa_kernels

    monkeypatch.setattr(gqa_kernels, "FP8_K_TRANSPOSED", k_transposed)
    monkeypatch.setattr(mla_kernels, "FP8_K_TRANSPOSED", k_transposed)
    torch.manual_seed(0)
    dev = "cuda"
    hkv, d, bs, hq = 8, 128, 64, 32
    nb, lens = 80, torch.tensor([1, 700, 2000, 64], device=dev)
    k = torch.randn(nb * bs, hkv, d, device=dev).to(torch.bfloat16) * 4
    v = torch.randn(nb * bs, hkv, d, device=dev).to(torch.bfloat16)
    ks = kv_scale(torch.linspace(0.5, 2.0, hkv), hkv, device=dev)
    vs = kv_scale(0.7, hkv, device=dev)
    kc, vc = (torch.zeros(nb, bs, hkv, d, dtype=FP8_DTYPE, device=dev) for _ in range(2))
    slots = torch.randperm(nb * bs, device=dev)
    write_kv_cache(k, v, kc, vc, slots, ks, vs)  # the Triton kernel
    kr, vr = (torch.zeros(nb, bs, hkv, d, dtype=FP8_DTYPE) for _ in range(2))
    write_kv_cache(k.cpu(), v.cpu(), kr, vr, slots.cpu(), ks.cpu(), vs.cpu())
    for got, want in ((kc.cpu(), kr), (vc.cpu(), vr)):
        bad = got.view(torch.uint8) != want.view(torch.uint8)  # bytes, -0 included
        assert not bad.any(), (int(bad.sum()), got[bad][:8].float(), want[bad][:8].float())
    bt = torch.stack([torch.randperm(nb, device=dev)[:32] for _ in range(4)]).to(torch.int32)
    rows = torch.arange(4, device=dev, dtype=torch.int32)
    q = torch.randn(4, hq, d, device=dev).to(torch.bfloat16)
    extra = dict(query_kv_start=(lens - 300).clamp_min(0), softcap=20.0) if window_softcap else {}
    args = (q, kc, vc, bt, rows, lens)
    out, lse = paged_attention(*args, scale=d**-0.5, num_splits=splits, k_scale=ks, v_scale=vs,
                               **extra)  # fmt: skip
    ref_out, ref_lse = paged_attention_ref(*args, d**-0.5, k_scale=ks, v_scale=vs, **extra)
    same_out, same_lse = paged_attention_ref(*args, d**-0.5, k_scale=ks, v_scale=vs, upcast=False,
                                             **extra)  # fmt: skip
    _assert_within_twice_same_dtype(out, lse, (ref_out, ref_lse), (same_out, same_lse))
    # MLA 128, 48, 32 and 16 heads (auto routes 128 heads to the Gluon kernel's fp8 path, 48 to
    # the heads-on-M Triton kernel, 32 and 16 to the tokens-on-M one; 'gluon' is refused for 16).
    c = torch.randn(nb * bs, 576, device=dev).to(torch.bfloat16)
    cache = torch.zeros(nb, bs, 576, dtype=FP8_DTYPE, device=dev)
    sc = kv_scale(0.5, 1, device=dev)
    write_mla_cache(c[:, :512], c[:, 512:], cache, slots, sc)
    margs16 = None
    for heads in (16, 32, 48, 128):
        qm = torch.randn(4, heads, 576, device=dev).to(torch.bfloat16)
        margs = (qm, cache, bt, rows, lens)
        margs16 = margs16 or margs
        o, l_ = paged_mla_attention(*margs, scale=0.07, kv_lora_rank=512, num_splits=splits,
                                    kv_scale=sc)  # fmt: skip
        r_o, r_l = paged_mla_attention_ref(*margs, 0.07, 512, kv_scale=sc)
        s_o, s_l = paged_mla_attention_ref(*margs, 0.07, 512, kv_scale=sc, upcast=False)
        eo = (o.float() - r_o.float()).abs().max().item()
        bo = (s_o.float() - r_o.float()).abs().max().item()
        assert eo <= 2 * bo + 1e-4, (heads, eo, bo)
        assert (l_ - r_l).abs().max().item() <= 2 * (s_l - r_l).abs().max().item() + 1e-4
    with pytest.raises(ValueError, match="heads a multiple of 64"):
        paged_mla_attention(*margs16, scale=0.07, kv_lora_rank=512, kernel="gluon", kv_scale=sc)


_LOOP_VARIANTS = {
    "old": dict(BT_AHEAD=False, UNMASKED_MAIN=False, FP8_HW_FP16=False),
    "hw16-N128": dict(FP8_STAGED=False, FP8_BLOCK_N=128),
    "hw16-staged-N128": dict(FP8_STAGED=True, FP8_BLOCK_N=128),
    "hw16-staged-N64": dict(FP8_STAGED=True, FP8_BLOCK_N=64),
    "hw16-N64": dict(FP8_STAGED=False, FP8_BLOCK_N=64),
}


def gpu_decode_queries(case: str, ends, nb: int, width: int, hq: int, d: int, q_len: int):
    """A GPU decode batch: a random block table of ``width`` blocks a request, ``q_len``
    queries at each request's end ``ends[i]`` (rows, kv lengths), bf16 queries, and the
    case's window (333 tokens) or soft-cap (20) arguments."""
    dev = "cuda"
    bt = torch.stack([torch.randperm(nb, device=dev)[:width] for _ in ends]).to(torch.int32)
    rows = torch.arange(len(ends), device=dev, dtype=torch.int32).repeat_interleave(q_len)
    steps = torch.arange(q_len, device=dev) - q_len + 1
    lens = (torch.tensor(ends, device=dev)[:, None] + steps).clamp_min(0).flatten()
    q = torch.randn(rows.numel(), hq, d, device=dev).to(torch.bfloat16)
    extra: dict = {}
    if case.startswith("window"):
        extra["query_kv_start"] = (lens - 333).clamp_min(0)
    if "softcap" in case:
        extra["softcap"] = 20.0
    return bt, rows, lens, q, extra


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(_LOOP_VARIANTS))
@pytest.mark.parametrize("case", ["plain-Q1", "window-softcap-Q1", "window-Q4"])
def test_gpu_fp8_gqa_loop_variants_match_reference(variant, case, monkeypatch):
    """The GQA kernel's loop and conversion switches on an fp8 cache (bf16 queries, split
    counts chosen, lengths that end mid-tile, a window that starts mid-tile, runs of 4): the
    2x rule against the fp32 reference."""
    import cp_modules.kernels.decode.paged as gqa_kernels

    for name, value in _LOOP_VARIANTS[variant].items():
        monkeypatch.setattr(gqa_kernels, name, value)
    torch.manual_seed(1)
    dev, hkv, d, bs, hq = "cuda", 8, 128, 64, 32
    q_len = 4 if case.endswith("Q4") else 1
    nb, ends = 300, [1, 700, 5000, 64, 2049]
    k = torch.randn(nb * bs, hkv, d, device=dev).to(torch.bfloat16) * 4
    v = torch.randn(nb * bs, hkv, d, device=dev).to(torch.bfloat16)
    ks = kv_scale(torch.linspace(0.5, 2.0, hkv), hkv, device=dev)
    vs = kv_scale(0.7, hkv, device=dev)
    kc, vc = (torch.zeros(nb, bs, hkv, d, dtype=FP8_DTYPE, device=dev) for _ in range(2))
    write_kv_cache(k, v, kc, vc, torch.randperm(nb * bs, device=dev), ks, vs)
    bt, rows, lens, q, extra = gpu_decode_queries(case, ends, nb, 100, hq, d, q_len)
    args = (q, kc, vc, bt, rows, lens)
    out, lse = paged_attention(*args, scale=d**-0.5, k_scale=ks, v_scale=vs, query_len=q_len,
                               **extra)  # fmt: skip
    ref_out, ref_lse = paged_attention_ref(*args, d**-0.5, k_scale=ks, v_scale=vs, **extra)
    same_out, same_lse = paged_attention_ref(*args, d**-0.5, k_scale=ks, v_scale=vs, upcast=False,
                                             **extra)  # fmt: skip
    _assert_within_twice_same_dtype(out, lse, (ref_out, ref_lse), (same_out, same_lse))


def test_fp8_on_a_gpu_without_fp8_and_bad_recipe_option_raise(monkeypatch):
    from recipe_configs import BackendConf

    from cp_modules.cache import kv_dtype

    monkeypatch.setattr(kv_dtype.torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(kv_dtype.torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' needs a GPU with fp8.*A100"):
        kv_cache_storage_dtype("fp8_e4m3", torch.bfloat16, "cuda")
    assert kv_cache_storage_dtype("bf16", torch.bfloat16, "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="backend.kv_cache_dtype must be one of"):
        BackendConf(kv_cache_dtype="fp8")
