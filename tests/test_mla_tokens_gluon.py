"""The warp-specialised Gluon tokens-on-M MLA decode kernel on fp8 (e4m3) latent caches
(``kernels/decode/mla_tokens_gluon.py``): refused inputs and a compile for sm_90a on the CPU;
against the fp32 reference, the op's routing and CUDA-graph replays on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_mla_tokens_on_m import _check as _mla_check
from test_mla_tokens_on_m import _inputs as _mla_inputs

import cp_modules.kernels.decode.mla_regs_gluon as rg
import cp_modules.kernels.decode.mla_tokens_gluon as tg
from cp_modules.kernels.decode.mla import paged_mla_attention_kernel
from cp_modules.kernels.decode.mla_tokens_gluon import (
    paged_mla_tokens_gluon,
    tokens_gluon_supported,
)
from cp_modules.reference.paged_decode import paged_mla_attention_ref
from cp_modules.testing.numerics import assert_decode_close

ROOT = Path(__file__).resolve().parents[1]
RK, ROPE = 512, 64


def _inputs(bs, heads, lens, dtype=torch.bfloat16, dev="cpu", seed=0):
    """DeepSeek's latent (512 + 64), e4m3 with NaN bytes in every unwritten slot."""
    return _mla_inputs(bs, RK, ROPE, heads, lens, dtype, dev, seed)


def _check(out, lse, q, cache, bt, rows, lens, sc, scale):
    """The 2x rule against the fp32 reference; -inf LSE and zero output on empty rows."""
    _mla_check(out, lse, q, cache, bt, rows, lens, sc, scale, RK)


def check_unserved_refused(supported, op, has_gluon):
    """``supported`` names why for each input a few-head fp8 MLA kernel cannot serve, and
    ``op`` raises ``ValueError`` with it."""
    q, cache, bt, rows, lens, sc = _inputs(16, 16, [10])
    cases = [
        ((q.float(), cache, RK), "bf16/fp16 queries, not torch.float32"),
        ((q, cache.float(), RK), "fp8 \\(e4m3\\) caches, not torch.float32"),
        ((torch.zeros(1, 33, RK + ROPE, dtype=torch.bfloat16), cache, RK), "at most 32 heads"),
        ((q[..., :448], cache[..., :448], 384), "kv_lora_rank 512 with a rope width of 64"),
        ((q, cache, RK), "needs an sm_90 GPU" if has_gluon else "needs Triton's Gluon"),
    ]
    for (qq, cc, r), msg in cases:
        assert supported(qq, cc, r) is not None
        with pytest.raises(ValueError, match=msg):
            op(qq, cc, bt, rows, lens, 0.1, r)


def check_falls_back():
    """Inputs the few-head Gluon kernels cannot serve (no sm_90 GPU, a 64-wide latent) go on to
    the Triton kernels through the op, matching the reference."""
    q, cache, bt, rows, lens, sc = _inputs(16, 16, [40, 3], dtype=torch.float16)
    q, cache = q[..., : 64 + 16].contiguous(), cache[..., : 64 + 16].contiguous()
    out, lse = paged_mla_attention_kernel(q, cache, bt, rows, lens, 0.1, 64, 2, kv_scale=sc)
    ref = paged_mla_attention_ref(q, cache, bt, rows, lens, 0.1, 64, kv_scale=sc)
    same = paged_mla_attention_ref(q, cache, bt, rows, lens, 0.1, 64, kv_scale=sc, upcast=False)
    assert_decode_close(out, lse, ref, same, atol=1e-4)


def test_unserved_inputs_are_refused_naming_why():
    check_unserved_refused(tokens_gluon_supported, paged_mla_tokens_gluon, tg.HAS_GLUON)


def test_the_op_never_routes_here_without_the_gpu(monkeypatch):
    """With the switch on, inputs this kernel cannot serve (here: no sm_90 GPU) go on to the
    Triton kernels, matching the reference."""
    monkeypatch.setattr(tg, "FP8_TOKENS_GLUON", True)
    check_falls_back()


_COMPILE = """
import json, sys
sys.path.insert(0, "tools")
from compile_mla_tokens_gluon import compile_sm90
out = []
for page, partial, bh, pipe in ((64, True, 16, False), (16, True, 16, True),
                                (64, False, 16, True), (12, True, 32, False)):
    k = compile_sm90(page, partial, bh, pipe=pipe)
    ptx = k.asm["ptx"]
    out.append([page, k.metadata.shared, ptx.count("wgmma.mma_async"),
                "cvt.rn.f16x2.e4m3x2" in ptx, ptx.count("setmaxnreg")])
print(json.dumps(out))
"""


@pytest.mark.skipif(not tg.HAS_GLUON, reason="needs Triton's Gluon")
def test_kernel_compiles_for_sm90_without_a_gpu():
    """The kernel compiled for sm_90a (in a process without the interpreter) at block sizes
    64, 16 and 12, split and unsplit, 16 and 32 heads, both product loops: within one program an SM's shared
    memory, the 17 warp-group MMAs of a tile, the hardware e4m3 conversion, and the three
    partitions' register split."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r[0] for r in rows] == [64, 16, 64, 12]
    for _, shared, wgmma, cvt, maxnreg in rows:
        assert shared <= 232448 and cvt and maxnreg >= 2, rows
        assert wgmma >= 17, rows  # 9 score products and 8 value products a tile


def _gpu_ok():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def check_edges_twice(op, bs, heads, splits):
    """``op`` (a few-head fp8 MLA kernel's launcher) at lengths at and around the tile edges and
    an empty row, NaN in every unwritten slot, against the fp32 reference; the same bits on a
    second launch."""
    lens = [1, 700, 0, 63, 64, 65, 2000, 4097]
    q, cache, bt, rows, lens_t, sc = _inputs(bs, heads, lens, dev="cuda", seed=heads + bs)
    out, lse = op(q, cache, bt, rows, lens_t, 0.07, RK, splits, kv_scale=sc)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == (len(lens), heads, RK)
    _check(out, lse, q, cache, bt, rows, lens_t, sc, 0.07)
    again = op(q, cache, bt, rows, lens_t, 0.07, RK, splits, kv_scale=sc)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def check_query_magnitudes(op):
    """fp16 queries, and query rows far outside fp16's range and an all-zero row (each row
    brought into fp16 by its own power of two): the reference's result."""
    q, cache, bt, rows, lens_t, sc = _inputs(64, 16, [900, 33], dev="cuda", seed=3)
    q[0, 0] *= 2.0**30
    q[0, 1] *= 2.0**-40
    q[1, 2] = 0
    scale = 2.0**-31
    out, lse = op(q, cache, bt, rows, lens_t, scale, RK, 2, kv_scale=sc)
    _check(out, lse, q, cache, bt, rows, lens_t, sc, scale)
    q16, cache, bt, rows, lens_t, sc = _inputs(16, 16, [300, 1, 128], torch.float16, "cuda", 4)
    out, lse = op(q16, cache, bt, rows, lens_t, 0.05, RK, None, kv_scale=sc)
    assert out.dtype == torch.float16
    _check(out, lse, q16, cache, bt, rows, lens_t, sc, 0.05)


def check_routed_and_replayed(op):
    """With ``op``'s switch on, the op's routing gives the bits of a direct call at 16 heads,
    and a captured decode replays with new lengths (splits chosen from static shapes).
    Returns the inputs for further checks."""
    lens = [3000, 17, 512]
    q, cache, bt, rows, lens_t, sc = _inputs(64, 16, lens, dev="cuda", seed=9)
    direct = op(q, cache, bt, rows, lens_t, 0.07, RK, None, kv_scale=sc)
    routed = paged_mla_attention_kernel(q, cache, bt, rows, lens_t, 0.07, RK, None, kv_scale=sc)
    assert torch.equal(routed[0], direct[0]) and torch.equal(routed[1], direct[1])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_mla_attention_kernel(q, cache, bt, rows, lens_t, 0.07, RK, None, kv_scale=sc)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = paged_mla_attention_kernel(q, cache, bt, rows, lens_t, 0.07, RK, None,
                                                  kv_scale=sc)  # fmt: skip
    for new in ([2999, 16, 1], [1, 3000, 0]):
        lens_t.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        _check(g_out, g_lse, q, cache, bt, rows, lens_t, sc, 0.07)
    return q, cache, bt, rows, lens_t, sc


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("bs", [64, 16])
@pytest.mark.parametrize("heads", [16, 8, 20, 32])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("pipe", [False, True], ids=["serial", "pipelined"])
def test_gpu_tokens_gluon_matches_reference(monkeypatch, bs, heads, splits, pipe):
    """DeepSeek's latent at 8-32 heads (its 128 split by tensor parallelism), lengths at and
    around the tile edges and an empty row, NaN in every unwritten slot; both product loops
    (TOK_PIPELINE)."""
    monkeypatch.setattr(tg, "TOK_PIPELINE", pipe)
    check_edges_twice(paged_mla_tokens_gluon, bs, heads, splits)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
def test_gpu_tokens_gluon_fp16_and_query_rows_of_any_magnitude():
    """fp16 queries; each query row brought into fp16 by its own power of two: rows far outside
    fp16's range and an all-zero row give the reference's result."""
    check_query_magnitudes(paged_mla_tokens_gluon)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
def test_gpu_op_routes_here_with_the_switch_and_replays_in_a_graph(monkeypatch):
    """The switch routes fp8 caches with up to 32 heads here (the same bits as a direct call),
    and a captured decode replays with new lengths (splits chosen from static shapes); the
    register-operand kernel, routed first, off."""
    monkeypatch.setattr(tg, "FP8_TOKENS_GLUON", True)
    monkeypatch.setattr(rg, "FP8_REGS_GLUON", False)
    q, cache, bt, rows, lens_t, sc = check_routed_and_replayed(paged_mla_tokens_gluon)
    monkeypatch.setattr(tg, "paged_mla_tokens_gluon", None)  # 64 heads: not routed here
    q64 = torch.randn(3, 64, RK + ROPE, device="cuda").bfloat16()
    out, lse = paged_mla_attention_kernel(q64, cache, bt, rows, lens_t, 0.07, RK, 2, kv_scale=sc)
    _check(out, lse, q64, cache, bt, rows, lens_t, sc, 0.07)
