"""Attention blocks on PyTorch's fused kernels, with LSE, and the choice of kernel per block.

Shape letters: L / M = queries / keys of one block, B = blocks of equal shape batched in one
call, Hq / Hkv = query / KV heads, Dqk / Dv = head dims.

A block is one dense attention call (causal square or unmasked rectangle) that the PCP paths
(:mod:`cp_modules.kernels.prefill.pcp_blocks`, :mod:`cp_modules.kernels.prefill.pcp_key_major`) run. Each runs
on the fastest kernel PyTorch ships for its shape: cuDNN, else FlashAttention-2, else the fp32
reference for shapes and dtypes neither serves (why cuDNN first: ``docs/switch-points.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cp_modules.reference.pcp_attention import attention_with_lse, attention_with_lse_backward

__all__ = [
    "BLOCK_BACKENDS",
    "CUDNN_GQA",
    "BlockBackward",
    "BlockForward",
    "attention_block_backward",
    "attention_block_forward",
    "flash_serves",
    "select_block_backend",
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


def flash_serves(q: torch.Tensor) -> bool:
    """Whether FlashAttention-2 takes queries like ``q`` ([T, H, D] on CUDA): dtype, head dim."""
    x = q[:1].unsqueeze(0).transpose(1, 2)
    params = torch.backends.cuda.SDPAParams(x, x, x, None, 0.0, True, False)
    return torch.backends.cuda.can_use_flash_attention(params, False)


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
        dq, dk, dv = (torch.stack(g) for g in zip(*res))
        return dq, dk, dv
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
    dq, dk, dv = (_blhd(g, batched) for g in grads)
    return dq, dk, dv
