"""Numerical comparison helpers following the flash-attention tolerance rule.

A kernel's error against an fp32 reference may be at most ``factor`` times the error of the
same computation done by plain PyTorch in the kernel's dtype, plus a small absolute floor.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close_to_reference", "assert_decode_close", "max_abs_err"]


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference, computed in fp32; NaN anywhere gives inf."""
    d = (a.float() - b.float()).abs()
    if d.numel() == 0:
        return 0.0
    if torch.isnan(d).any():
        return float("inf")
    return float(d.max())


def assert_close_to_reference(
    out: torch.Tensor,
    ref_fp32: torch.Tensor,
    ref_same_dtype: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    atol: float = 1e-5,
    name: str = "output",
) -> None:
    """Assert ``max|out - ref_fp32| <= factor * max|ref_same_dtype - ref_fp32| + atol``.

    Without ``ref_same_dtype`` the bound is ``atol`` alone (use it for fp32 paths).
    """
    if out.shape != ref_fp32.shape:
        raise AssertionError(
            f"{name}: shape {tuple(out.shape)} != reference {tuple(ref_fp32.shape)}"
        )
    err = max_abs_err(out, ref_fp32)
    base = 0.0 if ref_same_dtype is None else max_abs_err(ref_same_dtype, ref_fp32)
    bound = factor * base + atol
    if not err <= bound:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} exceeds bound {bound:.3e} "
            f"({factor} x same-dtype reference error {base:.3e} + atol {atol:.1e})"
        )


def assert_decode_close(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor],
    same: tuple[torch.Tensor, torch.Tensor],
    *,
    atol: float = 1e-4,
) -> None:
    """A decode kernel's (out, lse) against the fp32 reference ``ref`` by the rule above, with
    ``same`` the reference in the kernel's dtype: -inf LSE (a row that sees no key) exactly
    where the reference has it, the finite LSEs and the output within the bound."""
    assert_close_to_reference(out, ref[0], same[0], atol=atol)
    empty = torch.isneginf(ref[1])
    if not torch.equal(torch.isneginf(lse), empty):
        raise AssertionError("lse: the rows at -inf differ from the reference's")
    assert_close_to_reference(lse[~empty], ref[1][~empty], same[1][~empty], atol=atol, name="lse")
