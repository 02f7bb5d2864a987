"""The tokens-on-M MLA decode kernel on fp8 (e4m3) latent caches (few heads): against the
reference under the interpreter (CPU) and on the GPU, its dispatch switch, refused inputs."""

from __future__ import annotations

import pytest
import torch

import cp_modules.kernels.decode.mla_tokens as mla_tokens
from cp_modules.cache.kv_dtype import FP8_DTYPE, dequantize_fp8, kv_scale
from cp_modules.kernels.decode.mla import paged_mla_attention_kernel
from cp_modules.kernels.decode.mla_tokens import paged_mla_tokens_on_m, tokens_on_m_supported
from cp_modules.ops.kv_cache import write_mla_cache
from cp_modules.reference.paged_decode import paged_mla_attention_ref
from cp_modules.testing.numerics import assert_decode_close
from cp_modules.testing.paged import scattered_block_table


def _inputs(bs, rk, rope, heads, lens, dtype, dev="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    bt, nb, slots = scattered_block_table(lens, bs, g)
    # Unwritten slots hold NaN bytes: rows past a range must never reach P @ V.
    cache = torch.full((nb, bs, rk + rope), float("nan")).to(FP8_DTYPE)
    sc = kv_scale(0.3, 1)
    for row_slots in slots:
        n = row_slots.numel()
        write_mla_cache(torch.randn(n, rk, generator=g) * 2, torch.randn(n, rope, generator=g),
                        cache, row_slots, sc)  # fmt: skip
    rows = torch.arange(len(lens), dtype=torch.int32)
    q = (torch.randn(len(lens), heads, rk + rope, generator=g) * 3).to(dtype)
    lens_t = torch.tensor(lens)
    return [x.to(dev) for x in (q, cache, bt, rows, lens_t, sc)]


def _check(out, lse, q, cache, bt, rows, lens, sc, scale, rk, atol=1e-4):
    """Within twice the same-dtype reference's error of the fp32 reference (+ atol), -inf LSE
    exactly where the reference has it."""
    ref = paged_mla_attention_ref(q, cache, bt, rows, lens, scale, rk, kv_scale=sc)
    same = paged_mla_attention_ref(q, cache, bt, rows, lens, scale, rk, kv_scale=sc, upcast=False)
    assert_decode_close(out, lse, ref, same, atol=atol)
    empty = torch.isneginf(ref[1])
    assert torch.equal(out[empty.to(out.device)].float(), torch.zeros_like(out[empty]).float())


@pytest.mark.parametrize(
    "bs,heads,lens,splits,dtype",
    [
        (16, 16, [37, 130, 0, 64], 2, torch.bfloat16),  # four blocks a tile, a split, an empty row
        (64, 16, [200, 1, 64], 1, torch.float16),  # one block a tile, unsplit
        (128, 20, [150, 129], None, torch.bfloat16),  # two head tiles (the second masked), auto
        (12, 16, [61, 5], 3, torch.bfloat16),  # a block size that neither divides nor is divided
    ],
)
def test_tokens_on_m_matches_reference_interpreted(bs, heads, lens, splits, dtype):
    _tokens_on_m_matches_reference(bs, heads, lens, splits, dtype)


@pytest.mark.parametrize("heads,wide", [(20, True), (32, True), (32, False)])
def test_tokens_on_m_wide_or_two_head_tiles_interpreted(monkeypatch, heads, wide):
    """FP8_WIDE_HEADS: 17-32 heads as one 32-head tile (its second half masked at 20); off, as
    two 16-head tiles."""
    monkeypatch.setattr(mla_tokens, "FP8_WIDE_HEADS", wide)
    _tokens_on_m_matches_reference(16, heads, [150, 3, 64], 2, torch.bfloat16)


def test_tokens_on_m_128_token_tile_interpreted(monkeypatch):
    monkeypatch.setattr(mla_tokens, "FP8_TILE", (128, 8, 1))
    _tokens_on_m_matches_reference(16, 16, [300, 128, 5], 2, torch.bfloat16)


def _tokens_on_m_matches_reference(bs, heads, lens, splits, dtype):
    rk, rope, scale = 64, 16, 0.11
    q, cache, bt, rows, lens_t, sc = _inputs(bs, rk, rope, heads, lens, dtype)
    out, lse = paged_mla_tokens_on_m(q, cache, bt, rows, lens_t, scale, rk, splits, kv_scale=sc)
    assert out.dtype == dtype and out.shape == (len(lens), heads, rk)
    _check(out, lse, q, cache, bt, rows, lens_t, sc, scale, rk)
    # The reference reads the cache as fp8 * scale: the same as a float cache of those values.
    f_out, _ = paged_mla_attention_ref(q, dequantize_fp8(cache, sc, torch.float32), bt, rows,
                                       lens_t, scale, rk)  # fmt: skip
    ref = paged_mla_attention_ref(q, cache, bt, rows, lens_t, scale, rk, kv_scale=sc)
    torch.testing.assert_close(ref[0], f_out, atol=1e-6, rtol=0)


def test_tokens_on_m_query_rows_of_any_magnitude_interpreted():
    """Each query row is brought into fp16 by its own power of two: rows far outside fp16's
    range (and an all-zero row) give the reference's result."""
    rk, rope = 64, 16
    q, cache, bt, rows, lens_t, sc = _inputs(16, rk, rope, 16, [90, 33], torch.bfloat16, seed=3)
    q[0, 0] *= 2.0**30
    q[0, 1] *= 2.0**-40
    q[1, 2] = 0
    scale = 2.0**-31  # keeps the first head's scores finite and O(1)
    out, lse = paged_mla_tokens_on_m(q, cache, bt, rows, lens_t, scale, rk, 1, kv_scale=sc)
    _check(out, lse, q, cache, bt, rows, lens_t, sc, scale, rk)


@pytest.mark.parametrize("bs,lens,splits", [(16, [37, 130, 0], 2), (64, [200, 64], 1)])
def test_tokens_on_m_on_a_16_bit_cache_matches_reference_interpreted(bs, lens, splits):
    """A cache of the query's dtype (fp16 here: the interpreter's dot reads bf16 operands as
    their bit patterns; bf16 runs on the GPU)."""
    rk, rope, scale = 64, 16, 0.11
    q, cache8, bt, rows, lens_t, sc = _inputs(bs, rk, rope, 16, lens, torch.float16)
    cache = dequantize_fp8(cache8, sc, torch.float32).nan_to_num(0.0).half()
    out, lse = paged_mla_tokens_on_m(q, cache, bt, rows, lens_t, scale, rk, splits)
    assert out.dtype == torch.float16
    _check(out, lse, q, cache, bt, rows, lens_t, None, scale, rk)


def test_switch_routes_few_heads_and_falls_back_otherwise(monkeypatch):
    rk, rope = 64, 16
    q, cache, bt, rows, lens_t, sc = _inputs(16, rk, rope, 16, [70, 20], torch.bfloat16, seed=5)
    direct = paged_mla_tokens_on_m(q, cache, bt, rows, lens_t, 0.1, rk, 2, kv_scale=sc)
    monkeypatch.setattr(mla_tokens, "FP8_TOKENS_ON_M", True)
    routed = paged_mla_attention_kernel(q, cache, bt, rows, lens_t, 0.1, rk, 2, kv_scale=sc)
    assert torch.equal(routed[0], direct[0]) and torch.equal(routed[1], direct[1])
    # fp32 queries are not served: the heads-on-M kernel runs them, still matching.
    q32 = q.float()
    assert "bf16/fp16 queries" in (tokens_on_m_supported(q32, cache, rk) or "")
    out, lse = paged_mla_attention_kernel(q32, cache, bt, rows, lens_t, 0.1, rk, 2, kv_scale=sc)
    ref = paged_mla_attention_ref(q32, cache, bt, rows, lens_t, 0.1, rk, kv_scale=sc)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=0)
    # Switched off, the heads-on-M kernel runs (fp16 queries here: the interpreter's dot reads
    # bf16 operands as their bit patterns, so that kernel's bf16 path is checked on the GPU).
    # The 16-bit switch routes a cache of the query's dtype (its own, off by default).
    c16 = dequantize_fp8(cache, sc, torch.float32).nan_to_num(0.0).half()
    q16 = q.half()
    direct16 = paged_mla_tokens_on_m(q16, c16, bt, rows, lens_t, 0.1, rk, 2)
    assert not torch.equal(paged_mla_attention_kernel(q16, c16, bt, rows, lens_t, 0.1, rk, 2)[0],
                           direct16[0])  # fmt: skip
    monkeypatch.setattr(mla_tokens, "BF16_TOKENS_ON_M", True)
    routed16 = paged_mla_attention_kernel(q16, c16, bt, rows, lens_t, 0.1, rk, 2)
    assert torch.equal(routed16[0], direct16[0]) and torch.equal(routed16[1], direct16[1])
    monkeypatch.setattr(mla_tokens, "FP8_TOKENS_ON_M", False)
    off = paged_mla_attention_kernel(q16, cache, bt, rows, lens_t, 0.1, rk, 2, kv_scale=sc)
    on = paged_mla_tokens_on_m(q16, cache, bt, rows, lens_t, 0.1, rk, 2, kv_scale=sc)
    assert not torch.equal(off[0], on[0])  # another kernel: other roundings
    _check(off[0], off[1], q16, cache, bt, rows, lens_t, sc, 0.1, rk)


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "16-head-tiles"])
def test_the_op_routes_only_one_head_tile_here(monkeypatch, wide):
    """The op routes 17-32 heads here only as one wide head tile (FP8_WIDE_HEADS, fp8); with
    two 16-head tiles (each program would read the whole cache), or a 16-bit cache, over
    ROUTE_MAX_HEADS heads run on the heads-on-M kernel even with the switch on. Called directly
    this kernel serves them either way."""
    monkeypatch.setattr(mla_tokens, "FP8_WIDE_HEADS", wide)
    monkeypatch.setattr(mla_tokens, "BF16_TOKENS_ON_M", True)
    assert mla_tokens.FP8_TOKENS_ON_M and mla_tokens.ROUTE_MAX_HEADS == 16
    calls = []
    real = mla_tokens.paged_mla_tokens_on_m

    def spy(q, cache, *args, **kwargs):
        calls.append((q.shape[1], cache.dtype))
        return real(q, cache, *args, **kwargs)

    monkeypatch.setattr(mla_tokens, "paged_mla_tokens_on_m", spy)
    rk, rope = 64, 16
    want = []
    for heads in (16, 20):
        q, cache, bt, rows, lens_t, sc = _inputs(16, rk, rope, heads, [70, 20], torch.float16,
                                                 seed=6)  # fmt: skip
        c16 = dequantize_fp8(cache, sc, torch.float32).nan_to_num(0.0).half()
        for c, s in ((cache, sc), (c16, None)):
            assert mla_tokens.tokens_on_m_supported(q, c, rk) is None
            routed = heads <= 16 or (wide and c is cache)
            assert mla_tokens.tokens_on_m_switched_on(c, heads) == routed
            want += [(heads, c.dtype)] if routed else []
            out, lse = paged_mla_attention_kernel(q, c, bt, rows, lens_t, 0.1, rk, 2, kv_scale=s)
            _check(out, lse, q, c, bt, rows, lens_t, s, 0.1, rk)
    assert calls == want
    out, lse = real(q, cache, bt, rows, lens_t, 0.1, rk, 2, kv_scale=sc)  # 20 heads, direct
    _check(out, lse, q, cache, bt, rows, lens_t, sc, 0.1, rk)


def test_unserved_inputs_are_refused_naming_why():
    rk, rope = 64, 16
    q, cache, bt, rows, lens_t, sc = _inputs(16, rk, rope, 16, [10], torch.bfloat16)
    fp16_cache = torch.zeros(cache.shape, dtype=torch.float16)
    cases = [
        ((q, fp16_cache, rk), "caches of the query's dtype, not torch.float16 with torch.bfloat16"),
        ((q.float(), cache, rk), "bf16/fp16 queries, not torch.float32"),
        ((torch.zeros(1, 33, rk + rope, dtype=torch.bfloat16), cache, rk), "at most 32 heads"),
        ((q[..., : 48 + rope], cache[..., : 48 + rope], 48), "kv_lora_rank / 4 a power of two"),
        ((q[..., : rk + 8], cache[..., : rk + 8], rk), "rope width that is a power of two"),
    ]
    for (qq, cc, r), msg in cases:
        assert tokens_on_m_supported(qq, cc, r) is not None
        with pytest.raises(ValueError, match=msg):
            paged_mla_tokens_on_m(qq, cc, bt, rows, lens_t, 0.1, r)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 16])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_gpu_tokens_on_m_matches_reference(bs, splits, kv):
    """DeepSeek's latent (512 + 64) at 16 heads (its 128 split 8 ways) on the H200, fp8 and
    bf16 caches."""
    lens = [1, 700, 2000, 64, 4097]
    q, cache, bt, rows, lens_t, sc = _inputs(bs, 512, 64, 16, lens, torch.bfloat16, dev="cuda")
    if kv == "bf16":
        cache, sc = dequantize_fp8(cache, sc, torch.float32).nan_to_num(0.0).bfloat16(), None
    out, lse = paged_mla_tokens_on_m(q, cache, bt, rows, lens_t, 0.07, 512, splits, kv_scale=sc)
    torch.cuda.synchronize()
    _check(out, lse, q, cache, bt, rows, lens_t, sc, 0.07, 512)


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import cp_modules.kernels.decode.mla_tokens as mla_tokens

fn = mla_tokens._mla_tokens_on_m_kernel
ptrs = {"Q": "*bf16", "C": "*u8", "BT": "*i32", "SEQ_IDX": "*i32", "KV_LEN": "*i32",
        "OUT": "*fp32", "LSE": "*fp32", "KV_SCALE": "*fp32", "qk_scale": "fp32"}
for page, fp8, tile, h in ((64, True, mla_tokens.FP8_TILE, 16),
                           (16, True, mla_tokens.FP8_TILE, 16),
                           (64, False, mla_tokens.BF16_TILE, 16), (64, True, (128, 8, 1), 16),
                           (64, True, mla_tokens.FP8_WIDE_TILE, 32)):
    consts = dict(H=h, NUM_HEAD_TILES=1, PAGE=page, R=512, P=64, BLOCK_H=h, BLOCK_N=tile[0],
                  PARTIAL=True, KV_FP8=fp8, FP8_ASM=True)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    sig["C"] = "*u8" if fp8 else "*bf16"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs if n[0] != "q"}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": tile[1], "num_stages": 2})
    ptx = k.asm["ptx"]
    print(page, k.metadata.shared * tile[2] <= 232448, ("cvt.rn.f16x2.e4m3x2" in ptx) == fp8,
          "wgmma" in ptx, k.metadata.shared)
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    """What the interpreter does not check (e.g. globals a compiled kernel cannot read): the
    kernel compiled for sm_90a as 16-head DeepSeek launches (fp8 at block sizes 64 and 16, bf16,
    fp8 on the bench's 128 x 8 tile, fp8 with 32 heads on the wide tile; in a process without the interpreter): warp-group MMAs, the hardware conversion where the
    cache is fp8, in the shared memory of the programs an SM that the launcher's split count
    assumes."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln.split() for ln in done.stdout.strip().splitlines()]
    assert [ln[0] for ln in lines] == ["64", "16", "64", "64", "64"], done.stdout
    for _, fits, cvt, wgmma, _ in lines:
        assert fits == cvt == wgmma == "True", done.stdout
