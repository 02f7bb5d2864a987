"""CUDA launchers of PCP head/tail prefill attention: causal square + rectangle + LSE merge.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens, C =
cached-prefix tokens, L / M = queries / keys of one block, Hq / Hkv = query / KV heads,
Dqk / Dv = head dims, S = segments (``cp_modules.partition.plan.SEGMENT_FIELDS``).

A segment's bottom-right causal attention over ``k_len`` keys is split into blocks that every
fused attention kernel serves at full speed:

* the causal *square*: the segment's ``q_len`` queries against its last ``q_len`` keys;
* the *rectangle*: the same queries against the ``k_len - q_len`` keys before them, no mask;
* the *prefix*: the same queries against the request's cached prefix, no mask;

merged exactly by their LSEs in one Triton pass that writes the segment's rows of the result
(in place over the squares' output when that holds every row in order: one request, no
padding; otherwise a fresh result whose padding rows alone are initialised).
On the H200 this beats bottom-right-causal kernels by ~1.7x (see the PCP table of the
toolchain notes). Each block runs on the fastest kernel PyTorch
ships for its shape (cuDNN, else FlashAttention-2, else the fp32 reference for shapes and
dtypes neither serves). A rank's head and tail squares of equal size run as one batched call
(a strided view, no copy): small causal squares are the least efficient blocks. The backward
runs the same blocks with the *merged* output and LSE, so each block's probabilities are its
share of the full softmax and the block gradients sum to the gradient of the whole attention;
each gradient row is then written once (:func:`sum_pieces_into`). Lengths come from the host
copy of the plan's segments: nothing here reads device memory on the host.

Measured on an H200 (bf16, 32 heads): cuDNN's non-causal backward runs at ~300 TFLOP/s for
Dqk 192 / Dv 128 (MLA prefill) against ~470 for a large causal call and ~550 at D = 128.
Rectangles of at least :data:`CAUSAL_PAIRS_MIN_ROWS` MLA queries therefore run their backward
as causal pairs (:func:`rectangle_backward_causal_pairs`), summed with row-reversed reads
(:func:`sum_rows_triton`); smaller ones stay non-causal. For a 32k sequence MLA's PCP
backward here is 1.23 / 1.48 / 1.59x dense/P at P = 2 / 4 / 8 (MLA's training path runs the
key-major backward of :mod:`cp_modules.kernels.pcp_key_major` instead, 1.08-1.21x), MHA's
and GQA's 1.04-1.11x (the most at P = 8, where cuDNN's own block kernels take less than
dense/P and the gradient sums and copies, its per-call dO.O and dQ conversion and the zero
rows add ~8 %).
Merging the head's and tail's rectangles into one call, folding a square into a tall causal
call, overlapping the squares on a second stream (or running them at the highest stream
priority beside the sums), padding MLA's values to 192, one FlexAttention call per rank, cuDNN
frontend calls with band / bottom-right masks writing into the gradient buffers and one Triton
launch assembling every gradient row were measured and are not faster
(benchmarks/2026-11-30-pcp-block-variants.md).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from cp_modules.kernels.pcp_varlen import (
    pcp_prefill_attention_varlen,
    pcp_prefill_attention_varlen_backward,
)
from cp_modules.reference.pcp_attention import (
    attention_with_lse,
    attention_with_lse_backward,
    lse_dtype,
    merge_partials_reference,
)

__all__ = [
    "BLOCK_BACKENDS",
    "CAUSAL_PAIRS_MIN_ROWS",
    "attention_block_backward",
    "attention_block_forward",
    "merge_partials_into",
    "merge_partials_triton",
    "pcp_prefill_attention_backward_cuda",
    "pcp_prefill_attention_cuda",
    "rectangle_backward_causal_pairs",
    "select_block_backend",
    "sum_pieces_into",
    "sum_rows_triton",
]

BLOCK_BACKENDS = ("cudnn", "flash", "reference")


def _cudnn_takes_gqa() -> bool:
    # PyTorch's private cuDNN attention entry takes fewer KV heads than query heads, forward
    # and backward (dk/dv come back per KV head), in 2.11 (checked on an H200 against the fp32
    # reference and FlashAttention-2: test_gpu_block_backends_forward_and_backward). Older
    # releases are not assumed to.
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 11)


CUDNN_GQA = _cudnn_takes_gqa()

BlockForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BlockBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def select_block_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """Fastest of :data:`BLOCK_BACKENDS` that serves this block ([L, H, D] or [B, L, H, D])."""
    if q.device.type != "cuda":
        return "reference"
    # PyTorch's checks depend on the shapes, strides, dtypes, device and its backend switches
    # alone; a step asks for the same few block shapes over and over (~25 us a check).
    flags = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    key = (q.device, q.dtype, k.dtype, v.dtype, causal, flags) + tuple(
        (x.shape, x.stride()) for x in (q, k, v)
    )
    backend = _BACKEND_CHOICES.get(key)
    if backend is None:
        if len(_BACKEND_CHOICES) >= 4096:
            _BACKEND_CHOICES.clear()
        backend = _BACKEND_CHOICES[key] = _select_block_backend(q, k, v, causal)
    return backend


_BACKEND_CHOICES: dict[tuple, str] = {}


def _select_block_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    qt, kt, vt = (_bhld(x) for x in (q, k, v))
    gqa = q.shape[-2] != k.shape[-2]
    params = torch.backends.cuda.SDPAParams(qt, kt, vt, None, 0.0, causal, gqa)
    # cuDNN is the fastest on Hopper for these shapes (2x FlashAttention-2 at D=128); where
    # PyTorch's private cuDNN entry does not take grouped KV heads (CUDNN_GQA False),
    # FlashAttention-2 reads them natively but needs Dqk == Dv.
    if (CUDNN_GQA or not gqa) and torch.backends.cuda.can_use_cudnn_attention(params, False):
        return "cudnn"
    if q.shape[-1] == v.shape[-1] and torch.backends.cuda.can_use_flash_attention(params, False):
        return "flash"
    return "reference"


# A batch runs as one varlen call (:mod:`cp_modules.kernels.pcp_varlen`) when its segments are
# small: when their forward attention FLOPs (2 per multiply-add, mean over the non-empty
# segments) are below these. The block path pays host time per segment (several launches and
# sums each) and wins on long segments, where cuDNN's kernels are faster than FlashAttention-2's
# (about 2x for MLA's head dim 192, whose values are zero-padded to it: "_padded"). Measured on
# an H200 (bf16; benchmarks/results/pcp-varlen-2026-11-30.json, attention alone at P = 2 and 8,
# 32 heads; modules-many-2026-11-30.json, whole layers at P = 1):
# - GQA forward: varlen 2-2.5x faster at 3.4e10 a segment, blocks faster from 1.4e11; in the
#   Llama-3-8B layer (P = 1) varlen was faster to 1.7e10 (about even there), blocks at 6.9e10.
# - GQA backward: blocks faster from 3.4e10 (by 10-40 %), varlen 2.7x faster at 1.9e10.
# - MLA forward: varlen 2.4x faster at 1.1e10 a segment alone; in the DeepSeek-V3 layer with 32
#   heads (a tp = 4 rank) varlen was 14 % faster at 5.4e9 and blocks 17 % faster at 2.2e10; with
#   all 128 heads on one rank blocks were 8 % faster already at 5.4e9 (the layer's projections
#   hide more of the block path's host time).
# - MLA backward: blocks 1.5x faster at 1.1e10, varlen 2x faster at 6.0e9.
# An empty dict: never. The environment variable CP_PCP_VARLEN=always / never overrides the
# choice (auto: this).
VARLEN_MAX_FLOP_PER_SEGMENT: dict[str, float] = {
    "forward": 5e10,
    "backward": 2.5e10,
    "forward_padded": 1.2e10,
    "backward_padded": 8e9,
}
VARLEN_ENV = "CP_PCP_VARLEN"
_VARLEN_ENV_VALUES = {"": None, "auto": None, "always": True, "1": True, "never": False, "0": False}


def varlen_override() -> bool | None:
    """The path forced by ``CP_PCP_VARLEN`` (always / never), or None (auto, or unset)."""
    value = os.environ.get(VARLEN_ENV, "").strip().lower()
    if value not in _VARLEN_ENV_VALUES:
        raise ValueError(
            f"{VARLEN_ENV}={value!r} is not understood: use auto, always or never (or 1 / 0)"
        )
    return _VARLEN_ENV_VALUES[value]


def segment_flop(
    segs: list[list[int]],
    num_heads: int,
    d_qk: int,
    d_v: int,
    prefix_cu: list[int] | None = None,
) -> list[int]:
    """Forward attention FLOPs of each segment (bottom-right causal: query i of a segment of
    q_len queries and k_len keys, its request's cached prefix included, sees
    k_len - q_len + i + 1 keys)."""
    flop = []
    for req, _, ql, _, kl in segs:
        if prefix_cu is not None:
            kl += prefix_cu[req + 1] - prefix_cu[req]
        flop.append(2 * (ql * kl - ql * (ql - 1) // 2) * num_heads * (d_qk + d_v))
    return flop


def varlen_limit(direction: str, d_qk: int, d_v: int) -> float | None:
    """The FLOPs-per-segment switch of ``direction`` (forward / backward) for these head
    dims: the ``_padded`` one when the values are narrower than the queries (MLA)."""
    key = direction + ("_padded" if d_v != d_qk else "")
    return VARLEN_MAX_FLOP_PER_SEGMENT.get(key)


def _flash_serves(q: torch.Tensor) -> bool:
    x = q[:1].unsqueeze(0).transpose(1, 2)
    params = torch.backends.cuda.SDPAParams(x, x, x, None, 0.0, True, False)
    return torch.backends.cuda.can_use_flash_attention(params, False)


# cuDNN builds an execution plan for every new block shape (and strides): on an H200 (torch
# 2.11, cuDNN 9.19) 45-85 ms a shape, forward and backward each, against 0.3-2.5 ms for the
# call itself. A rank's first forward of one 12k-30k token prompt of a new length took 124-170
# ms with the blocks at P = 2 and 8, the next call 1.4-4.6 ms (the backward 149-207 against
# 3.4-12); FlashAttention-2's varlen call pays nothing per shape and took 2.9-8.6 ms forward
# (benchmarks/results/pcp-new-shapes-2026-11-30.json). Every layer of a step shares the plan,
# so whether the builds pay off depends on how many calls the plan gets. The automatic forward
# therefore rents before it buys: a plan whose large segments have shapes that no earlier plan
# had runs as varlen calls until their estimated extra time (the plan's forward FLOPs x
# VARLEN_EXTRA_S_PER_FLOP, a call) adds up to CUDNN_BUILD_S, then on the blocks; at most about
# twice the better of the two in hindsight. A plan whose shapes an earlier plan had takes the
# blocks at once. The backward (training) builds at once: a run meets its shapes over many
# steps, and the varlen backward's packed key copies take more memory than the blocks, which
# a run sized for its steady state may not have. Remembered: the last CUDNN_SHAPES_KEPT plans'
# shapes.
CUDNN_BUILD_S = 0.15
# Extra seconds a varlen forward takes per forward FLOP of the plan, over warm cuDNN blocks
# (H200, bf16, one 32k sequence at P = 2, results/pcp-varlen-2026-11-30.json: GQA 1.7x, MLA
# 2.25x the block times).
VARLEN_EXTRA_S_PER_FLOP = {"forward": 1.2e-15, "forward_padded": 2.1e-15}
CUDNN_SHAPES_KEPT = 4096
_cudnn_shapes_seen: dict[int, None] = {}
_SHAPES_ATTR = "_cp_block_shapes"


def _blocks_ready(
    segments: torch.Tensor,
    segs: list[list[int]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_cu: list[int] | None,
    direction: str,
    flop: float,
) -> bool:
    """Whether this call of the plan should run the blocks (see :data:`CUDNN_BUILD_S`):
    True unless it is a forward that would run on cuDNN for shapes no earlier plan had, and
    the plan's calls so far have not yet rented the varlen path for as long as a build costs.
    ``flop``: the plan's forward FLOPs."""
    kind = (direction, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], str(q.device))
    memo = getattr(segments, _SHAPES_ATTR, None)
    if memo is None or memo[0] != segments._version:
        memo = (segments._version, {})
        try:
            setattr(segments, _SHAPES_ATTR, memo)
        except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes
            pass
    state = memo[1].get(kind)
    if state is None:
        rent = 0
        if select_block_backend(q, k, v, True) == "cudnn":
            prefix = None if prefix_cu is None else tuple(prefix_cu)
            # A hash keeps the memory small (a collision would only take the blocks early).
            key = hash((kind, tuple(map(tuple, segs)), prefix))
            extra = VARLEN_EXTRA_S_PER_FLOP.get(
                direction + ("_padded" if v.shape[2] != q.shape[2] else "")
            )
            if key not in _cudnn_shapes_seen and extra and flop > 0:
                rent = math.ceil(CUDNN_BUILD_S / (flop * extra))
            _cudnn_shapes_seen.pop(key, None)
            _cudnn_shapes_seen[key] = None  # most recent last
            while len(_cudnn_shapes_seen) > CUDNN_SHAPES_KEPT:
                del _cudnn_shapes_seen[next(iter(_cudnn_shapes_seen))]
        state = memo[1][kind] = {"calls": 0, "rent": rent}
    state["calls"] += 1
    return state["calls"] > state["rent"]


def _use_varlen(
    policy: bool | None,
    segs: list[list[int]],
    q: torch.Tensor,
    v: torch.Tensor,
    prefix_cu: list[int] | None,
    direction: str,
    segments: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
) -> bool:
    if policy is None:
        policy = varlen_override()
    if policy is not None:
        if policy and q.device.type == "cuda" and not _flash_serves(q):
            raise ValueError(
                f"the varlen PCP path was requested but FlashAttention-2 does not serve "
                f"{q.dtype} queries of head dim {q.shape[-1]} on this GPU (it takes float16 / "
                f"bfloat16, head dims up to 256); unset {VARLEN_ENV} or pass varlen=None"
            )
        return policy
    limit = varlen_limit(direction, q.shape[-1], v.shape[-1])
    if limit is None or q.device.type != "cuda":
        return False
    flop = [f for f in segment_flop(segs, q.shape[1], q.shape[2], v.shape[2], prefix_cu) if f > 0]
    if not flop or not _flash_serves(q):
        return False
    if sum(flop) < limit * len(flop):
        return True
    # Large segments: the blocks, unless cuDNN would first build plans for new shapes.
    if segments is None or k is None:
        return False
    return not _blocks_ready(segments, segs, q, k, v, prefix_cu, direction, sum(flop))


def _bhld(x: torch.Tensor) -> torch.Tensor:
    # [L, H, D] rows of a contiguous [T, H, D] tensor (or a [B, L, H, D] view of such rows) ->
    # [B, H, L, D] view; the kernels read the (B, L, H, D) memory layout directly.
    return (x.unsqueeze(0) if x.dim() == 3 else x).transpose(1, 2)


def _blhd(x: torch.Tensor, batched: bool) -> torch.Tensor:
    # A kernel's [B, H, L, D] result back to [B, L, H, D] (or [L, H, D] for one block).
    x = x.transpose(1, 2)
    return x if batched else x.squeeze(0)


def attention_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and LSE: out [L, Hq, Dv] (q's dtype), lse [L, Hq] fp32.

    Blocks of equal shape may come batched: [B, L, H, D] in, [B, L, Hq, Dv] and [B, L, Hq]
    out. ``causal`` is only used for square blocks (L == M), where top-left and bottom-right
    alignment agree.
    """
    backend = backend or select_block_backend(q, k, v, causal)
    batched = q.dim() == 4
    if backend == "reference":
        if not batched:
            return attention_with_lse(q, k, v, scale=scale, causal=causal)
        res = [attention_with_lse(*x, scale=scale, causal=causal) for x in zip(q, k, v)]
        return torch.stack([o for o, _ in res]), torch.stack([s for _, s in res])
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, causal, False, scale=scale
        )
    else:
        assert backend == "flash", backend
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhld(q), _bhld(k), _bhld(v), 0.0, causal, False, scale=scale
        )
    out, lse = res[0], res[1]
    B, H, L = out.shape[:3]
    return _blhd(out, batched), _blhd(lse.reshape(B, H, L, 1), batched)[..., 0]


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) from the merged ``out`` [L, Hq, Dv] and ``lse`` [L, Hq] fp32
    (or batched blocks: a leading B on every argument and result)."""
    backend = backend or select_block_backend(q, k, v, causal)
    batched = q.dim() == 4
    if backend == "reference":
        if not batched:
            return attention_with_lse_backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
        res = [
            attention_with_lse_backward(*x, scale=scale, causal=causal)
            for x in zip(dout, q, k, v, out, lse)
        ]
        return tuple(torch.stack(g) for g in zip(*res))
    L, M = q.shape[-3], k.shape[-3]
    # With dropout 0 the kernels never read the RNG state, but the schemas require tensors.
    lse_h = _bhld(lse.unsqueeze(-1)).squeeze(-1).contiguous()  # [B, H, L]
    if backend == "cudnn":
        seed = torch.empty((), dtype=torch.long, device=q.device)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out), lse_h.unsqueeze(-1),
            seed, seed, None, None, None, L, M, 0.0, causal, scale=scale,
        )  # fmt: skip
    else:
        assert backend == "flash", backend
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out), lse_h,
            None, None, L, M, 0.0, causal, seed, offset, scale=scale,
        )  # fmt: skip
    return tuple(_blhd(g, batched) for g in grads)


@triton.jit
def _merge_kernel(
    o0, o1, o2, l0, l1, l2, dst, dst_lse,
    num_rows, num_heads, head_dim,
    so0_t, so0_h, so1_t, so1_h, so2_t, so2_h,
    sl0_t, sl0_h, sl1_t, sl1_h, sl2_t, sl2_h,
    sd_t, sd_h, sdl_t, sdl_h,
    NUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_R (token, head) rows x BLOCK_D columns of the merged output.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    t = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < head_dim)[None, :]
    a0 = tl.load(l0 + t * sl0_t + h * sl0_h, mask=row_mask, other=0.0)
    a1 = tl.load(l1 + t * sl1_t + h * sl1_h, mask=row_mask, other=0.0)
    m = tl.maximum(a0, a1)
    if NUM == 3:
        a2 = tl.load(l2 + t * sl2_t + h * sl2_h, mask=row_mask, other=0.0)
        m = tl.maximum(m, a2)
    w0 = tl.exp(a0 - m)
    w1 = tl.exp(a1 - m)
    x0 = tl.load(o0 + (t * so0_t + h * so0_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    x1 = tl.load(o1 + (t * so1_t + h * so1_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    acc = w0[:, None] * x0.to(tl.float32) + w1[:, None] * x1.to(tl.float32)
    total = w0 + w1
    if NUM == 3:
        w2 = tl.exp(a2 - m)
        x2 = tl.load(o2 + (t * so2_t + h * so2_h)[:, None] + cols[None, :], mask=mask, other=0.0)
        acc += w2[:, None] * x2.to(tl.float32)
        total += w2
    acc = acc / total[:, None]
    out_ptr = dst + (t * sd_t + h * sd_h)[:, None] + cols[None, :]
    tl.store(out_ptr, acc.to(dst.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(dst_lse + t * sdl_t + h * sdl_h, m + tl.log(total), mask=row_mask)


def merge_partials_triton(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_rows: int = 32,
) -> None:
    """Merge 2 or 3 partials into ``out`` [L, H, D] and ``lse`` [L, H] fp32 (written in place).

    Same math as :func:`~cp_modules.reference.pcp_attention.merge_partials_reference`, in one
    pass: each partial is read once where they lie (any strides with a contiguous D) and the
    result lands in the caller's rows, so no stacked copy is made.
    """
    num = len(outs)
    assert num in (2, 3) and len(lses) == num
    L, H, D = out.shape
    assert out.stride(2) == 1 and all(o.stride(2) == 1 and o.shape == out.shape for o in outs)
    assert lse.dtype == torch.float32 and all(x.dtype == torch.float32 for x in lses)
    if L * H == 0:
        return
    o = list(outs) + [outs[0]] * (3 - num)
    s = list(lses) + [lses[0]] * (3 - num)
    block_d = min(triton.next_power_of_2(D), 128)
    grid = (triton.cdiv(L * H, block_rows), triton.cdiv(D, block_d))
    _merge_kernel[grid](
        *o, *s, out, lse, L * H, H, D,
        *(x for t in o for x in t.stride()[:2]),
        *(x for t in s for x in t.stride()),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM=num, BLOCK_R=block_rows, BLOCK_D=block_d,
    )  # fmt: skip


def merge_partials_into(
    outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Write the exact LSE merge of the partials into ``out`` / ``lse`` (views of the result).

    The Triton kernel on CUDA for 2-3 partials of a half or fp32 output; the reference
    otherwise (and a plain copy for a single partial).
    """
    if len(outs) == 1:
        if not _same_view(out, outs[0]):
            out.copy_(outs[0])
        lse.copy_(lses[0])
        return
    fused = out.is_cuda and len(outs) in (2, 3) and lse.dtype == torch.float32
    if fused:
        merge_partials_triton(outs, [x.float() for x in lses], out, lse)
        return
    o, s = merge_partials_reference(outs, lses, out.dtype)
    out.copy_(o)
    lse.copy_(s)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _host(segments: torch.Tensor) -> torch.Tensor:
    # The plan keeps a host copy (``segments_host``) so that this is free; a device copy works
    # but costs a synchronization.
    return segments if segments.device.type == "cpu" else segments.cpu()


def _rows(x: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """``length`` rows of ``x`` (contiguous [N, ...]) from each start.

    One start gives the slice; two give a [2, length, ...] view whose batch stride is the
    distance between the starts (no copy), which is how two equal squares share one call.
    """
    if len(starts) == 1:
        return x[starts[0] : starts[0] + length]
    a, b = starts
    assert b > a and x.is_contiguous()
    row = x.stride(0)
    return x.as_strided(
        (2, length, *x.shape[1:]),
        ((b - a) * row, *x.stride()),
        x.storage_offset() + a * row,
    )


def _square_groups(segs: list[list[int]]) -> list[list[int]]:
    """Indices of the segments whose causal squares run in one call.

    Two segments pair up when their squares have the same size and both their query rows and
    their square keys start later for the second (positive batch strides): a request's head
    and tail on a rank, in a training batch of equal-length sequences. Others run alone.
    """
    groups, i = [], 0
    while i < len(segs):
        a = segs[i]
        if i + 1 < len(segs):
            b = segs[i + 1]
            if b[2] == a[2] and b[1] > a[1] and _square_start(b) > _square_start(a):
                groups.append([i, i + 1])
                i += 2
                continue
        groups.append([i])
        i += 1
    return groups


def _square_start(seg: list[int]) -> int:
    _, _, ql, k0, kl = seg
    return k0 + kl - ql


def _other_blocks(
    seg: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu: list[int] | None,
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(where, first key row, keys, values) of a segment's unmasked blocks: the rectangle of
    new keys before its square, and its request's cached prefix."""
    req, _, ql, k0, kl = seg
    blocks = []
    if kl > ql:
        split = k0 + kl - ql
        blocks.append(("new", k0, k[k0:split], v[k0:split]))
    if prefix_cu is not None and prefix_cu[req + 1] > prefix_cu[req]:
        p0, p1 = prefix_cu[req], prefix_cu[req + 1]
        blocks.append(("prefix", p0, prefix_k[p0:p1], prefix_v[p0:p1]))
    return blocks


def _segments(segments: torch.Tensor) -> list[list[int]]:
    return [s for s in _host(segments).tolist() if s[2] > 0]  # ok: host (segments_host)


def pcp_prefill_attention_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu_seqlens: torch.Tensor | None,
    scale: float,
    *,
    block_forward: BlockForward = attention_block_forward,
    varlen: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries by blocks; same contract as the reference.

    Args:
        q: [T, Hq, Dqk]; k: [N, Hkv, Dqk]; v: [N, Hkv, Dv]; segments: [S, 5] int64 on the host;
        prefix_k: [C, Hkv, Dqk]; prefix_v: [C, Hkv, Dv]; prefix_cu_seqlens: [R + 1] int64 on the
        host (or the three None); scale: softmax scale.
        block_forward: the per-block kernel (tests pass the reference to check the
            decomposition on CPU).
        varlen: run every segment in one varlen call instead
            (:func:`~cp_modules.kernels.pcp_varlen.pcp_prefill_attention_varlen`); None
            decides (``CP_PCP_VARLEN``, else :data:`VARLEN_MAX_FLOP_PER_SEGMENT` and, for
            large segments on cuDNN, whether its plans for these shapes pay off yet:
            :data:`CUDNN_BUILD_S`).

    Returns:
        out [T, Hq, Dv] in q's dtype (0 on padding rows), lse [T, Hq] fp32 (-inf on padding).
    """
    segs = _segments(segments)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    if has_prefix:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    prefix_cu = prefix_cu_seqlens.tolist() if has_prefix else None  # ok: host (CPU tensor)
    if _use_varlen(varlen, segs, q, v, prefix_cu, "forward", segments, k):
        return pcp_prefill_attention_varlen(q, k, v, segments, scale, prefix_k, prefix_v, prefix_cu)
    T, rows_shape = q.shape[0], (q.shape[1], v.shape[2])
    squares: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = None
    groups = _square_groups(segs)
    for group in groups:
        ql = segs[group[0]][2]
        ks = [_square_start(segs[i]) for i in group]
        o, s = block_forward(
            _rows(q, [segs[i][1] for i in group], ql),
            _rows(k, ks, ql),
            _rows(v, ks, ql),
            scale=scale,
            causal=True,
        )
        for j, i in enumerate(group):
            squares[i] = (o[j], s[j]) if len(group) > 1 else (o, s)
        if len(groups) == 1 and [segs[i][1] for i in group] == list(range(0, T, ql)):
            if o.is_contiguous():
                # The squares' output holds every row of the result in order (one request's
                # head and tail, no padding): merge into it in place instead of copying. A
                # plain tensor on the same storage, not a view, so that callers may still
                # write into the op's output in place under autograd.
                out = o.new_empty(0).set_(
                    o.untyped_storage(),
                    o.storage_offset(),
                    (T, *rows_shape),
                    (rows_shape[0] * rows_shape[1], rows_shape[1], 1),
                )
    if out is None:
        out = q.new_empty(T, *rows_shape)
        _fill_uncovered(out, segs, 0.0)
    lse = torch.empty(q.shape[:2], dtype=lse_dtype(q.dtype), device=q.device)
    _fill_uncovered(lse, segs, float("-inf"))
    for i, seg in enumerate(segs):
        r = slice(seg[1], seg[1] + seg[2])
        outs, lses = [squares[i][0]], [squares[i][1]]
        for _, _, kb, vb in _other_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            o, s = block_forward(q[r], kb, vb, scale=scale, causal=False)
            outs.append(o)
            lses.append(s)
        merge_partials_into(outs, lses, out[r], lse[r])
    return out, lse


def _fill_uncovered(x: torch.Tensor, segs: list[list[int]], value: float) -> None:
    """Fill the rows of ``x`` that no segment's queries cover (padding) with ``value``.

    The merges write every covered row, so the rest is all that needs initialising; past a
    handful of separate runs one fill of the whole tensor costs less than many small ones.
    """
    spans = sorted((seg[1], seg[1] + seg[2]) for seg in segs)
    gaps, pos = [], 0
    for a, b in spans:
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < x.shape[0]:
        gaps.append((pos, x.shape[0]))
    if len(gaps) > 4:
        x.fill_(value)
        return
    for a, b in gaps:
        x[a:b].fill_(value)


@triton.jit
def _sum_rows_kernel(
    dst, p0, p1, p2, p3, r0, r1, r2, r3, d0, d1, d2, d3, num_rows, row_len,
    NUM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # dst row i = sum over pieces k < NUM of piece k's row (r_k + i * d_k), d_k = +1 or -1;
    # one program: BLOCK consecutive elements of the flattened rows.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_rows * row_len
    i = offs // row_len
    col = offs % row_len
    acc = tl.load(p0 + (r0 + i * d0) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    if NUM > 1:
        acc += tl.load(p1 + (r1 + i * d1) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    if NUM > 2:
        acc += tl.load(p2 + (r2 + i * d2) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    if NUM > 3:
        acc += tl.load(p3 + (r3 + i * d3) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=mask)


def sum_rows_triton(rows: torch.Tensor, parts: list[tuple[torch.Tensor, int, int]]) -> None:
    """``rows`` [n, ...] (contiguous) = the fp32 sum of 1-4 parts, rounded once.

    A part is (piece, row of the piece that lands on rows[0], +1 or -1): -1 reads the piece's
    rows backwards, so a gradient computed on reversed operands is summed without a flipped
    copy. Pieces are contiguous with rows' row size.
    """
    num = len(parts)
    assert 1 <= num <= 4 and rows.is_contiguous()
    n, row_len = rows.shape[0], rows[0].numel()
    if n * row_len == 0:
        return
    for x, first, step in parts:
        assert x.is_contiguous() and x[0].numel() == row_len
        assert 0 <= first < x.shape[0] and 0 <= first + (n - 1) * step < x.shape[0]
    ps = [p for p, _, _ in parts] + [parts[0][0]] * (4 - num)
    firsts = [f for _, f, _ in parts] + [0] * (4 - num)
    steps = [d for _, _, d in parts] + [1] * (4 - num)
    block = 1024
    _sum_rows_kernel[(triton.cdiv(n * row_len, block),)](
        rows, *ps, *firsts, *steps, n, row_len, NUM=num, BLOCK=block
    )


Piece = tuple[int, torch.Tensor] | tuple[int, torch.Tensor, bool]


def _part_rows(part: tuple[torch.Tensor, int, int], n: int) -> torch.Tensor:
    # ``n`` rows of a (piece, first row, step) part in natural order (a copy when reversed).
    x, first, step = part
    return x[first : first + n] if step == 1 else x[first - n + 1 : first + 1].flip(0)


def sum_pieces_into(
    dst: torch.Tensor | list[tuple[int, torch.Tensor]],
    pieces: list[Piece],
    *,
    skip: list[tuple[int, int]] | None = None,
    only: list[tuple[int, int]] | None = None,
) -> torch.Tensor | list[tuple[int, torch.Tensor]]:
    """Write into ``dst`` [N, ...] the sum of row ranges ``(first row, rows[, reversed])``;
    0 elsewhere. A reversed piece holds its rows last-first (natural row ``first + j`` is its
    row ``len - 1 - j``).

    ``dst`` may also be a list of ``(first row, rows)`` targets that tile rows ``[0, N)`` in
    order, each a tensor of its own (views into a buffer laid out differently, e.g. the
    all-gathered order that a reduce-scatter takes), so the result lands there without an
    index copy.

    Each run of rows covered by the same pieces is written once: zero-filled, copied, or the
    sum of its pieces computed in fp32 and rounded once (``a + b`` for two pieces of the
    result's dtype, else :func:`sum_rows_triton` on CUDA for up to 4 pieces, reversed ones
    included) — so no zeroed buffer is read back and each gradient block is read once.

    ``skip``: ``(first row, rows)`` ranges whose pieces do not exist yet; the rows they touch
    are left as they are. A second call with all the pieces and ``only`` = those ranges then
    writes just those rows, so the two calls together write every row once.
    """
    assert skip is None or only is None
    targets = [(0, dst)] if isinstance(dst, torch.Tensor) else dst
    n = 0
    for first, rows in targets:
        assert first == n, "targets must tile the rows in order"
        n += rows.shape[0]
    events: dict[int, list[int]] = {0: [], n: []}
    for first, _ in targets:
        events.setdefault(first, [])
    held = [(a, a + m) for a, m in (skip or only or ()) if m > 0]
    if only is not None and not held:
        return dst
    for a, b in held:
        assert 0 <= a and b <= n
        events.setdefault(a, [])
        events.setdefault(b, [])
    for idx, (first, x, *_) in enumerate(pieces):
        if x.shape[0] == 0:
            continue
        assert 0 <= first and first + x.shape[0] <= n
        events.setdefault(first, []).append(idx)
        events.setdefault(first + x.shape[0], []).append(~idx)
    active: list[int] = []
    points = sorted(events)
    t = -1
    for a, b in zip(points, points[1:]):
        for e in events[a]:
            if e >= 0:
                active.append(e)
            else:
                active.remove(~e)
        while t + 1 < len(targets) and targets[t + 1][0] <= a:
            t += 1
        if held and any(c < b and a < d for c, d in held) != (only is not None):
            continue
        t_first, t_rows = targets[t]
        rows = t_rows[a - t_first : b - t_first]
        # (piece, its row for natural row a, step)
        parts = []
        for i in active:
            first, x, *rev = pieces[i]
            if rev and rev[0]:
                parts.append((x, first + x.shape[0] - 1 - a, -1))
            else:
                parts.append((x, a - first, 1))
        n_rows = b - a
        natural = all(d == 1 for _, _, d in parts)
        fused = (
            rows.is_cuda
            and len(parts) <= 4
            and rows.is_contiguous()
            and all(x.is_contiguous() for x, _, _ in parts)
        )
        if not parts:
            rows.zero_()
        elif natural and len(parts) == 1:
            rows.copy_(_part_rows(parts[0], n_rows))
        elif natural and len(parts) == 2 and rows.dtype == parts[0][0].dtype == parts[1][0].dtype:
            torch.add(*(_part_rows(p, n_rows) for p in parts), out=rows)
        elif fused:
            sum_rows_triton(rows, parts)
        else:
            xs = [_part_rows(p, n_rows) for p in parts]
            acc = xs[0].to(lse_dtype(rows.dtype))
            for x in xs[1:]:
                acc = acc + x
            rows.copy_(acc)
    return dst


# Unmasked blocks of at least this many queries run their backward as causal pairs (see
# :func:`rectangle_backward_causal_pairs`) when cuDNN serves them and Dqk != Dv (MLA's 192 /
# 128). Measured on an H200 (bf16, 32 heads, Dqk 192 / Dv 128): cuDNN's non-causal backward
# runs at ~300 TFLOP/s at every shape tried; its causal one at 295 over 2k-wide tiles and 376
# over 4k-wide ones. In the PCP backward of a 32k sequence (worst rank / (dense / P)) they
# took P = 2 (8k-row chunks) from 1.43 to 1.22 (with :func:`sum_rows_triton`; 1.32 without);
# at P = 4 (4k rows) they were no faster (1.456 vs 1.465) and took 0.8 GB more memory. At
# D = 128 the non-causal backward is the faster one.
CAUSAL_PAIRS_MIN_ROWS = 8192


def _causal_pairs(policy: bool | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    L, M = q.shape[0], k.shape[0]
    if L < 2 or M < L:
        return False
    if policy is not None:
        return policy
    return (
        L >= CAUSAL_PAIRS_MIN_ROWS
        and q.shape[-1] != v.shape[-1]
        and select_block_backend(q, k, v, True) == "cudnn"
    )


def rectangle_backward_causal_pairs(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    block_backward: BlockBackward = attention_block_backward,
) -> tuple[list[Piece], list[Piece], list[Piece]]:
    """Backward of an unmasked block (q [L, ...] against k, v [M, ...], M >= L) as causal calls.

    The keys are cut into L-wide tiles. An unmasked L x L tile is its lower triangle (a causal
    call) plus its strict upper triangle; with queries and keys in reversed order the strict
    upper triangle is the causal (L - 1)-square of q[:-1] against k[1:]. So each tile takes two
    causal calls (the reversed operands are copies), and keys past the last whole tile take
    one unmasked call. The probabilities come from the merged ``out`` and ``lse``, so the
    pieces add up to the block's gradients exactly.

    Returns:
        (dq, dk, dv) pieces for :func:`sum_pieces_into`, rows relative to q and to k / v:
        dq as one fp32 piece, the strict upper triangles' dk / dv as reversed pieces.
    """
    L, M = q.shape[0], k.shape[0]
    span = M // L * L
    dout_r, q_r, out_r, lse_r = (x.flip(0) for x in (dout, q, out, lse))
    k_r, v_r = k[:span].flip(0), v[:span].flip(0)
    dq = torch.zeros(q.shape, dtype=lse_dtype(q.dtype), device=q.device)
    dq_up = torch.zeros_like(dq[1:])  # reversed rows of q[:-1]
    dk_p: list[Piece] = []
    dv_p: list[Piece] = []
    for a in range(0, span, L):
        gq, gk, gv = block_backward(
            dout, q, k[a : a + L], v[a : a + L], out, lse, scale=scale, causal=True
        )
        dq += gq
        dk_p.append((a, gk))
        dv_p.append((a, gv))
        f = span - a - L  # the tile's first row in k_r
        gq, gk, gv = block_backward(
            dout_r[1:], q_r[1:], k_r[f : f + L - 1], v_r[f : f + L - 1], out_r[1:], lse_r[1:],
            scale=scale, causal=True,
        )  # fmt: skip
        dq_up += gq
        dk_p.append((a + 1, gk, True))
        dv_p.append((a + 1, gv, True))
    dq[:-1] += dq_up.flip(0)
    if span < M:
        gq, gk, gv = block_backward(
            dout, q, k[span:], v[span:], out, lse, scale=scale, causal=False
        )
        dq += gq
        dk_p.append((span, gk))
        dv_p.append((span, gv))
    return [(0, dq)], dk_p, dv_p


# Whether the block backward writes the gradient rows that no causal square touches on a second
# CUDA stream while the squares run (see :func:`pcp_prefill_attention_backward_cuda`): the sums
# and zero fills are memory-bound and the squares' kernels compute-bound.
OVERLAP_GRADIENT_SUMS = True

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device(
        "cuda", device.index if device.index is not None else torch.cuda.current_device()
    )
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def _on_side(side: torch.cuda.Stream | None, main: torch.cuda.Stream | None):
    """Run the body on ``side`` after the work queued so far on ``main`` (inline without one).

    The caller makes ``main`` wait for ``side`` before anything frees or reads what the body
    wrote; tensors the body allocates belong to ``side``'s memory pool.
    """
    if side is None:
        yield
        return
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield


def _still_needed(
    pieces: list[Piece], late: list[tuple[int, int]], side: torch.cuda.Stream | None
) -> list[Piece]:
    """The pieces that touch a ``late`` range (rows written after the squares). The others
    have been read by writes queued on ``side``: their memory is handed to it, so that it is
    reused only once those writes are done."""
    kept = []
    for piece in pieces:
        first, x = piece[0], piece[1]
        if any(a < first + x.shape[0] and first < a + m for a, m in late):
            kept.append(piece)
        elif side is not None:
            x.record_stream(side)
    return kept


def pcp_prefill_attention_backward_cuda(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu_seqlens: torch.Tensor | None,
    scale: float,
    *,
    block_backward: BlockBackward = attention_block_backward,
    causal_pairs: bool | None = None,
    dk_into: list[tuple[int, torch.Tensor]] | None = None,
    dv_into: list[tuple[int, torch.Tensor]] | None = None,
    varlen: bool | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]:
    """Gradients of :func:`pcp_prefill_attention_cuda`, block by block.

    Every block (the paired squares, each rectangle and prefix) yields (dq, dk, dv) for its
    rows; :func:`sum_pieces_into` writes each gradient row once, on CUDA partly on a second
    stream while the squares run (:data:`OVERLAP_GRADIENT_SUMS`). Pieces are the kernels'
    outputs, summed in fp32 and rounded once per row. ``causal_pairs``: whether unmasked
    blocks run as causal pairs (:func:`rectangle_backward_causal_pairs`); None decides per
    block (:data:`CAUSAL_PAIRS_MIN_ROWS`). ``dk_into`` / ``dv_into``: targets tiling the N
    rows of dK / dV (see :func:`sum_pieces_into`) that receive the gradient instead of a
    fresh tensor; that result is then None. ``varlen``: as in
    :func:`pcp_prefill_attention_cuda`.

    Returns:
        dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k, dprefix_v (None
        without a prefix), each in its input's dtype.
    """
    segs = _segments(segments)
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    lse = lse.contiguous()
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    if has_prefix:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    prefix_cu = prefix_cu_seqlens.tolist() if has_prefix else None  # ok: host (CPU tensor)
    if _use_varlen(varlen, segs, q, v, prefix_cu, "backward", segments, k):
        dq, dk, dv, *dprefix = pcp_prefill_attention_varlen_backward(
            dout, q, k, v, out, lse, segments, scale, prefix_k, prefix_v, prefix_cu
        )
        if dk_into is not None:
            sum_pieces_into(dk_into, [(0, dk)])
            sum_pieces_into(dv_into, [(0, dv)])
            dk = dv = None
        return (dq, dk, dv, *dprefix) if dprefix else (dq, dk, dv, None, None)
    dq_p: list[Piece] = []
    dk_p: dict[str, list[Piece]] = {"new": [], "prefix": []}
    dv_p: dict[str, list[Piece]] = {"new": [], "prefix": []}
    # The rectangles and prefixes run first and the causal squares last. In between, the rows
    # that no square touches (most of dK / dV, the prefix gradients, rows no block reaches) are
    # written on a second stream while the squares run: these sums and fills are memory-bound,
    # the squares' kernels compute-bound. The results are allocated only once needed (dQ after
    # the squares: every query row is in a square), and the pieces used up by then are handed
    # to the second stream's allocator, so the squares' workspace replaces them in memory.
    for seg in segs:
        r = slice(seg[1], seg[1] + seg[2])
        for where, first, kb, vb in _other_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            if _causal_pairs(causal_pairs, q[r], kb, vb):
                pq, pk, pv = rectangle_backward_causal_pairs(
                    dout[r], q[r], kb, vb, out[r], lse[r], scale=scale,
                    block_backward=block_backward,
                )  # fmt: skip
            else:
                gq, gk, gv = block_backward(
                    dout[r], q[r], kb, vb, out[r], lse[r], scale=scale, causal=False
                )
                pq, pk, pv = [(0, gq)], [(0, gk)], [(0, gv)]
            dq_p += [(seg[1] + a, *rest) for a, *rest in pq]
            dk_p[where] += [(first + a, *rest) for a, *rest in pk]
            dv_p[where] += [(first + a, *rest) for a, *rest in pv]
    pq = pk = pv = gq = gk = gv = None  # the last block's pieces live on in the lists only
    square_k = [(_square_start(seg), seg[2]) for seg in segs]
    side = _side_stream(q.device) if OVERLAP_GRADIENT_SUMS and q.is_cuda else None
    main = torch.cuda.current_stream(q.device) if side is not None else None
    dk_dst = torch.empty_like(k) if dk_into is None else dk_into
    dv_dst = torch.empty_like(v) if dv_into is None else dv_into
    dpk = torch.empty_like(prefix_k) if has_prefix else None
    dpv = torch.empty_like(prefix_v) if has_prefix else None
    with _on_side(side, main):
        sum_pieces_into(dk_dst, dk_p["new"], skip=square_k)
        sum_pieces_into(dv_dst, dv_p["new"], skip=square_k)
        if has_prefix:
            sum_pieces_into(dpk, dk_p["prefix"])
            sum_pieces_into(dpv, dv_p["prefix"])
    for where in ("new", "prefix"):
        late = square_k if where == "new" else []
        dk_p[where] = _still_needed(dk_p[where], late, side)
        dv_p[where] = _still_needed(dv_p[where], late, side)
    for group in _square_groups(segs):
        ql = segs[group[0]][2]
        qs = [segs[i][1] for i in group]
        ks = [_square_start(segs[i]) for i in group]
        gq, gk, gv = block_backward(
            _rows(dout, qs, ql),
            _rows(q, qs, ql),
            _rows(k, ks, ql),
            _rows(v, ks, ql),
            _rows(out, qs, ql),
            _rows(lse, qs, ql),
            scale=scale,
            causal=True,
        )
        if len(group) == 1:
            gq, gk, gv = (x.unsqueeze(0) for x in (gq, gk, gv))
        for j in range(len(group)):
            dq_p.append((qs[j], gq[j]))
            dk_p["new"].append((ks[j], gk[j]))
            dv_p["new"].append((ks[j], gv[j]))
    dq = sum_pieces_into(torch.empty_like(q), dq_p)
    sum_pieces_into(dk_dst, dk_p["new"], only=square_k)
    sum_pieces_into(dv_dst, dv_p["new"], only=square_k)
    if side is not None:
        main.wait_stream(side)
    dk = dk_dst if dk_into is None else None
    dv = dv_dst if dv_into is None else None
    return dq, dk, dv, dpk, dpv
