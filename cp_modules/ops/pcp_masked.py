"""Which exact path PCP head/tail attention with a sliding window or a soft-cap takes.

Shape letters: T = this rank's local queries, N = restored new tokens, C = cached-prefix
tokens, Hq / Hkv = heads, Dqk / Dv = head dims.

The kernels (one packed call for all segments of a step) live in
:mod:`cp_modules.kernels.masked.prefill`; this module holds the choice, made per call from
:attr:`CPPolicy.pcp_masked <cp_modules.policy.CPPolicy>`:

* ``"auto"``: on CUDA, FlexAttention (fp16 / bf16 / fp32: its kernels accumulate in fp32)
  forward and backward, its backward kernel taking the given output and LSE
  (:mod:`cp_modules.kernels.masked.flex_backward`); where torch lacks what that call needs (its
  backward would recompute the forward), windows without a soft-cap take FlashAttention-2's
  backward with its window arguments where it serves the queries (fp16 / bf16, equal
  query-key and value head dims up to 256). The pure-PyTorch reference for fp64 (exact; the
  block path treats dtypes its kernels do not take the same way). On CPU: the reference.
  Measured on the H200 (``benchmarks/bench_masked.py``, bf16, Hq = Hkv = 32, D = 128, window
  4096): FlexAttention forward 5.1 ms against FlashAttention-2's 7.2 at 32k; rank forward +
  backward at one rank 1.03 x (32k) and 1.02 x (128k) the single-GPU FlexAttention's, where
  FlashAttention-2's backward made it 1.14 x
  (docs/experiments/2026-12-01-masked-prefill-speed.md).
* ``"flash"`` / ``"flex"``: that kernel, or a ``ValueError`` where it does not serve the call
  exactly. On CPU they run the kernel's packing with its CPU twin (the reference per packed
  sequence; eager FlexAttention forward and its dense twin backward): how the packing is
  tested without a GPU.
* ``"reference"``: the reference on either device.

A plan's packing (per window, prefix lengths and device) is built once and kept with the
plan's state (:func:`~cp_modules.ops.pcp_policy.plan_state`), like the varlen packing.
"""

from __future__ import annotations

import torch

from cp_modules.kernels.masked.flex_backward import flex_backward_supported
from cp_modules.kernels.masked.prefill import (
    MaskedPack,
    masked_pack,
    masked_prefill_backward,
    masked_prefill_forward,
)
from cp_modules.kernels.prefill.attention_blocks import flash_serves
from cp_modules.ops.pcp_policy import plan_state
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)

__all__ = [
    "FLEX_CUDA_DTYPES",
    "choose_masked_path",
    "masked_pack_of",
    "pcp_masked_attention",
    "pcp_masked_attention_backward",
]

# FlexAttention's compiled kernels accumulate in fp32 and keep the LSE in fp32: exact for
# these, not for fp64.
FLEX_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flash_serves_window(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.shape[-1] == v.shape[-1] and flash_serves(q)


def choose_masked_path(
    choice: str,
    q: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    softcap: float | None,
    direction: str = "forward",
) -> str:
    """The path (``"flash"``, ``"flex"`` or ``"reference"``) of a call (``direction``
    ``"forward"`` / ``"backward"``) with a window W and / or a soft-cap c (at least one of
    them given) under ``choice`` (:attr:`CPPolicy.pcp_masked <cp_modules.policy.CPPolicy>`);
    ``q`` [T, Hq, Dqk] and ``v`` [N, Hkv, Dv] as the op receives them.

    Raises:
        ValueError: where the forced kernel does not serve the call exactly, or (auto, CUDA)
            for a dtype no path serves.
    """
    assert window is not None or softcap, "a masked call has a window or a soft-cap"
    if choice == "reference":
        return "reference"
    if choice == "flash":
        if softcap or window is None:
            raise ValueError(
                f"pcp_masked='flash' (FlashAttention-2's window arguments) serves sliding "
                f"windows without soft-capping; got sliding_window={window!r}, "
                f"softcap={softcap!r}: use pcp_masked='auto', 'flex' or 'reference'"
            )
        if q.is_cuda and not _flash_serves_window(q, v):
            raise ValueError(
                f"pcp_masked='flash': FlashAttention-2 serves float16 / bfloat16 queries with "
                f"equal query-key and value head dims up to 256 on this GPU; got {q.dtype}, "
                f"head dims {q.shape[-1]} / {v.shape[-1]}: use pcp_masked='auto', 'flex' or "
                f"'reference'"
            )
        return "flash"
    if choice == "flex":
        if q.is_cuda and q.dtype not in FLEX_CUDA_DTYPES:
            raise ValueError(
                f"pcp_masked='flex': FlexAttention on CUDA accumulates in float32 and serves "
                f"{[str(d) for d in FLEX_CUDA_DTYPES]} exactly, got {q.dtype}: use "
                f"pcp_masked='auto' or 'reference'"
            )
        return "flex"
    assert choice == "auto", choice
    if not q.is_cuda or q.dtype == torch.float64:
        return "reference"
    assert direction in ("forward", "backward"), direction
    if (
        direction == "backward"
        and window is not None
        and not softcap
        and not flex_backward_supported()
        and _flash_serves_window(q, v)
    ):
        # FlexAttention's backward would recompute its forward: FlashAttention-2's takes the
        # given output and LSE.
        return "flash"
    if q.dtype in FLEX_CUDA_DTYPES:
        return "flex"
    raise ValueError(
        f"sliding windows and soft-capping on CUDA serve float16, bfloat16, float32 (and "
        f"float64 on the reference), got {q.dtype}"
    )


def _prefix_cu(inputs: PrefillInputs) -> list[int] | None:
    if inputs.prefix_k is None or inputs.prefix_cu_seqlens is None:
        return None
    return inputs.prefix_cu_seqlens.tolist()  # ok: host (CPU tensor)


def masked_pack_of(inputs: PrefillInputs, window: int | None, path: str = "flash") -> MaskedPack:
    """:func:`~cp_modules.kernels.masked.pack.masked_pack` of the inputs' plan for ``window``
    in the layout of ``path``'s kernel (FlexAttention: ``"runs"``, FlashAttention-2:
    ``"varlen"``), built once per plan, window, layout, prefix lengths and device."""
    layout = "runs" if path == "flex" else "varlen"
    device = inputs.q.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    prefix_cu = _prefix_cu(inputs)
    num_new = inputs.k.shape[0]
    key = (str(device), window, layout, None if prefix_cu is None else tuple(prefix_cu), num_new)
    packs = plan_state(inputs.segments).masked_packs
    pack = packs.get(key)
    if pack is None:
        pack = packs[key] = masked_pack(inputs.segments, num_new, prefix_cu, window, device, layout)
    return pack


def pcp_masked_attention(
    inputs: PrefillInputs,
    *,
    window: int | None,
    softcap: float | None,
    policy: CPPolicy,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention with a window and / or a soft-cap on the path ``policy`` chooses
    (:func:`choose_masked_path`); the reference's contract: out [T, Hq, Dv] in q's dtype (0 on
    padding rows), lse [T, Hq] fp32 (fp64 for fp64; -inf on padding rows)."""
    path = choose_masked_path(policy.pcp_masked, inputs.q, inputs.v, window, softcap)
    if path == "reference":
        return pcp_prefill_attention_reference(inputs, window=window, softcap=softcap)
    pack = masked_pack_of(inputs, window, path)
    return masked_prefill_forward(inputs, pack, kernel=path, softcap=softcap)


def pcp_masked_attention_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: PrefillInputs,
    *,
    window: int | None,
    softcap: float | None,
    policy: CPPolicy,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`pcp_masked_attention` from the final ``out`` / ``lse``: dq, dk,
    dv, dprefix_k, dprefix_v (None without a prefix), in the inputs' dtypes."""
    path = choose_masked_path(policy.pcp_masked, inputs.q, inputs.v, window, softcap, "backward")
    if path == "reference":
        return pcp_prefill_attention_backward_reference(
            dout, out, lse, inputs, window=window, softcap=softcap
        )
    pack = masked_pack_of(inputs, window, path)
    return masked_prefill_backward(dout, out, lse, inputs, pack, kernel=path, softcap=softcap)
