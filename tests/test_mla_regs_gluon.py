"""The register-operand Gluon MLA decode kernel on fp8 (e4m3) latent caches
(``kernels/decode/mla_regs_gluon.py``): refused inputs and a compile for sm_90a on the CPU;
against the fp32 reference, the op's routing and CUDA-graph replays on the GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from test_mla_tokens_gluon import (
    RK,
    ROOT,
    ROPE,
    _check,
    _gpu_ok,
    _inputs,
    check_edges_twice,
    check_falls_back,
    check_query_magnitudes,
    check_routed_and_replayed,
    check_unserved_refused,
)

import cp_modules.kernels.decode.mla_regs_gluon as rg
from cp_modules.kernels.decode.mla import paged_mla_attention_kernel
from cp_modules.kernels.decode.mla_regs_gluon import (
    choose_regs_splits,
    paged_mla_regs_gluon,
    regs_gluon_supported,
)


def test_unserved_inputs_are_refused_naming_why():
    check_unserved_refused(regs_gluon_supported, paged_mla_regs_gluon, rg.HAS_GLUON)


def test_the_op_never_routes_here_without_the_gpu(monkeypatch):
    """With the switch on, inputs this kernel cannot serve (here: no sm_90 GPU) go on to the
    other kernels, matching the reference."""
    monkeypatch.setattr(rg, "FP8_REGS_GLUON", True)
    check_falls_back()


def test_split_count_takes_the_cheaper_of_one_and_two_programs_an_sm():
    """On 132 SMs the model picks the split counts that measured fastest on an H100 at 16 heads:
    one program an SM where a program has few tiles (B=1 128k: 128, B=8 32k: 16), two where it
    has many (B=8 128k: 32, B=64 32k: 4); a forced count of programs an SM is honoured."""
    assert [choose_regs_splits(b, ctx, 132) for b, ctx in
            ((1, 131072), (8, 32768), (8, 131072), (64, 32768))] == [128, 16, 32, 4]  # fmt: skip
    assert choose_regs_splits(64, 32768, 132, per_sm=1) == 2
    assert choose_regs_splits(1, 131072, 132, per_sm=2) == 256
    assert choose_regs_splits(1, 0, 132) == 1 and choose_regs_splits(256, 4096, 132) == 1


_COMPILE = """
import json, sys
sys.path.insert(0, "tools")
from compile_mla_tokens_gluon import compile_regs_sm90
out = []
for page, partial, bh, stages in ((64, True, 16, 2), (16, False, 16, 3), (12, True, 16, 2)):
    k = compile_regs_sm90(page, partial, bh, stages)
    ptx = k.asm["ptx"]
    out.append([page, k.metadata.shared, ptx.count("wgmma.mma_async"),
                ptx.count("cvt.rn.f16x2.e4m3x2"), ptx.count("cp.async.cg.shared.global"),
                ptx.count("ld.shared.v4")])
traced = compile_regs_sm90(64, True, 16, 2, trace=True).asm["ptx"].count("%globaltimer")
stores = []
for vec in (False, True):
    for partial in (True, False):
        ptx = compile_regs_sm90(64, partial, 16, 2, vec_store=vec).asm["ptx"]
        stores.append([ptx.count("st.global.v4.b32"), ptx.count("st.global.b32"),
                       ptx.count("st.global.b16"), ptx.count("st.shared")])
loads = []
for q1 in (False, True):
    ptx = compile_regs_sm90(64, True, 16, 2, q_one_pass=q1).asm["ptx"]
    loads.append([ptx.count("ld.global.v4.b32"), ptx.count("ld.global.b32"),
                  ptx.count("ld.global.b16")])
spread = []
for splits in (0, 128, 16, 3):  # (0: the merge launch)
    k = compile_regs_sm90(64, True, 16, 2, spread_splits=splits)
    ptx = k.asm["ptx"]
    spread.append([splits, k.metadata.shared, ptx.count("gpu.release.add"),
                   ptx.count("gpu.acquire"), ptx.count("ld.global.cg.v4"),
                   ptx.count("wgmma.mma_async")])
print(json.dumps([out, traced, stores, loads, spread]))
"""


@pytest.mark.skipif(not rg.HAS_GLUON, reason="needs Triton's Gluon")
def test_kernel_compiles_for_sm90_without_a_gpu():
    """The kernel compiled for sm_90a (in a process without the interpreter) at block sizes
    64, 16 and 12, split and unsplit, 2 and 3 ring stages: within two programs an SM's shared
    memory at 2 stages; a tile's products all take A from registers (9 score pieces of 4
    k-steps and 4 value steps of 8 blocks); the operand bytes read back with 16-byte shared
    loads (18 for the scores, 16 for the values) and converted by the hardware's e4m3
    conversion (272 instructions of 4 bytes); the tile copied by 16-byte cp.async (16 latent
    + 2 rope a thread)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows, traced, stores, loads, spread = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r[0] for r in rows] == [64, 16, 12]
    assert traced == 5, traced  # the timeline's five stamps (a probe's build)
    for _page, _shared, wgmma, cvt, _cp_async, lds in rows:
        assert wgmma == 9 * 4 + 4 * 8, rows
        assert cvt == (576 + 512) * 64 // 128 // 2, rows  # the tile's bytes, 4 per instruction
        assert lds >= 18 + 16, rows  # (and the epilogue's layout conversions)
    # 18 a thread a tile: in the loop's refill and the prologue's STAGES - 1 tiles
    assert [r[4] for r in rows] == [18 * 2, 18 * 3, 18 * 2], rows
    assert rows[0][1] <= 232448 // 2 and rows[2][1] <= 232448 // 2, rows
    # The output's 512 x 16 values, 64 a thread (and 4 LSE stores): the block epilogue stores
    # them one by one after converting each block's layout (the fp32 partials' through shared
    # memory); the vector epilogue as 16-byte vectors from the accumulators' registers (16 of
    # fp32, 8 of bf16), with only the loop's own shared stores (the bf16 block epilogue's).
    (blk_p, blk_b, vec_p, vec_b) = stores
    assert blk_p[:3] == [0, 64 + 4, 0] and blk_b[:3] == [0, 4, 64], stores
    assert vec_p[:3] == [16, 4, 0] and vec_b[:3] == [8, 4, 0], stores
    assert vec_p[3] == vec_b[3] == blk_b[3] < blk_p[3], stores
    # The query's 16 x 576 values, 72 a thread (besides 7 scalar loads: the request's row,
    # length, scale and block-table entries): two passes of 4-byte pairs (68 loads: the
    # compiler merges a few), or with REGS_Q_ONE_PASS one pass of 16-byte vectors (8 of the
    # latent, 1 of the rope).
    two, one = loads
    assert two[0] == 0 and two[1] >= 2 * 32 + 7 and one == [9, 7, 0], loads
    # REGS_SPREAD_MERGE (mla_regs_spread): the same shared memory and products; a release
    # ticket and acquire reads of the counter (the compiler makes the waits' "add 0" a load)
    # appear only with it, and its partials are read from L2 in 16-byte vectors.
    base = spread[0]
    assert base[2:5] == [0, 0, 0], spread
    for _splits, shared, rel, acq, cg, wgmma in spread[1:]:
        assert shared == base[1] and wgmma == base[5], spread
        assert rel >= 1 and acq >= 1 and cg >= 1, spread


def test_spread_merge_blocks_cover_the_columns_once():
    # The spread merge's blocks: S_P2 x columns = 512 for 2 to 128 splits, 64 values a thread
    # in its [S_P2, 16 heads, columns] layout; blocks c = s (mod S) of 512 / columns cover
    # every column once over the S programs.
    from cp_modules.kernels.decode.mla_regs_spread import _merge_layout, spread_block_columns

    for splits in (2, 3, 4, 5, 16, 33, 64, 100, 128):
        s_p2, cb = spread_block_columns(splits)
        assert s_p2 >= splits and s_p2 * cb == 512 and s_p2 < 2 * splits
        lay = _merge_layout(s_p2, cb, 16)
        per_thread = s_p2 * 16 * cb // 128
        assert per_thread == 64
        warp = [a * b for a, b in zip(lay.size_per_thread, lay.threads_per_warp)]
        assert warp[2] <= cb and warp[1] <= 16 and 32 == math.prod(lay.threads_per_warp)
        blocks = sorted(c for s in range(splits) for c in range(s, 512 // cb, splits))
        assert blocks == list(range(512 // cb))
    for bad in (1, 129):
        with pytest.raises(ValueError, match="serves 2 to 128 splits"):
            spread_block_columns(bad)


@pytest.mark.skipif(not rg.HAS_GLUON, reason="needs Triton's Gluon")
@pytest.mark.parametrize("bh", [16, 32])
def test_one_pass_query_layout_and_column_permutation(bh):
    """``mla_regs_query``: ``_q_layout`` places every element of a [heads, 128] latent group
    once over the 128 threads, in runs of 8 consecutive columns (16-byte loads) with column
    bit 4 in the registers (so ``gl.split`` separates a group's two pieces without moving
    data); ``_q_group``'s reshape / permute / split and the rope's give each piece column the
    latent column of the scores' permutation (the kernel's docstring and ``_q_perm``)."""
    import itertools

    import numpy as np

    from cp_modules.kernels.decode.mla_regs_query import _q_layout

    lay = _q_layout(bh)
    bases = lay.reg_bases + lay.lane_bases + lay.warp_bases
    assert len(lay.lane_bases) == 5 and len(lay.warp_bases) == 2 and lay.shape == [bh, 128]
    seen = set()
    for bits in itertools.product((0, 1), repeat=len(bases)):
        r = c = 0
        for on, (br, bc) in zip(bits, bases):
            if on:
                r, c = r ^ br, c ^ bc
        seen.add((r, c))
    assert seen == {(r, c) for r in range(bh) for c in range(128)}
    assert lay.reg_bases[:3] == [[0, 1], [0, 2], [0, 4]] and [0, 16] in lay.reg_bases

    j = np.arange(64)
    s_, h_, q_, e_ = j // 16, (j // 8) % 2, (j // 2) % 4, j % 2
    # the group's natural columns [q, c', s, h, e] -> [s, h, q, e, c'], split on c'
    grp = np.arange(128).reshape(4, 2, 4, 2, 2).transpose(2, 3, 0, 4, 1).reshape(64, 2)
    for cp in (0, 1):
        assert (grp[:, cp] == 32 * q_ + 16 * cp + 4 * s_ + 2 * h_ + e_).all()
    rope = np.arange(64).reshape(4, 4, 2, 2).transpose(1, 2, 0, 3).reshape(64)
    assert (rope == 16 * q_ + 4 * s_ + 2 * h_ + e_).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("bs", [64, 16, 12])
@pytest.mark.parametrize("heads", [16, 8, 20, 32])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize(
    "stages,tile,vec,q1",
    [(2, 16, True, True), (3, 16, True, True), (2, 32, True, True), (2, 16, True, False),
     (2, 16, False, False)],
    ids=["s2", "s3", "s2-t32", "s2-q2", "s2-blocks-q2"],
)  # fmt: skip
def test_gpu_regs_gluon_matches_reference(monkeypatch, bs, heads, splits, stages, tile, vec, q1):
    """DeepSeek's latent at 8-32 heads (its 128 split by tensor parallelism), lengths at and
    around the tile edges and an empty row, NaN in every unwritten slot; 2 and 3 ring stages,
    16 or 32 heads a program; the vector-store epilogue and the one-pass query load (the
    defaults), the two-pass query load, and both before them (``s2-blocks-q2``); the same bits
    on a second launch."""
    monkeypatch.setattr(rg, "REGS_STAGES", stages)
    monkeypatch.setattr(rg, "REGS_HEAD_TILE", tile)
    monkeypatch.setattr(rg, "REGS_VECTOR_STORE", vec)
    monkeypatch.setattr(rg, "REGS_Q_ONE_PASS", q1)
    check_edges_twice(paged_mla_regs_gluon, bs, heads, splits)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("bs", [64, 16])
@pytest.mark.parametrize("heads", [16, 8, 20])
@pytest.mark.parametrize("splits", [2, 3, 5, 16])
def test_gpu_regs_gluon_spread_merge_matches_reference(monkeypatch, bs, heads, splits):
    """REGS_SPREAD_MERGE: the splits merged inside the kernel, spread over each row's programs
    (a cooperative launch; no merge launch): the edge lengths (empty splits and an empty row,
    NaN slots) against the reference, the same bits on a second launch (the counters reset
    themselves); one query over 128 splits (4-column blocks, half the splits empty)."""
    monkeypatch.setattr(rg, "REGS_SPREAD_MERGE", True)

    def no_merge_launch(*args, **kwargs):
        raise AssertionError("the spread merge launched the separate merge")

    # 8 queries x splits x head tiles programs: the spread merge where they fit one an SM
    if 8 * splits * -(-heads // 16) <= torch.cuda.get_device_properties(0).multi_processor_count:
        monkeypatch.setattr(rg, "merge_splits_triton", no_merge_launch)
    check_edges_twice(paged_mla_regs_gluon, bs, heads, splits)
    if splits == 16:
        q, cache, bt, rows, lens_t, sc = _inputs(bs, heads, [4097], dev="cuda", seed=5)
        for _ in range(2):
            out, lse = paged_mla_regs_gluon(q, cache, bt, rows, lens_t, 0.07, RK, 128,
                                            kv_scale=sc)  # fmt: skip
            _check(out, lse, q, cache, bt, rows, lens_t, sc, 0.07)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
def test_gpu_regs_gluon_spread_merge_replays_in_a_graph(monkeypatch):
    """The spread merge routed by the op and replayed from a CUDA graph with new lengths (the
    counters reset by each launch's last program)."""
    monkeypatch.setattr(rg, "FP8_REGS_GLUON", True)
    monkeypatch.setattr(rg, "REGS_SPREAD_MERGE", True)
    check_routed_and_replayed(paged_mla_regs_gluon)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("q1", [False, True], ids=["q2", "q1"])
def test_gpu_regs_gluon_fp16_and_query_rows_of_any_magnitude(monkeypatch, q1):
    """fp16 queries; each query row brought into fp16 by its own power of two: rows far outside
    fp16's range and an all-zero row give the reference's result (either query load)."""
    monkeypatch.setattr(rg, "REGS_Q_ONE_PASS", q1)
    check_query_magnitudes(paged_mla_regs_gluon)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs an sm_90 GPU")
def test_gpu_op_routes_here_with_the_switch_and_replays_in_a_graph(monkeypatch):
    """The switch routes fp8 caches with up to REGS_ROUTE_MAX_HEADS (16) heads here (the same
    bits as a direct call) and more heads to the warp-specialised kernel; a captured decode
    replays with new lengths (splits chosen from static shapes)."""
    monkeypatch.setattr(rg, "FP8_REGS_GLUON", True)
    q, cache, bt, rows, lens_t, sc = check_routed_and_replayed(paged_mla_regs_gluon)
    monkeypatch.setattr(rg, "paged_mla_regs_gluon", None)  # 20 heads: not routed here
    q20 = torch.randn(3, 20, RK + ROPE, device="cuda").bfloat16()
    out, lse = paged_mla_attention_kernel(q20, cache, bt, rows, lens_t, 0.07, RK, 2, kv_scale=sc)
    _check(out, lse, q20, cache, bt, rows, lens_t, sc, 0.07)
