"""``cp::paged_attention`` and ``cp::paged_mla_attention``: decode attention on a paged cache.

Shape letters: T = queries, Hq = query heads, Hkv = KV heads, D = head dim, NB = physical blocks,
BS = tokens per block, R = block-table rows, M = entries per row, Rk = kv_lora_rank, P = rope dim.

Queries are flattened over requests: query ``t`` belongs to block-table row
``query_seq_idx[t]`` and attends the first ``query_kv_len[t]`` tokens that this rank stores for
that row. Decode is one query per request; multi-token queries (chunked-prefill continuation,
speculative tokens) give each token its own length, which makes them causal among themselves.
With DCP, compute the lengths with :func:`cp_modules.cache.dcp_query_kv_len` from the global
positions. Both ops return ``out`` and the fp32 natural-log ``lse`` the DCP combine needs; an
empty local range gives ``out = 0``, ``lse = -inf``.

``paged_attention`` also takes a per-query first local token (``query_kv_start``: sliding
windows) and a logit soft-cap; both run in the reference and the Triton kernel alike.

An fp8 (e4m3) cache is dequantized in the kernels (``k_scale`` / ``v_scale``, MLA's
``kv_scale``: fp32 [Hkv] or [1], None for 1.0); ``q`` and the outputs keep their dtype. fp8 MLA
decode runs the Gluon kernel's fp8 path where it serves the inputs
(``gluon_mla_fp8_supported``: 64-head tiles, one latent scale; ``mla_gluon_config.MLA_FP8_GLUON``
off sends every fp8 cache to Triton), and the Triton kernel for the rest (16 heads for one).

CPU runs the pure-PyTorch reference, CUDA the Triton split-KV kernel. Lengths stay in device
tensors and the split count is chosen from static shapes, so the ops are CUDA-graph safe.
"""

from __future__ import annotations

import torch

from cp_modules.cache.kv_dtype import is_fp8
from cp_modules.kernels.decode import gqa_tokens, mla_gluon_config
from cp_modules.kernels.decode.mla import paged_mla_attention_kernel
from cp_modules.kernels.decode.mla_gluon import (
    gluon_mla_fp8_supported,
    gluon_mla_supported,
    paged_mla_attention_gluon,
)
from cp_modules.kernels.decode.paged import paged_attention_kernel
from cp_modules.ops._lib import lib
from cp_modules.ops.kv_cache import check_cache_scale, check_gqa_cache_layout
from cp_modules.policy import MLA_DECODE_KERNELS
from cp_modules.reference.paged_decode import paged_attention_ref, paged_mla_attention_ref

__all__ = ["paged_attention", "paged_mla_attention"]

lib.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
    "Tensor query_seq_idx, Tensor query_kv_len, float scale, int num_splits=0, "
    "Tensor? query_kv_start=None, float softcap=0.0, Tensor? k_scale=None, "
    "Tensor? v_scale=None, int query_len=1) -> (Tensor out, Tensor lse)"
)
lib.define(
    "paged_mla_attention(Tensor q, Tensor cache, Tensor block_table, Tensor query_seq_idx, "
    "Tensor query_kv_len, float scale, int kv_lora_rank, int num_splits=0, "
    "str impl='auto', Tensor? kv_scale=None) -> (Tensor out, Tensor lse)"
)


def _paged_attention_cpu(q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale,
                         num_splits=0, query_kv_start=None, softcap=0.0, k_scale=None,
                         v_scale=None, query_len=1):  # fmt: skip
    # The reference attends query by query: runs change how the kernel reads, not the result.
    return paged_attention_ref(
        q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale,
        query_kv_start=query_kv_start, softcap=softcap or None, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip


def _paged_attention_cuda(q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale,
                          num_splits=0, query_kv_start=None, softcap=0.0, k_scale=None,
                          v_scale=None, query_len=1):  # fmt: skip
    # The tokens-on-M kernel where its switch is on and it serves the inputs (read per call).
    if gqa_tokens.GQA_TOKENS_ON_M and not gqa_tokens.gqa_tokens_on_m_supported(
        q, k_cache, v_cache, query_kv_start, softcap, query_len
    ):
        return gqa_tokens.paged_gqa_tokens_on_m(
            q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale, num_splits
        )
    return paged_attention_kernel(
        q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale, num_splits,
        query_kv_start=query_kv_start, softcap=softcap or None, k_scale=k_scale,
        v_scale=v_scale, query_len=query_len,
    )  # fmt: skip


def _paged_mla_attention_cpu(q, cache, block_table, query_seq_idx, query_kv_len, scale,
                             kv_lora_rank, num_splits=0, impl="auto", kv_scale=None):  # fmt: skip
    return paged_mla_attention_ref(
        q, cache, block_table, query_seq_idx, query_kv_len, scale, kv_lora_rank,
        kv_scale=kv_scale,
    )  # fmt: skip


def _paged_mla_attention_cuda(q, cache, block_table, query_seq_idx, query_kv_len, scale,
                              kv_lora_rank, num_splits=0, impl="auto", kv_scale=None):  # fmt: skip
    # The Gluon kernel (two warp groups, TMA) where it serves the shape; else Triton. An fp8
    # cache takes the Gluon kernel's fp8 path while MLA_FP8_GLUON is on (read at each call).
    args = (q, cache, block_table, query_seq_idx, query_kv_len, scale, kv_lora_rank)
    if impl != "triton":
        if not is_fp8(cache.dtype):
            why = gluon_mla_supported(q, cache, kv_lora_rank)
        elif mla_gluon_config.MLA_FP8_GLUON:
            why = gluon_mla_fp8_supported(q, cache, kv_lora_rank, kv_scale)
        else:
            why = "the Gluon MLA kernel takes bf16/fp16 caches, not fp8 (MLA_FP8_GLUON is off)"
        if why is None:
            return paged_mla_attention_gluon(*args, num_splits or None, kv_scale=kv_scale)
        if impl == "gluon":
            raise ValueError(f"CPPolicy(mla_decode='gluon'): {why}; use 'auto' or 'triton'")
    return paged_mla_attention_kernel(*args, num_splits, kv_scale=kv_scale)


lib.impl("paged_attention", _paged_attention_cpu, "CPU")
lib.impl("paged_attention", _paged_attention_cuda, "CUDA")
lib.impl("paged_mla_attention", _paged_mla_attention_cpu, "CPU")
lib.impl("paged_mla_attention", _paged_mla_attention_cuda, "CUDA")


@torch.library.register_fake("cp::paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale,
                          num_splits=0, query_kv_start=None, softcap=0.0, k_scale=None,
                          v_scale=None, query_len=1):  # fmt: skip
    t, hq, _ = q.shape
    return q.new_empty(t, hq, v_cache.shape[-1]), q.new_empty(t, hq, dtype=torch.float32)


@torch.library.register_fake("cp::paged_mla_attention")
def _paged_mla_attention_fake(q, cache, block_table, query_seq_idx, query_kv_len, scale,
                              kv_lora_rank, num_splits=0, impl="auto", kv_scale=None):  # fmt: skip
    t, h, _ = q.shape
    return q.new_empty(t, h, kv_lora_rank), q.new_empty(t, h, dtype=torch.float32)


_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_MIN_CUDA_DIM = 16  # the K extent of a tensor-core dot (the scores' head dim)


def _check_common(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, ...],
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    num_splits: int | None,
) -> None:
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    for c in caches:
        if c.dtype != q.dtype and not is_fp8(c.dtype):
            raise ValueError(
                f"cache dtype {c.dtype} must equal q's dtype {q.dtype} or be "
                f"torch.float8_e4m3fn (an fp8 cache)"
            )
    if block_table.dim() != 2 or block_table.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"block_table must be an int32/int64 [R, M] tensor, got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    t = q.shape[0]
    for name, x in (("query_seq_idx", query_seq_idx), ("query_kv_len", query_kv_len)):
        if x.shape != (t,) or x.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"{name} must be an int32/int64 tensor of shape [T]=[{t}], got {x.dtype} "
                f"{tuple(x.shape)}"
            )
    devices = {x.device for x in (q, *caches, block_table, query_seq_idx, query_kv_len)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        raise ValueError(
            f"num_splits must be None or 0 (auto) or an integer >= 1, got {num_splits!r}"
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
    query_kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query against its request's local paged K/V; returns ``(out, lse)``.

    Args:
        q: [T, Hq, D], fp16/bf16/fp32 (last dim contiguous).
        k_cache, v_cache: [NB, BS, Hkv, D] in ``q``'s dtype or fp8 e4m3; Hq a multiple of Hkv;
            last dims contiguous, or ``v_cache`` token-minor (its token stride 1).
        block_table: [R, M] int32/int64 physical block ids.
        query_seq_idx: [T] int32/int64 row of ``block_table`` of each query.
        query_kv_len: [T] int32/int64 local tokens each query sees (at most M * BS).
        scale: softmax scale (typically ``D ** -0.5``).
        num_splits: KV splits of the CUDA kernel; None chooses from static shapes.
        query_kv_start: [T] first local token each query sees (a sliding window), or None.
        softcap: logit soft-cap ``c`` (scores become ``c * tanh(scores / c)``), or None.
        k_scale, v_scale: fp8 caches: fp32 [Hkv] or [1] dequantization scales (None: 1.0).
        query_len: Q >= 1: queries ``[i * Q, (i + 1) * Q)`` are consecutive tokens of one
            request (the same ``query_seq_idx``; a verification's ``k + 1`` tokens), which the
            CUDA kernel serves together, reading their K/V once. Each query keeps its own
            range and the result is the per-query one; a static promise (not checked on the
            device): queries of one run with different rows would read the first one's.

    Returns:
        out [T, Hq, D] in ``q``'s dtype; lse [T, Hq] fp32, natural log (-inf when empty).

    Raises:
        ValueError: for mismatched shapes, dtypes or devices, or a bad ``query_len``.
    """
    if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1:
        raise ValueError(f"query_len must be an integer >= 1, got {query_len!r}")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q must be [T, Hq, D] and k_cache, v_cache [NB, BS, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"q head dim {d} must equal the cache head dim {k_cache.shape[3]}")
    if hq % hkv:
        raise ValueError(f"query heads Hq={hq} must be a multiple of the cache's KV heads {hkv}")
    _check_common(q, (k_cache, v_cache), block_table, query_seq_idx, query_kv_len, num_splits)
    check_gqa_cache_layout(k_cache, v_cache)
    if q.is_cuda and q.shape[-1] < _MIN_CUDA_DIM:
        raise ValueError(
            f"the CUDA paged decode kernel takes head dims of at least {_MIN_CUDA_DIM} "
            f"(tensor-core tiles); got {q.shape[-1]}"
        )
    if query_kv_start is not None and (
        query_kv_start.shape != query_kv_len.shape
        or query_kv_start.dtype not in _INDEX_DTYPES
        or query_kv_start.device != q.device
    ):
        raise ValueError(
            f"query_kv_start must be an int32/int64 tensor of query_kv_len's shape "
            f"{tuple(query_kv_len.shape)} on {q.device}, got {query_kv_start.dtype} "
            f"{tuple(query_kv_start.shape)} on {query_kv_start.device}"
        )
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
    check_cache_scale(k_scale, k_cache, hkv, "k_scale")
    check_cache_scale(v_scale, v_cache, hkv, "v_scale")
    return torch.ops.cp.paged_attention(
        q.contiguous() if q.stride(-1) != 1 else q,
        k_cache,
        v_cache,
        block_table,
        query_seq_idx,
        query_kv_len,
        float(scale),
        num_splits or 0,
        query_kv_start,
        float(softcap or 0.0),
        k_scale,
        v_scale,
        query_len,
    )


def paged_mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    kernel: str = "auto",
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode against the latent cache; returns ``(out [T, H, Rk], lse [T, H])``.

    Keys are the whole latent rows ``[kv_c | k_pe]``; values are their first ``kv_lora_rank``
    elements.

    Args:
        q: [T, H, Rk + P] absorbed query (``q_nope @ W_UK`` then the rope part).
        cache: [NB, BS, Rk + P] in ``q``'s dtype.
        block_table, query_seq_idx, query_kv_len, scale, num_splits: as in
            :func:`paged_attention`.
        kv_lora_rank: Rk, the latent width (512 for DeepSeek-V2/V3).
        kernel: the CUDA kernel, as :attr:`CPPolicy.mla_decode
            <cp_modules.policy.CPPolicy>` (``"auto"``, ``"gluon"`` or ``"triton"``); an fp8
            cache runs the Gluon kernel where its fp8 path serves the inputs, else Triton
            (``"gluon"``: else refused, naming why; with ``mla_gluon_config.MLA_FP8_GLUON``
            off, always Triton and ``"gluon"`` refused).
        kv_scale: an fp8 cache: its fp32 [1] dequantization scale (None: 1.0).

    Returns:
        out [T, H, Rk] in ``q``'s dtype; lse [T, H] fp32, natural log (-inf when empty).

    Raises:
        ValueError: for mismatched shapes, dtypes or devices.
    """
    if q.dim() != 3 or cache.dim() != 3 or q.shape[2] != cache.shape[2]:
        raise ValueError(
            f"q must be [T, H, Rk + P] and cache [NB, BS, Rk + P] with the same last dim; got "
            f"{tuple(q.shape)} and {tuple(cache.shape)}"
        )
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < cache.shape[2]:
        raise ValueError(
            f"kv_lora_rank must be an integer in [1, {cache.shape[2] - 1}] (the cache row is "
            f"kv_lora_rank + rope_dim = {cache.shape[2]}), got {kv_lora_rank!r}"
        )
    _check_common(q, (cache,), block_table, query_seq_idx, query_kv_len, num_splits)
    if cache.stride(-1) != 1:
        raise ValueError(f"cache must be contiguous in its last dim, got strides {cache.stride()}")
    rope = cache.shape[2] - kv_lora_rank
    if q.is_cuda and min(kv_lora_rank, rope) < _MIN_CUDA_DIM:
        raise ValueError(
            f"the CUDA MLA decode kernels take a latent and a rope width of at least "
            f"{_MIN_CUDA_DIM} (tensor-core tiles); got {kv_lora_rank} and {rope}"
        )
    if kernel not in MLA_DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {list(MLA_DECODE_KERNELS)}, got {kernel!r}")
    check_cache_scale(kv_scale, cache, 1, "kv_scale")
    return torch.ops.cp.paged_mla_attention(
        q.contiguous() if q.stride(-1) != 1 else q,
        cache,
        block_table,
        query_seq_idx,
        query_kv_len,
        float(scale),
        kv_lora_rank,
        num_splits or 0,
        kernel,
        kv_scale,
    )
