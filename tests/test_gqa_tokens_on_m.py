"""The tokens-on-M GQA decode kernel (bf16/fp16 caches): against the reference under the
interpreter (fp16: the interpreter's dot reads bf16 operands as their bit patterns) and on the
GPU, the op's switch, refused inputs, a compile for sm_90a."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cp_modules.kernels.decode.gqa_tokens as gqa_tokens
from cp_modules.kernels.decode.gqa_tokens import gqa_tokens_on_m_supported, paged_gqa_tokens_on_m
from cp_modules.ops.paged_decode import _paged_attention_cuda
from cp_modules.reference.paged_decode import paged_attention_ref
from cp_modules.testing.numerics import assert_decode_close
from cp_modules.testing.paged import scattered_block_table


def _inputs(bs, hq, hkv, d, lens, dtype, dev="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    bt, nb, slots = scattered_block_table(lens, bs, g)
    # Unwritten slots hold NaN: rows past a range must never reach P @ V.
    kc = torch.full((nb * bs, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full((nb * bs, hkv, d), float("nan"), dtype=dtype)
    for n, row_slots in zip(lens, slots, strict=True):
        kc[row_slots] = torch.randn(int(n), hkv, d, generator=g).to(dtype)
        vc[row_slots] = torch.randn(int(n), hkv, d, generator=g).to(dtype)
    kc, vc = kc.view(nb, bs, hkv, d), vc.view(nb, bs, hkv, d)
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).to(dtype)
    rows = torch.arange(len(lens), dtype=torch.int32)
    return [x.to(dev) for x in (q, kc, vc, bt, rows, torch.tensor(lens))]


def _check(out, lse, q, kc, vc, bt, rows, lens, scale, atol=1e-4):
    ref = paged_attention_ref(q, kc, vc, bt, rows, lens, scale)
    same = paged_attention_ref(q, kc, vc, bt, rows, lens, scale, upcast=False)
    assert_decode_close(out, lse, ref, same, atol=atol)


@pytest.mark.parametrize(
    "bs,hq,hkv,lens,splits",
    [
        (16, 8, 2, [37, 130, 0], 2),  # four blocks a tile, Llama's group of 4, an empty row
        (64, 14, 2, [200, 1, 64], 1),  # one block a tile, Qwen's group of 7, unsplit
        (128, 4, 4, [150, 129], None),  # MHA (a group of 1), auto splits
        (12, 64, 2, [61, 5], 3),  # a block size that neither divides nor is divided; 32 a group
    ],
)
def test_tokens_on_m_gqa_matches_reference_interpreted(bs, hq, hkv, lens, splits):
    q, kc, vc, bt, rows, lens_t = _inputs(bs, hq, hkv, 32, lens, torch.float16)
    out, lse = paged_gqa_tokens_on_m(q, kc, vc, bt, rows, lens_t, 0.2, splits)
    assert out.dtype == torch.float16 and out.shape == q.shape
    _check(out, lse, q, kc, vc, bt, rows, lens_t, 0.2)


def test_op_switch_routes_what_it_serves(monkeypatch):
    q, kc, vc, bt, rows, lens_t = _inputs(16, 8, 2, 32, [70, 20], torch.float16, seed=4)
    direct = paged_gqa_tokens_on_m(q, kc, vc, bt, rows, lens_t, 0.2, 2)
    calls = []

    def counted(*args):
        calls.append(args)
        return paged_gqa_tokens_on_m(*args)

    monkeypatch.setattr(gqa_tokens, "paged_gqa_tokens_on_m", counted)
    _paged_attention_cuda(q, kc, vc, bt, rows, lens_t, 0.2, 2)
    assert not calls  # off by default: the heads-on-M kernel
    monkeypatch.setattr(gqa_tokens, "GQA_TOKENS_ON_M", True)
    on = _paged_attention_cuda(q, kc, vc, bt, rows, lens_t, 0.2, 2)
    assert len(calls) == 1
    assert torch.equal(on[0], direct[0]) and torch.equal(on[1], direct[1])
    # A soft-cap is not served: the heads-on-M kernel runs it, matching the reference.
    capped = _paged_attention_cuda(q, kc, vc, bt, rows, lens_t, 0.2, 2, None, 5.0)
    assert len(calls) == 1
    ref = paged_attention_ref(q, kc, vc, bt, rows, lens_t, 0.2, softcap=5.0)
    torch.testing.assert_close(capped[0].float(), ref[0].float(), atol=2e-3, rtol=0)


def test_unserved_inputs_are_refused_naming_why():
    q, kc, vc, bt, rows, lens_t = _inputs(16, 8, 2, 32, [10], torch.float16)
    starts = torch.zeros(1, dtype=torch.int32)
    cases = [
        ((q.float(), kc, vc), {}, "bf16/fp16 queries, not torch.float32"),
        ((q, kc.bfloat16(), vc), {}, "caches of the query's dtype"),
        ((q, kc, vc), {"query_kv_start": starts}, "no window, no soft-cap, one query a run"),
        ((q, kc, vc), {"softcap": 3.0}, "no window"),
        ((q, kc, vc), {"query_len": 2}, "one query a run"),
        ((q[..., :24], kc[..., :24], vc[..., :24]), {}, "powers of two >= 16, not 24 and 24"),
        ((q, kc, vc[..., :16]), {}, "not 32 and 16"),
        ((torch.zeros(1, 66, 32, dtype=torch.float16), kc, vc), {}, "at most 32 query heads"),
    ]
    for args, kw, msg in cases:
        assert msg in (gqa_tokens_on_m_supported(*args, **kw) or ""), msg
    with pytest.raises(ValueError, match="bf16/fp16 queries"):
        paged_gqa_tokens_on_m(q.float(), kc, vc, bt, rows, lens_t, 0.2)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import cp_modules.kernels.decode.gqa_tokens as m

fn = m._gqa_tokens_on_m_kernel
ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "SEQ_IDX": "*i32",
        "KV_LEN": "*i32", "OUT": "*fp32", "LSE": "*fp32", "qk_scale": "fp32"}
bn, warps, stages = m.TILE
for page, group in ((64, 4), (16, 7)):
    consts = dict(GROUP=group, NUM_KV_HEADS=8, PAGE=page, D=128, BLOCK_G=16, BLOCK_N=bn,
                  PARTIAL=True)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs if n[0] != "q"}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    print(page, "wgmma" in k.asm["ptx"], k.metadata.shared)
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    """The kernel compiled for sm_90a (a process without the interpreter) at Llama-3-8B's and
    Qwen2.5-7B's groups: warp-group MMAs, in half an SM's shared memory (triton 3.6, the
    H200's, also pipelines the copies: 3.7 does not here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln.split() for ln in done.stdout.strip().splitlines()]
    assert [ln[0] for ln in lines] == ["64", "16"], done.stdout
    for _, wgmma, shared in lines:
        assert wgmma == "True" and 2 * int(shared) <= 232448, done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 16])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (28, 4)])
def test_gpu_tokens_on_m_gqa_matches_reference(bs, splits, hq, hkv):
    """Llama-3-8B's and Qwen2.5-7B's heads (D = 128), bf16, on the H200."""
    lens = [1, 700, 2000, 64, 4097]
    q, kc, vc, bt, rows, lens_t = _inputs(bs, hq, hkv, 128, lens, torch.bfloat16, dev="cuda")
    out, lse = paged_gqa_tokens_on_m(q, kc, vc, bt, rows, lens_t, 128**-0.5, splits)
    torch.cuda.synchronize()
    _check(out, lse, q, kc, vc, bt, rows, lens_t, 128**-0.5)
