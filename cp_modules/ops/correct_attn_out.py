"""``cp::correct_attn_out``: scale a rank's partial output by its weight among all-gathered LSEs.

Shape legend:
    N: DCP ranks    B: tokens    H: heads (all gathered heads)    D: value head dim
    K: head blocks of the output (the reduce-scatter's world size, or 1)

The ``ag_rs`` DCP combine all-gathers the LSEs, corrects every rank's output with this op and
sums the results over the ranks with a reduce-scatter (output ``[K, B, H/K, D]``, block k goes
to rank k) or an all-reduce (K = 1). On CPU it runs
:mod:`cp_modules.reference.lse_merge`; on CUDA the Triton kernel of
:mod:`cp_modules.kernels.merge`. Not differentiable (decode only).
"""

from __future__ import annotations

import torch

from cp_modules.ops._lib import lib
from cp_modules.ops.lse_combine import _check_base, _check_out_dtype
from cp_modules.reference.lse_merge import correct_attn_out_reference

__all__ = ["correct_attn_out"]

lib.define(
    "correct_attn_out(Tensor out, Tensor all_lse, int rank, int num_blocks=1, bool base2=False) "
    "-> (Tensor, Tensor)"
)


def _correct_cpu(out, all_lse, rank, num_blocks=1, base2=False):
    return correct_attn_out_reference(out, all_lse, rank, num_blocks=num_blocks, base2=base2)


def _correct_cuda(out, all_lse, rank, num_blocks=1, base2=False):
    from cp_modules.kernels.merge import correct_attn_out_triton

    if out.stride(-1) != 1:
        out = out.contiguous()
    return correct_attn_out_triton(out, all_lse, rank, num_blocks=num_blocks, base2=base2)


def _correct_fake(out, all_lse, rank, num_blocks=1, base2=False):
    b, h, d = out.shape
    return out.new_empty((num_blocks, b, h // num_blocks, d)), all_lse.new_empty((b, h))


lib.impl("correct_attn_out", _correct_cpu, "CPU")
lib.impl("correct_attn_out", _correct_cuda, "CUDA")
torch.library.register_fake("cp::correct_attn_out", _correct_fake, lib=lib)


def correct_attn_out(
    out: torch.Tensor,
    all_lse: torch.Tensor,
    rank: int,
    *,
    num_blocks: int = 1,
    return_lse: bool = False,
    base: str = "e",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scale ``out`` by this rank's LSE weight, so that a sum over ranks is the exact combine.

    ``corrected = w_rank * out`` with ``w_rank = exp(lse_rank - m) / sum_n exp(lse_n - m)``,
    fp32 math, NaN/+inf LSEs counted as -inf (see :func:`cp_modules.lse_combine`).

    Args:
        out: ``[B, H, D]`` this rank's partial output (fp16, bf16 or fp32).
        all_lse: ``[N, B, H]`` fp32 LSEs of every rank, this rank's at index ``rank``.
        rank: this rank's index in ``all_lse``.
        num_blocks: ``K``, the output is ``[K, B, H/K, D]`` (head block k at index k).
        return_lse: also return the combined LSE.
        base: ``"e"`` or ``"2"``.

    Returns:
        ``corrected [K, B, H/K, D]`` in ``out.dtype``; with ``return_lse`` also ``lse [B, H]``.

    Raises:
        ValueError: on a wrong shape, dtype, rank, block count or base.
    """
    base2 = _check_base(base)
    if out.dim() != 3:
        raise ValueError(f"out must be [B, H, D] (3 dims), got shape {tuple(out.shape)}")
    _check_out_dtype("out.dtype", out.dtype)
    b, h, d = out.shape
    if all_lse.dim() != 3 or tuple(all_lse.shape[1:]) != (b, h) or all_lse.shape[0] < 1:
        raise ValueError(
            f"all_lse must be [N, B, H] with [B, H] = {[b, h]} from out, got {tuple(all_lse.shape)}"
        )
    if all_lse.dtype != torch.float32:
        raise ValueError(f"all_lse must be torch.float32, got {all_lse.dtype}")
    n = all_lse.shape[0]
    if not 0 <= rank < n:
        raise ValueError(f"rank must be in [0, {n}) for {n} gathered LSEs, got {rank}")
    if num_blocks < 1 or h % num_blocks:
        raise ValueError(f"num_blocks must be >= 1 and divide H={h}, got {num_blocks}")
    corrected, lse = torch.ops.cp.correct_attn_out(out, all_lse, rank, num_blocks, base2)
    return (corrected, lse) if return_lse else corrected
