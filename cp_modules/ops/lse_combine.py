"""``cp::lse_combine`` and ``cp::lse_combine_packed``: exact combine of partial attention results.

Shape legend:
    N: partial results (KV shards)    B: tokens    H: heads    D: value head dim
    W: width of one packed token row (see :func:`packed_row_width`)

The packed layout moves the partial outputs and their fp32 LSEs in one all-to-all. Per
(partial, token) row of the packed ``[N, B, W]`` tensor (dtype of the outputs)::

    [ out[h=0, :D] ... out[h=H-1, :D] | (gap) | lse[0..H-1] as raw fp32 bits | pad ]

The LSE bits take ``4 / itemsize`` elements per head (2 for fp16/bf16, 1 for fp32); the gap
(only when ``H * D`` is odd in a 16-bit dtype) aligns them to 4 bytes, and the pad rounds the row
to 16 bytes so that every head row stays aligned for vectorised loads. The combine kernel reads
this buffer in place, through strided views.

On CPU the ops run :mod:`cp_modules.reference.lse_merge`; on CUDA the Triton kernel of
:mod:`cp_modules.kernels.merge`. Neither op is differentiable (decode only).
"""

from __future__ import annotations

import torch

from cp_modules.ops._lib import lib
from cp_modules.reference.lse_merge import lse_combine_reference

__all__ = [
    "lse_combine",
    "lse_combine_packed",
    "pack_partials",
    "packed_lse_offset",
    "packed_row_width",
    "unpack_partials",
]

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BASES = ("e", "2")

lib.define(
    "lse_combine(Tensor partial_out, Tensor partial_lse, bool base2=False) -> (Tensor, Tensor)"
)
lib.define(
    "lse_combine_packed(Tensor packed, int num_heads, int head_dim, bool base2=False) "
    "-> (Tensor, Tensor)"
)


def _lse_elems(dtype: torch.dtype) -> int:
    # Elements of ``dtype`` that hold one fp32 LSE.
    return 4 // dtype.itemsize


def packed_lse_offset(num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Element offset of the first LSE in a packed token row (a multiple of 4 bytes)."""
    p = _lse_elems(dtype)
    return -(-num_heads * head_dim // p) * p


def packed_row_width(num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Elements per packed token row: outputs, LSE bits and padding to a multiple of 16 bytes."""
    align = 16 // dtype.itemsize
    used = packed_lse_offset(num_heads, head_dim, dtype) + num_heads * _lse_elems(dtype)
    return -(-used // align) * align


def pack_partials(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Pack partial outputs and their fp32 LSEs into one tensor of the outputs' dtype.

    Args:
        partial_out: ``[..., H, D]`` fp16, bf16 or fp32 (any strides with a contiguous D;
            expanded views are fine and are materialised only once, by the packing copy).
        partial_lse: ``[..., H]`` fp32 with the same leading dims.

    Returns:
        ``packed [..., W]`` contiguous, ``W = packed_row_width(H, D, dtype)``.
    """
    *lead, h, d = partial_out.shape
    dtype = partial_out.dtype
    start = packed_lse_offset(h, d, dtype)
    width = packed_row_width(h, d, dtype)
    lse = partial_lse if partial_lse.stride(-1) == 1 else partial_lse.contiguous()
    lse_bits = lse.view(dtype)  # [..., H * 4 / itemsize]
    parts = [partial_out.flatten(-2)]
    if start > h * d:
        parts.append(partial_out.new_zeros((*lead, start - h * d)))
    parts.append(lse_bits)
    used = start + lse_bits.shape[-1]
    if width > used:
        parts.append(partial_out.new_zeros((*lead, width - used)))
    return torch.cat(parts, dim=-1)


def unpack_partials(
    packed: torch.Tensor, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed ``[N, B, W]`` tensor: ``out [N, B, H, D]`` and ``lse [N, B, H]`` fp32.

    ``packed`` must be contiguous in its last dim with 4-byte-aligned rows (as
    :func:`pack_partials` and an all-to-all of its result produce).
    """
    n, b, width = packed.shape
    out = packed[..., : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    start = packed_lse_offset(num_heads, head_dim, packed.dtype) // _lse_elems(packed.dtype)
    lse = packed.view(torch.float32)[..., start : start + num_heads]
    return out, lse


def _combine_cpu(partial_out, partial_lse, base2=False):
    return lse_combine_reference(partial_out, partial_lse, base2=base2)


def _combine_cuda(partial_out, partial_lse, base2=False):
    from cp_modules.kernels.merge import lse_combine_triton

    if partial_out.stride(-1) != 1:
        partial_out = partial_out.contiguous()
    return lse_combine_triton(partial_out, partial_lse, base2=base2)


def _combine_fake(partial_out, partial_lse, base2=False):
    n, b, h, d = partial_out.shape
    return partial_out.new_empty((b, h, d)), partial_lse.new_empty((b, h))


def _combine_packed_cpu(packed, num_heads, head_dim, base2=False):
    out, lse = unpack_partials(packed.contiguous(), num_heads, head_dim)
    return lse_combine_reference(out, lse, base2=base2)


def _combine_packed_cuda(packed, num_heads, head_dim, base2=False):
    from cp_modules.kernels.merge import lse_combine_triton

    out, lse = unpack_partials(packed.contiguous(), num_heads, head_dim)
    return lse_combine_triton(out, lse, base2=base2)


def _combine_packed_fake(packed, num_heads, head_dim, base2=False):
    b = packed.shape[1]
    return (
        packed.new_empty((b, num_heads, head_dim)),
        packed.new_empty((b, num_heads), dtype=torch.float32),
    )


lib.impl("lse_combine", _combine_cpu, "CPU")
lib.impl("lse_combine", _combine_cuda, "CUDA")
torch.library.register_fake("cp::lse_combine", _combine_fake, lib=lib)
lib.impl("lse_combine_packed", _combine_packed_cpu, "CPU")
lib.impl("lse_combine_packed", _combine_packed_cuda, "CUDA")
torch.library.register_fake("cp::lse_combine_packed", _combine_packed_fake, lib=lib)


def _check_base(base: str) -> bool:
    if base not in _BASES:
        raise ValueError(f"base must be one of {list(_BASES)}, got {base!r}")
    return base == "2"


def _check_out_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"{name} must be one of {list(_OUT_DTYPES)}, got {dtype}")


def _check_partials(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> None:
    if partial_out.dim() != 4:
        raise ValueError(
            f"partial_out must be [N, B, H, D] (4 dims), got shape {tuple(partial_out.shape)}"
        )
    n, b, h, d = partial_out.shape
    if n < 1 or d < 1:
        raise ValueError(
            f"partial_out needs N >= 1 partials and D >= 1, got shape {tuple(partial_out.shape)}"
        )
    if tuple(partial_lse.shape) != (n, b, h):
        raise ValueError(
            f"partial_lse must have shape [N, B, H] = {[n, b, h]} to match partial_out "
            f"{tuple(partial_out.shape)}, got {tuple(partial_lse.shape)}"
        )
    _check_out_dtype("partial_out.dtype", partial_out.dtype)
    if partial_lse.dtype != torch.float32:
        raise ValueError(f"partial_lse must be torch.float32, got {partial_lse.dtype}")
    if partial_out.device != partial_lse.device:
        raise ValueError(
            f"partial_out ({partial_out.device}) and partial_lse ({partial_lse.device}) must "
            "be on the same device"
        )


def lse_combine(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    return_lse: bool = False,
    base: str = "e",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Combine N partial attention results over disjoint key sets into the exact result.

    ``out = sum_n w_n * out_n`` with ``w_n = exp(lse_n - m) / sum_k exp(lse_k - m)`` and
    ``m = max_n lse_n``, in fp32. NaN and +inf LSEs count as -inf (an empty shard contributes
    nothing, even if its output is NaN); a row whose shards are all empty gives 0 and LSE -inf.

    Args:
        partial_out: ``[N, B, H, D]`` fp16, bf16 or fp32.
        partial_lse: ``[N, B, H]`` fp32.
        return_lse: also return the combined LSE.
        base: ``"e"`` for natural-log LSEs, ``"2"`` for kernels that return base-2 LSEs; the
            returned LSE uses the same base.

    Returns:
        ``out [B, H, D]`` in ``partial_out.dtype``; with ``return_lse`` also ``lse [B, H]`` fp32.

    Raises:
        ValueError: on a wrong rank, shape, dtype, device or base.
    """
    base2 = _check_base(base)
    _check_partials(partial_out, partial_lse)
    out, lse = torch.ops.cp.lse_combine(partial_out, partial_lse, base2)
    return (out, lse) if return_lse else out


def lse_combine_packed(
    packed: torch.Tensor,
    num_heads: int,
    head_dim: int,
    *,
    return_lse: bool = False,
    base: str = "e",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`lse_combine` reading partial outputs and LSEs from one packed tensor.

    Args:
        packed: ``[N, B, W]`` as made by :func:`pack_partials` (fp16, bf16 or fp32),
            ``W = packed_row_width(num_heads, head_dim, packed.dtype)``.
        num_heads: ``H``, heads per token row.
        head_dim: ``D``, value head dim.
        return_lse: also return the combined LSE.
        base: ``"e"`` or ``"2"``, as in :func:`lse_combine`.

    Returns:
        ``out [B, H, D]`` in ``packed.dtype``; with ``return_lse`` also ``lse [B, H]`` fp32.

    Raises:
        ValueError: on a wrong rank, width, dtype or base.
    """
    base2 = _check_base(base)
    if packed.dim() != 3 or packed.shape[0] < 1:
        raise ValueError(f"packed must be [N, B, W] with N >= 1, got shape {tuple(packed.shape)}")
    _check_out_dtype("packed.dtype", packed.dtype)
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"num_heads and head_dim must be >= 1, got {num_heads} and {head_dim}")
    width = packed_row_width(num_heads, head_dim, packed.dtype)
    if packed.shape[-1] != width:
        raise ValueError(
            f"packed rows must have W = packed_row_width({num_heads}, {head_dim}, "
            f"{packed.dtype}) = {width} elements, got {packed.shape[-1]}"
        )
    out, lse = torch.ops.cp.lse_combine_packed(packed, num_heads, head_dim, base2)
    return (out, lse) if return_lse else out
