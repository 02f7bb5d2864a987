"""FlashAttention-2's varlen kernels with a sliding window over a :class:`MaskedPack
<cp_modules.kernels.masked.prefill.MaskedPack>` (``window_size_left = W - 1``,
``window_size_right = 0``: bottom-right causal per packed sequence), and their CPU twins (the
reference, sequence by sequence: for tests, only the kernel call itself differs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cp_modules.reference.pcp_attention import (
    attention_with_lse,
    attention_with_lse_backward,
    lse_dtype,
)

if TYPE_CHECKING:
    from cp_modules.kernels.masked.pack import MaskedPack

__all__ = [
    "flash_window_backward",
    "flash_window_backward_twin",
    "flash_window_forward",
    "flash_window_forward_twin",
]


def _window_left(pack: MaskedPack) -> int:
    assert pack.window is not None, "the FlashAttention-2 kernel serves windows"
    return pack.window - 1


def flash_window_forward(q, k, v, pack: MaskedPack, scale: float):
    """FlashAttention-2's varlen forward with the pack's window: (out, lse [Tq, Hq] fp32)."""
    # max_q >= 2 keeps the general kernel (one query a sequence with grouped heads takes a
    # special path in FlashAttention-2; pcp_varlen.varlen_forward_flash says why).
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, pack.cu_q, pack.cu_k, max(pack.max_q, 2), pack.max_k, 0.0, True, False,
        scale=scale, window_size_left=_window_left(pack), window_size_right=0,
    )  # fmt: skip
    lse = res[1]
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"unexpected varlen LSE layout {tuple(lse.shape)} for {q.shape[0]} packed queries "
            f"and {q.shape[1]} heads (expected [heads, queries])"
        )
    return res[0], lse.t()


def flash_window_backward(dout, q, k, v, out, lse, pack: MaskedPack, scale: float):
    """FlashAttention-2's varlen backward with the pack's window: (dq, dk, dv)."""
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.t().float().contiguous(), pack.cu_q, pack.cu_k, pack.max_q,
        pack.max_k, 0.0, True, seed, unused, scale=scale, window_size_left=_window_left(pack),
        window_size_right=0,
    )  # fmt: skip


def _sequences(pack: MaskedPack):
    for i in range(len(pack.cu_q_host) - 1):
        rq = slice(pack.cu_q_host[i], pack.cu_q_host[i + 1])
        yield rq, slice(pack.cu_k_host[i], pack.cu_k_host[i + 1])


def flash_window_forward_twin(q, k, v, pack: MaskedPack, scale: float):
    """:func:`flash_window_forward` by the reference, sequence by sequence (CPU, tests)."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype))
    for rq, rk in _sequences(pack):
        out[rq], lse[rq] = attention_with_lse(
            q[rq], k[rk], v[rk], scale=scale, causal=True, window=pack.window
        )
    return out, lse


def flash_window_backward_twin(dout, q, k, v, out, lse, pack: MaskedPack, scale: float):
    """:func:`flash_window_backward` by the reference (CPU, tests)."""
    dq, dk, dv = (torch.zeros_like(x, dtype=lse_dtype(x.dtype)) for x in (q, k, v))
    for rq, rk in _sequences(pack):
        dq[rq], dk[rk], dv[rk] = attention_with_lse_backward(
            dout[rq], q[rq], k[rk], v[rk], out[rq], lse[rq],
            scale=scale, causal=True, window=pack.window,
        )  # fmt: skip
    return dq, dk, dv
