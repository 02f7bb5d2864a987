"""The Gluon MLA decode kernel on an fp8 (e4m3) latent cache (``mla_gluon_fp8``).

CPU: which kernel ``cp::paged_mla_attention`` runs for an fp8 cache with the switch
``mla_gluon_config.MLA_FP8_GLUON`` off and on (the kernels replaced by recorders), and what the
fp8 path refuses. GPU (sm_90): the kernel against the fp32 reference on the ragged DCP shard of
``test_paged_decode`` (lengths ending mid-tile, empty ranges, NaN in every unwritten slot), 128
and 64 heads, block sizes 16 and 64, one split and several, query rows of very different
magnitudes, the op with the switch on (16 heads stay on Triton), and a CUDA-graph replay: the
2x rule (error against the fp32 reference at most twice the same-dtype reference's).
"""

from __future__ import annotations

import pytest
import torch
from test_paged_decode import _gluon_mla_shard_args, check_against_reference

from cp_modules.cache.kv_dtype import FP8_DTYPE, quantize_fp8
from cp_modules.kernels.decode import mla_gluon_config as cfg
from cp_modules.ops import paged_decode as ops
from cp_modules.reference.paged_decode import paged_mla_attention_ref

# ---------------------------------------------------------------------------------------------
# CPU: the dispatch.


class _Recorder:
    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, q, cache, *args, **kw):
        self.calls.append((q.shape[1], kw))
        t, h, _ = q.shape
        return q.new_zeros(t, h, 512), q.new_zeros(t, h, dtype=torch.float32)


def _mla_args(heads, dtype=torch.bfloat16):
    q = torch.randn(2, heads, 576).to(dtype)
    cache = torch.zeros(4, 16, 576, dtype=FP8_DTYPE)
    bt = torch.arange(4, dtype=torch.int32).view(2, 2)
    rows = torch.arange(2, dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    return q, cache, bt, rows, lens, 0.07, 512


@pytest.fixture
def kernels(monkeypatch):
    """The two CUDA kernels replaced by recorders, and the Gluon kernel's device check passed
    (its shape, dtype and schedule checks still run)."""
    gluon, triton = _Recorder("gluon"), _Recorder("triton")
    monkeypatch.setattr(ops, "paged_mla_attention_gluon", gluon)
    monkeypatch.setattr(ops, "paged_mla_attention_kernel", triton)
    monkeypatch.setattr(cfg, "_device_why", lambda q: None)
    return gluon, triton


def test_fp8_cache_runs_triton_while_the_switch_is_off(kernels, monkeypatch):
    gluon, triton = kernels
    monkeypatch.setattr(cfg, "MLA_FP8_GLUON", False)
    scale = torch.tensor([0.5])
    ops._paged_mla_attention_cuda(*_mla_args(128), kv_scale=scale)
    assert not gluon.calls and len(triton.calls) == 1
    assert triton.calls[0][1]["kv_scale"] is scale
    with pytest.raises(ValueError, match="takes bf16/fp16 caches, not fp8"):
        ops._paged_mla_attention_cuda(*_mla_args(128), impl="gluon", kv_scale=scale)


def test_fp8_cache_runs_gluon_with_the_switch_where_it_serves(kernels, monkeypatch):
    gluon, triton = kernels
    monkeypatch.setattr(cfg, "MLA_FP8_GLUON", True)
    scale = torch.tensor([0.5])
    for heads in (128, 64):
        ops._paged_mla_attention_cuda(*_mla_args(heads), kv_scale=scale)
    ops._paged_mla_attention_cuda(*_mla_args(128), impl="gluon")
    assert [c[0] for c in gluon.calls] == [128, 64, 128] and not triton.calls
    assert gluon.calls[0][1]["kv_scale"] is scale and gluon.calls[2][1]["kv_scale"] is None
    # 16 heads (not a 64-head tile), an fp32 query, a scale per head: Triton, or refused
    # by name when the Gluon kernel is asked for.
    ops._paged_mla_attention_cuda(*_mla_args(16), kv_scale=scale)
    ops._paged_mla_attention_cuda(*_mla_args(128, torch.float32), kv_scale=scale)
    ops._paged_mla_attention_cuda(*_mla_args(128), kv_scale=torch.tensor([0.5, 0.5]))
    assert [c[0] for c in triton.calls] == [16, 128, 128] and len(gluon.calls) == 3
    with pytest.raises(ValueError, match="heads a multiple of 64"):
        ops._paged_mla_attention_cuda(*_mla_args(16), impl="gluon", kv_scale=scale)
    with pytest.raises(ValueError, match="one fp32 latent scale"):
        ops._paged_mla_attention_cuda(*_mla_args(128), impl="gluon",
                                      kv_scale=torch.tensor([0.5, 0.5]))  # fmt: skip
    # impl="triton" is Triton whatever the switch.
    ops._paged_mla_attention_cuda(*_mla_args(128), impl="triton", kv_scale=scale)
    assert len(triton.calls) == 4


def test_fp8_path_serves_only_the_schedules_it_is_built_for(monkeypatch):
    monkeypatch.setattr(cfg, "_device_why", lambda q: None)
    q, cache = _mla_args(128)[:2]
    assert cfg.gluon_mla_fp8_supported(q, cache, 512) is None
    assert cfg.gluon_mla_fp8_supported(q, cache, 512, 0.5) is None
    assert "e4m3 cache" in cfg.gluon_mla_fp8_supported(q, cache.bfloat16(), 512)
    for name, variant in cfg.GLUON_MLA_VARIANTS.items():
        why = cfg.gluon_mla_fp8_supported(q, cache, 512, None, variant)
        built = (variant.issue == "loader" and variant.early_release
                 and variant.producer_zeroing and not variant.scale_p
                 and not variant.fused_merge and not variant.spread_merge)  # fmt: skip
        assert (why is None) == built, name
    # Both block sizes' defaults have the fp8 path.
    for bs in (16, 64):
        assert (
            cfg.gluon_mla_fp8_supported(q, cache, 512, None, cfg.default_gluon_mla_config(bs))
            is None
        )
    # A bf16 query on an fp16 cache (or any other mix) is refused by the 16-bit path.
    assert "q's dtype" in cfg.gluon_mla_supported(q, cache.half(), 512)


def test_the_switch_is_on_by_default_with_the_4_warp_conversion():
    assert cfg.MLA_FP8_GLUON is True
    assert (cfg.FP8_CONVERT_WARPS, cfg.FP8_CONVERT_REGS) == (4, 32)


# ---------------------------------------------------------------------------------------------
# GPU (sm_90): the kernel against the reference.


def _require_gluon():
    from cp_modules.kernels.decode.mla_gluon import HAS_GLUON

    if not HAS_GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernel needs Triton's Gluon and an sm_90 GPU")


def _fp8_args(bs, interleave, heads, seed, scale=0.5, rows_spread=False):
    """The ragged shard's MLA arguments with the cache quantized to e4m3 by ``scale`` (NaN in
    unwritten slots stays NaN); ``rows_spread``: query rows scaled by 2**-20 .. 2**16 (some
    beyond fp16's range, some under its normal range)."""
    q, cache, *rest = _gluon_mla_shard_args(bs, interleave, heads, seed)
    ks = torch.tensor([scale], dtype=torch.float32, device="cuda")
    c8 = quantize_fp8(cache, ks)
    if rows_spread:
        exps = torch.arange(heads, device="cuda") % 37 - 20
        q = (q.float() * torch.exp2(exps.float())[None, :, None]).to(q.dtype)
    return (q, c8, *rest), ks


def _check_fp8(out, lse, args, ks, name):
    ref = paged_mla_attention_ref(*args, kv_scale=ks)
    same = paged_mla_attention_ref(*args, kv_scale=ks, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=name)


# The conversion partitions offered (mla_gluon_config.FP8_CONVERT_WARPS / _REGS): 2 warps
# beside the producer warp at 24 registers, 4 warps of their own at 32.
_CONVERSIONS = [(2, 24), (4, 32)]


@pytest.fixture(params=_CONVERSIONS, ids=[f"C{w}w{r}r" for w, r in _CONVERSIONS])
def conversion(request, monkeypatch):
    warps, regs = request.param
    monkeypatch.setattr(cfg, "FP8_CONVERT_WARPS", warps)
    monkeypatch.setattr(cfg, "FP8_CONVERT_REGS", regs)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("heads", [64, 128], ids=["H64", "H128"])
@pytest.mark.parametrize("splits", [None, 1, 7, 130], ids=["Sauto", "S1", "S7", "S130"])
@pytest.mark.parametrize("interleave", [1, 16], ids=["I1", "I16"])
def test_gpu_gluon_mla_fp8_matches_reference(bs, heads, splits, interleave, conversion):
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import paged_mla_attention_gluon

    args, ks = _fp8_args(bs, interleave, heads, seed=2)
    out, lse = paged_mla_attention_gluon(*args, splits, kv_scale=ks)
    _check_fp8(out, lse, args, ks, f"gluon-mla-fp8-{heads}-bs{bs}")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv_scale", ["tensor", "float", "none"])
def test_gpu_gluon_mla_fp8_rows_of_any_magnitude_and_scales(bs, dtype, kv_scale, conversion):
    # Each query row brought into fp16 by its own power of two: rows from 2**-20 to 2**16
    # of a unit normal (bf16 beyond fp16's range too); the scale as a tensor, a float or None.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import paged_mla_attention_gluon

    args, ks = _fp8_args(bs, 16, 128, seed=3, scale=1.0 if kv_scale == "none" else 0.25,
                         rows_spread=dtype == torch.bfloat16)  # fmt: skip
    args = (args[0].to(dtype), *args[1:])
    given = {"tensor": ks, "float": 0.25, "none": None}[kv_scale]
    out, lse = paged_mla_attention_gluon(*args, None, kv_scale=given)
    _check_fp8(out, lse, args, ks, f"gluon-mla-fp8-rows-{kv_scale}")


@pytest.mark.gpu
def test_gpu_op_with_the_switch_runs_gluon_for_128_heads_and_triton_for_16(monkeypatch):
    _require_gluon()
    from cp_modules.kernels.decode import mla_gluon

    calls = []
    real = mla_gluon.paged_mla_attention_gluon
    monkeypatch.setattr(ops, "paged_mla_attention_gluon",
                        lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))  # fmt: skip
    monkeypatch.setattr(cfg, "MLA_FP8_GLUON", True)
    for heads in (128, 16):
        args, ks = _fp8_args(64, 16, heads, seed=6)
        out, lse = ops.paged_mla_attention(*args[:5], scale=args[5], kv_lora_rank=512,
                                           kv_scale=ks)  # fmt: skip
        _check_fp8(out, lse, args, ks, f"op-fp8-{heads}")
    assert calls == [128]


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("splits", [1, 7], ids=["S1", "S7"])
def test_gpu_gluon_mla_fp8_cuda_graph_replay(bs, splits, conversion):
    # Captured once, replayed with new queries, lengths and scale: the eager results.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import paged_mla_attention_gluon

    args, ks = _fp8_args(bs, 16, 128, seed=7)
    q, c8, bt, rows, kv_len, scale, rk = args
    q_buf, len_buf, ks_buf = q.clone(), kv_len.clone(), ks.clone()

    def step():
        return paged_mla_attention_gluon(q_buf, c8, bt, rows, len_buf, scale, rk, splits,
                                         kv_scale=ks_buf)  # fmt: skip

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    gen = torch.Generator(device="cuda").manual_seed(8)
    for _ in range(2):
        q_buf.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))
        len_buf.copy_(torch.clamp(kv_len - torch.randint(0, 70, kv_len.shape, device="cuda",
                                                        generator=gen), min=0))  # fmt: skip
        ks_buf.mul_(1.5)
        graph.replay()
        want = paged_mla_attention_gluon(q_buf, c8, bt, rows, len_buf, scale, rk, splits,
                                         kv_scale=ks_buf)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        _check_fp8(out, lse, (q_buf, c8, bt, rows, len_buf, scale, rk), ks_buf, "graph")
