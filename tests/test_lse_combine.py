"""LSE combine, packed layout and ag_rs correction: math, edge cases, ops, kernels vs reference."""

import math
import os

import pytest
import torch

from cp_modules.ops.correct_attn_out import correct_attn_out
from cp_modules.ops.lse_combine import (
    lse_combine,
    lse_combine_packed,
    pack_partials,
    packed_lse_offset,
    packed_row_width,
    unpack_partials,
)
from cp_modules.reference.lse_merge import (
    correct_attn_out_reference,
    lse_combine_reference,
    lse_weights_reference,
)
from cp_modules.testing.numerics import assert_close_to_reference

INF = float("inf")
NAN = float("nan")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HAS_TRITON_DEVICE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _partials(n, b, h, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, b, h, d, generator=g).to(device=device, dtype=dtype)
    lse = (3 * torch.randn(n, b, h, generator=g)).to(device)
    return out, lse


def _with_empty_shards(out, lse):
    """Mark shards empty in every way a kernel may report it; empty outputs are NaN."""
    out, lse = out.clone(), lse.clone()
    n = lse.shape[0]
    lse[0, 0, 0] = NAN
    lse[n - 1, 0, -1] = INF
    lse[:, -1, 0] = -INF  # a row whose shards are all empty
    if n > 1:
        lse[1, 0, 0] = -INF
        lse[:, -1, -1] = torch.tensor([NAN, INF, -INF] * n)[:n]  # all empty, mixed markers
    empty = torch.isnan(lse) | torch.isinf(lse)
    out[empty] = NAN
    return out, lse


# --- the combine's math (the public function; the reference on CPU) -------------------------


def test_single_partial_is_identity():
    out, lse = _partials(1, 5, 3, 8)
    res, res_lse = lse_combine(out, lse, return_lse=True)
    assert torch.equal(res, out[0])
    assert torch.equal(res_lse, lse[0])


def test_equal_lses_average():
    out, _ = _partials(4, 3, 2, 8)
    lse = torch.full((4, 3, 2), 1.5)
    res, res_lse = lse_combine(out, lse, return_lse=True)
    torch.testing.assert_close(res, out.mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(res_lse, torch.full((3, 2), 1.5 + math.log(4)), rtol=0, atol=1e-6)


def test_dominant_partial_wins_exactly():
    out, _ = _partials(3, 2, 2, 4)
    lse = torch.full((3, 2, 2), -200.0)
    lse[1] = 0.0  # exp(-200) underflows to 0 in fp32: the others weigh exactly nothing
    res, res_lse = lse_combine(out, lse, return_lse=True)
    assert torch.equal(res, out[1])
    assert torch.equal(res_lse, lse[1])


def test_hand_computed_example():
    # Weights 1/4 and 3/4: (1/4)[4, 8] + (3/4)[0, -4] = [1, -1]; lse = log(1 + 3) = log 4.
    out = torch.tensor([[[[4.0, 8.0]]], [[[0.0, -4.0]]]])
    lse = torch.tensor([[[0.0]], [[math.log(3.0)]]])
    res, res_lse = lse_combine(out, lse, return_lse=True)
    torch.testing.assert_close(res, torch.tensor([[[1.0, -1.0]]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(res_lse, torch.tensor([[math.log(4.0)]]), rtol=0, atol=1e-6)


def test_return_lse_is_logsumexp():
    out, lse = _partials(5, 4, 3, 2)
    res = lse_combine(out, lse)
    res2, res_lse = lse_combine(out, lse, return_lse=True)
    assert torch.equal(res, res2)
    torch.testing.assert_close(res_lse, torch.logsumexp(lse, 0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_sharded_attention_merges_to_dense(n):
    """Attention over disjoint key shards (some empty), merged, equals dense attention."""
    g = torch.Generator().manual_seed(n)
    b, h, s, d = 3, 2, 13, 8
    q, k, v = (
        torch.randn(x, generator=g, dtype=torch.float64)
        for x in ([b, h, d], [b, h, s, d], [b, h, s, d])
    )
    scores = torch.einsum("bhd,bhsd->bhs", q, k)
    owner = torch.randint(0, n, (s,), generator=g)
    owner[owner == n - 1] = 0  # the last shard holds no key at all
    outs, lses = [], []
    for r in range(n):
        sc = scores.masked_fill(owner != r, -INF)
        lse = torch.logsumexp(sc, -1)
        outs.append(torch.einsum("bhs,bhsd->bhd", torch.exp(sc - lse[..., None]), v))
        lses.append(lse)
    partial_out = torch.stack(outs).float()
    assert torch.isnan(partial_out[n - 1]).all()  # an empty shard's softmax is NaN
    res, res_lse = lse_combine(partial_out, torch.stack(lses).float(), return_lse=True)
    dense = torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(res, dense.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(res_lse, torch.logsumexp(scores, -1).float(), rtol=0, atol=1e-5)


def test_empty_markers_count_as_minus_inf():
    out, lse = _partials(4, 3, 2, 8)
    bad_out, bad_lse = _with_empty_shards(out, lse)
    res, res_lse = lse_combine(bad_out, bad_lse, return_lse=True)
    assert not torch.isnan(res).any() and not torch.isnan(res_lse).any()
    # Same as the combine where the empty shards say -inf and output 0.
    empty = torch.isnan(bad_lse) | torch.isinf(bad_lse)
    clean_lse = bad_lse.masked_fill(empty, -INF)
    clean_out = bad_out.masked_fill(empty[..., None], 0.0)
    want, want_lse = lse_combine(clean_out, clean_lse, return_lse=True)
    assert torch.equal(res, want) and torch.equal(res_lse, want_lse)
    # Rows whose shards are all empty: 0, not NaN, with LSE -inf.
    assert torch.equal(res[-1, 0], torch.zeros(8)) and res_lse[-1, 0] == -INF
    assert torch.equal(res[-1, -1], torch.zeros(8)) and res_lse[-1, -1] == -INF


def test_base2_matches_base_e():
    out, lse = _partials(3, 4, 2, 8)
    res_e, lse_e = lse_combine(out, lse, return_lse=True)
    res_2, lse_2 = lse_combine(out, lse / math.log(2.0), return_lse=True, base="2")
    torch.testing.assert_close(res_2, res_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse_2 * math.log(2.0), lse_e, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_dtypes_accumulate_in_fp32(dtype):
    out32, lse = _partials(4, 6, 3, 16)
    out = out32.to(dtype)
    res, res_lse = lse_combine(out, lse, return_lse=True)
    assert res.dtype == dtype and res_lse.dtype == torch.float32
    ref32, ref_lse = lse_combine_reference(out.float(), lse)
    w, _ = lse_weights_reference(lse)
    same_dtype = (out * w.to(dtype)[..., None]).sum(0)  # products rounded in the input dtype
    assert_close_to_reference(res, ref32, same_dtype if dtype != torch.float32 else None, atol=1e-6)
    torch.testing.assert_close(res_lse, ref_lse, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(partial_out=torch.zeros(2, 3, 4), partial_lse=torch.zeros(2, 3)),
            "partial_out must be \\[N, B, H, D\\]",
        ),
        (
            dict(partial_out=torch.zeros(2, 3, 4, 5), partial_lse=torch.zeros(2, 3, 5)),
            "partial_lse must have shape",
        ),
        (
            dict(
                partial_out=torch.zeros(2, 3, 4, 5),
                partial_lse=torch.zeros(2, 3, 4, dtype=torch.float16),
            ),
            "partial_lse must be torch.float32",
        ),
        (
            dict(
                partial_out=torch.zeros(2, 3, 4, 5, dtype=torch.int32),
                partial_lse=torch.zeros(2, 3, 4),
            ),
            "partial_out.dtype must be one of",
        ),
        (dict(partial_out=torch.zeros(0, 3, 4, 5), partial_lse=torch.zeros(0, 3, 4)), "N >= 1"),
        (
            dict(partial_out=torch.zeros(2, 3, 4, 5), partial_lse=torch.zeros(2, 3, 4), base="10"),
            "base must be one of",
        ),
    ],
    ids=["out-3d", "lse-shape", "lse-dtype", "out-dtype", "n0", "base"],
)
def test_combine_rejects_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lse_combine(**kwargs)


def test_empty_batch():
    res, res_lse = lse_combine(torch.zeros(3, 0, 4, 8), torch.zeros(3, 0, 4), return_lse=True)
    assert res.shape == (0, 4, 8) and res_lse.shape == (0, 4)


# --- packed layout ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "h, d, dtype, offset, width",
    [
        (16, 512, torch.bfloat16, 8192, 8224),  # the benchmark's N=8 row: no padding
        (1, 128, torch.bfloat16, 128, 136),  # 2 LSE elements, padded to 16 bytes
        (3, 5, torch.float16, 16, 24),  # odd H*D: 1-element gap keeps the LSEs 4-byte aligned
        (3, 5, torch.float32, 15, 20),
    ],
    ids=["H16-D512-bf16", "H1-D128-bf16", "H3-D5-fp16", "H3-D5-fp32"],
)
def test_packed_row_layout(h, d, dtype, offset, width):
    assert packed_lse_offset(h, d, dtype) == offset
    assert packed_row_width(h, d, dtype) == width
    assert width * dtype.itemsize % 16 == 0


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("h, d", [(3, 5), (4, 8)], ids=["H3-D5", "H4-D8"])
def test_pack_unpack_roundtrip_is_exact(dtype, h, d):
    out, lse = _with_empty_shards(*_partials(3, 2, h, d, dtype))
    packed = pack_partials(out, lse)
    assert packed.shape == (3, 2, packed_row_width(h, d, dtype)) and packed.dtype == dtype
    got_out, got_lse = unpack_partials(packed, h, d)
    assert torch.equal(got_out.nan_to_num(), out.nan_to_num())
    assert torch.equal(got_lse.nan_to_num(), lse.nan_to_num())
    res, res_lse = lse_combine_packed(packed, h, d, return_lse=True)
    want, want_lse = lse_combine(out, lse, return_lse=True)
    assert torch.equal(res, want) and torch.equal(res_lse, want_lse)


def test_pack_accepts_expanded_views():
    out, lse = _partials(2, 3, 4, 8, torch.bfloat16)
    packed = pack_partials(
        out.unsqueeze(0).expand(2, *out.shape), lse.unsqueeze(0).expand(2, *lse.shape)
    )
    assert torch.equal(packed[0], packed[1]) and torch.equal(packed[0], pack_partials(out, lse))


def test_combine_packed_rejects_wrong_width():
    with pytest.raises(ValueError, match="packed rows must have W = packed_row_width"):
        lse_combine_packed(torch.zeros(2, 3, 48, dtype=torch.bfloat16), 4, 8)


# --- ag_rs correction ------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [1, 2, 4])
def test_corrections_sum_to_the_combine(num_blocks):
    out, lse = _with_empty_shards(*_partials(4, 3, 4, 8))
    want, want_lse = lse_combine(out, lse, return_lse=True)
    total = torch.zeros(num_blocks, 3, 4 // num_blocks, 8)
    for r in range(4):
        corr, corr_lse = correct_attn_out(out[r], lse, r, num_blocks=num_blocks, return_lse=True)
        assert corr.shape == (num_blocks, 3, 4 // num_blocks, 8)
        assert torch.equal(corr_lse, want_lse)
        total += corr
    # Block k holds heads [k*H/K, (k+1)*H/K).
    merged = total.transpose(0, 1).reshape(3, 4, 8)
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-6)
    assert not torch.isnan(merged).any()


def test_correction_rejects_bad_inputs():
    out, lse = _partials(2, 3, 4, 8)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\)"):
        correct_attn_out(out[0], lse, 2)
    with pytest.raises(ValueError, match="num_blocks must be >= 1 and divide H=4"):
        correct_attn_out(out[0], lse, 0, num_blocks=3)
    with pytest.raises(ValueError, match="all_lse must be \\[N, B, H\\]"):
        correct_attn_out(out[0], lse[:, :2], 0)


# --- custom ops: opcheck and fullgraph compile -----------------------------------------------


def _opcheck_samples():
    out, lse = _with_empty_shards(*_partials(3, 4, 2, 8))
    strided = torch.randn(3, 4, 2, 16)[..., ::2]
    bf_out, bf_lse = _partials(2, 3, 4, 8, torch.bfloat16)
    return [
        ("lse_combine", (out, lse, False)),
        ("lse_combine", (strided, lse, True)),
        ("lse_combine", (bf_out, bf_lse, False)),
        ("lse_combine_packed", (pack_partials(bf_out, bf_lse), 4, 8, False)),
        ("lse_combine_packed", (pack_partials(out, lse), 2, 8, True)),
        ("correct_attn_out", (out[1], lse, 1, 2, False)),
        ("correct_attn_out", (bf_out[0], bf_lse, 0, 1, True)),
    ]


@pytest.mark.parametrize(
    "case",
    range(len(_opcheck_samples())),
    ids=[f"{n}-{i}" for i, (n, _) in enumerate(_opcheck_samples())],
)
def test_opcheck(case):
    name, args = _opcheck_samples()[case]
    torch.library.opcheck(getattr(torch.ops.cp, name).default, args)


def test_public_functions_compile_fullgraph():
    out, lse = _with_empty_shards(*_partials(3, 4, 2, 8))
    packed = pack_partials(out, lse)

    def step(out, lse, packed):
        a = lse_combine(out, lse, return_lse=True, base="2")
        b = lse_combine_packed(packed, 2, 8, return_lse=True)
        c = correct_attn_out(out[2], lse, 2, num_blocks=2, return_lse=True)
        return a, b, c

    got = torch.compile(step, fullgraph=True)(out, lse, packed)
    want = step(out, lse, packed)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(g, w)


# --- Triton kernels vs the reference (interpreter on CPU, tiny grids) ------------------------

kernel_test = pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="needs CUDA or TRITON_INTERPRET=1")


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "n, b, h, d, block_rows, block_d, base2",
    [
        (1, 3, 2, 16, 2, 16, False),
        (3, 4, 2, 24, 4, 16, False),  # D split in two tiles, the second masked
        (8, 2, 3, 16, 4, 16, True),  # rows not a multiple of BLOCK_R
        (4, 3, 2, 40, None, None, False),  # default launch config, D not a power of two
        (2, 3, 3, 128, None, None, False),  # the measured tile at D = 128 (16-bit partials)
        (3, 1, 3, 512, None, None, True),  # D = 512: one row, two 256-column programs a row
    ],
    ids=[
        "N1-B3-H2-D16",
        "N3-B4-H2-D24",
        "N8-B2-H3-D16-base2",
        "N4-B3-H2-D40-default",
        "N2-B3-H3-D128-default",
        "N3-B1-H3-D512-default-base2",
    ],  # fmt: skip
)
def test_combine_kernel_matches_reference(dtype, n, b, h, d, block_rows, block_d, base2):
    from cp_modules.kernels.merge import lse_combine_triton

    out, lse = _with_empty_shards(*_partials(n, b, h, d, dtype, KERNEL_DEVICE, seed=n))
    got, got_lse = lse_combine_triton(out, lse, base2=base2, block_rows=block_rows, block_d=block_d)
    ref32, ref_lse = lse_combine_reference(out.float(), lse, base2=base2)
    w, _ = lse_weights_reference(lse, base2=base2)
    same = torch.where(w[..., None] > 0, out * w.to(dtype)[..., None], 0).sum(0)
    assert_close_to_reference(got, ref32, same if dtype != torch.float32 else None, atol=1e-6)
    torch.testing.assert_close(got_lse, ref_lse, rtol=0, atol=1e-6)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_combine_kernel_reads_packed_views(dtype):
    from cp_modules.kernels.merge import lse_combine_triton

    out, lse = _with_empty_shards(*_partials(4, 3, 3, 8, dtype, KERNEL_DEVICE))
    packed = pack_partials(out, lse)
    v_out, v_lse = unpack_partials(packed, 3, 8)
    assert v_out.data_ptr() == packed.data_ptr()  # read in place, no unpacking copy
    got, got_lse = lse_combine_triton(v_out, v_lse, block_rows=4)
    want, want_lse = lse_combine_triton(out.contiguous(), lse.contiguous(), block_rows=4)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_blocks, base2", [(1, False), (2, True)], ids=["K1", "K2-base2"])
def test_correction_kernel_matches_reference(dtype, num_blocks, base2):
    from cp_modules.kernels.merge import correct_attn_out_triton

    out, lse = _with_empty_shards(*_partials(3, 4, 2, 24, dtype, KERNEL_DEVICE))
    for rank in range(3):
        got, got_lse = correct_attn_out_triton(
            out[rank], lse, rank, num_blocks=num_blocks, base2=base2, block_rows=4, block_d=16
        )
        ref, ref_lse = correct_attn_out_reference(
            out[rank].float(), lse, rank, num_blocks=num_blocks, base2=base2
        )
        w, _ = lse_weights_reference(lse, base2=base2)
        same = torch.where(w[rank][..., None] > 0, out[rank] * w[rank].to(dtype)[..., None], 0)
        same = same.view(4, num_blocks, -1, 24).transpose(0, 1)
        assert_close_to_reference(got, ref, same if dtype != torch.float32 else None, atol=1e-6)
        torch.testing.assert_close(got_lse, ref_lse, rtol=0, atol=1e-6)


# --- GPU: the kernels behind the ops, dtype matrix, CUDA graphs ------------------------------


def _gpu_same_dtype_combine(out, lse):
    w, _ = lse_weights_reference(lse)
    return torch.where(w[..., None] > 0, out * w.to(out.dtype)[..., None], 0).sum(0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "n, b, h, d",
    [(2, 1, 1, 128), (4, 7, 16, 128), (8, 512, 16, 512), (8, 33, 16, 576), (3, 100, 5, 96)],
    ids=[
        "N2-B1-H1-D128",
        "N4-B7-H16-D128",
        "N8-B512-H16-D512",
        "N8-B33-H16-D576",
        "N3-B100-H5-D96",
    ],
)
def test_gpu_ops_match_reference(dtype, n, b, h, d):
    out, lse = _with_empty_shards(*_partials(n, b, h, d, dtype, "cuda"))
    ref32, ref_lse = lse_combine_reference(out.float(), lse)
    got, got_lse = lse_combine(out, lse, return_lse=True)
    if dtype == torch.float32:
        # fp32 inputs: against an fp64 reference with PyTorch's default fp32 tolerances (the
        # kernel's exp2 and fma order differ from ATen's on the GPU by a few ulps).
        ref64, _ = lse_combine_reference(out.double(), lse.double())
        torch.testing.assert_close(got.double(), ref64, rtol=1.3e-6, atol=1e-5)
    else:
        assert_close_to_reference(got, ref32, _gpu_same_dtype_combine(out, lse), atol=1e-6)
    torch.testing.assert_close(got_lse, ref_lse, rtol=0, atol=1e-5)
    got_p, got_p_lse = lse_combine_packed(pack_partials(out, lse), h, d, return_lse=True)
    assert torch.equal(got_p, got) and torch.equal(got_p_lse, got_lse)
    for r in range(n):
        corr, corr_lse = correct_attn_out(out[r], lse, r, return_lse=True)
        ref_corr, _ = correct_attn_out_reference(out[r].float(), lse, r)
        same_corr = ref_corr.to(dtype) if dtype != torch.float32 else None
        assert_close_to_reference(corr, ref_corr, same_corr, atol=1e-6)
        torch.testing.assert_close(corr_lse, ref_lse, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_combine_replays_in_cuda_graph():
    out, lse = _with_empty_shards(*_partials(8, 64, 16, 512, torch.bfloat16, "cuda"))
    packed = pack_partials(out, lse)
    want = lse_combine(out, lse)
    want_p = lse_combine_packed(packed, 16, 512)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = lse_combine(out, lse)
        got_p = lse_combine_packed(packed, 16, 512)
    # New inputs in the same buffers: doubling is exact, so the replay must give 2x exactly.
    out.mul_(2)
    packed.copy_(pack_partials(out, lse))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(want_p, want)
    assert torch.equal(got, 2 * want) and torch.equal(got_p, got)


@pytest.mark.gpu
def test_gpu_public_functions_compile_fullgraph():
    out, lse = _with_empty_shards(*_partials(4, 16, 8, 128, torch.bfloat16, "cuda"))
    packed = pack_partials(out, lse)

    def step(out, lse, packed):
        return (
            lse_combine(out, lse, return_lse=True),
            lse_combine_packed(packed, 8, 128, return_lse=True),
            correct_attn_out(out[1], lse, 1, num_blocks=4, return_lse=True),
        )

    got = torch.compile(step, fullgraph=True)(out, lse, packed)
    want = step(out, lse, packed)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(g, w)


@kernel_test
@pytest.mark.parametrize(
    "t, h, s, d, config",
    [
        (2, 3, 5, 24, None),  # default launch: several rows per program, S and D not powers of 2
        (3, 2, 8, 16, (4, 16, 2, 4)),  # rows not a multiple of BLOCK_R, two split chunks
        (1, 2, 33, 40, (1, 16, 8, 4)),  # a long split list over column blocks, the last masked
        (2, 2, 1, 8, None),  # one split
    ],
    ids=["T2-H3-S5-D24-default", "T3-H2-S8-R4", "T1-H2-S33-D40-R1", "S1"],
)
def test_split_merge_kernel_matches_reference(t, h, s, d, config):
    from cp_modules.kernels.merge import merge_splits_triton
    from cp_modules.reference.lse_merge import merge_partials_reference

    g = torch.Generator().manual_seed(s)
    o_buf = torch.randn(t, h, s, d, generator=g).to(KERNEL_DEVICE)
    l_buf = (3 * torch.randn(t, h, s, generator=g)).to(KERNEL_DEVICE)
    # Empty splits (no keys in their range): base-2 LSE -inf, partial 0; one row all empty.
    l_buf[0, 0, s // 2] = -INF
    o_buf[0, 0, s // 2] = 0
    l_buf[-1, -1] = -INF
    o_buf[-1, -1] = 0
    out = torch.full((t, h, d), NAN, device=KERNEL_DEVICE)
    lse = torch.full((t, h), NAN, device=KERNEL_DEVICE)
    merge_splits_triton(o_buf, l_buf, out, lse, config)
    ref, ref_lse = merge_partials_reference(
        [o_buf[:, :, i] for i in range(s)], [l_buf[:, :, i] * math.log(2) for i in range(s)],
        torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[-1, -1], torch.zeros(d, device=KERNEL_DEVICE))
    assert lse[-1, -1].item() == -INF


def test_split_merge_launch_config_reads_about_16_kb_per_program():
    from cp_modules.kernels.merge import merge_splits_launch_config

    for splits, dv in [(2, 512), (8, 512), (64, 512), (33, 128), (2, 128), (256, 512)]:
        rows, cols, chunk, _ = merge_splits_launch_config(splits, dv)
        per_program = rows * splits * cols * 4
        assert cols <= 64 and chunk >= 1 and rows * chunk * cols <= 4096
        # Below 8 KB only where one row's split list already spans a program.
        assert per_program >= 8192 or rows == 16, (splits, dv, rows, cols)
        assert rows == 1 or per_program <= 16384
