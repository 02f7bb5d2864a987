"""CPPolicy: every path choice and measured switch point of the attention ops, as one value.

The ops choose per call between exact paths (cuDNN blocks or one FlashAttention-2 varlen call,
MLA's query-major or key-major backward, ...). The defaults come from measurements on an H200
(``docs/switch-points.md``); a run that wants another choice builds another policy and hands
it to its :class:`~cp_modules.step.CPRuntime`, which every op of the step reads it from. Nothing
here is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "MLA_BACKWARD_PATHS",
    "MLA_DECODE_KERNELS",
    "PCP_MASKED_PATHS",
    "PCP_VARLEN_CHOICES",
    "CPPolicy",
]

PCP_VARLEN_CHOICES = ("auto", "always", "never")
MLA_BACKWARD_PATHS = ("auto", "key_major", "query_major")
MLA_DECODE_KERNELS = ("auto", "triton", "gluon")
PCP_MASKED_PATHS = ("auto", "flash", "flex", "reference")

_DEFAULT_VARLEN_LIMITS = {
    "forward": 5e10,
    "backward": 2.5e10,
    "forward_padded": 1.2e10,
    "backward_padded": 8e9,
}


@dataclass(frozen=True)
class CPPolicy:
    """Path choices and thresholds of the CP attention ops (all exact; they change speed only).

    Args:
        pcp_varlen: ``"auto"`` (by :attr:`varlen_max_flop_per_segment` and the cuDNN rental),
            ``"always"`` (one varlen call per direction; on CPU the varlen packing runs on the
            reference kernels) or ``"never"`` (the block decomposition).
        pcp_masked: the path of PCP prefill attention with a sliding window or a soft-cap:
            ``"auto"`` (CUDA: FlashAttention-2's window arguments for windows without
            soft-cap where it serves the dtype and head dims, else FlexAttention, and the
            reference for fp64; CPU: the reference), ``"flash"``, ``"flex"`` or
            ``"reference"``. Forcing ``"flash"`` or ``"flex"`` on CPU runs that path's packing
            with the kernel's CPU twin (the reference varlen kernel; eager FlexAttention).
        mla_backward: ``"auto"``, ``"key_major"`` or ``"query_major"`` (MLA's training
            backward; auto takes key-major on CUDA for long chunks that cuDNN serves).
        overlap_gradient_sums: sum the block backward's gradient pieces on a second CUDA stream.
        direct_grad_min_rows_per_run: write K/V (or MLA dQ) gradients straight into the
            reduce-scatter layout when the plan's runs average at least this many rows.
        key_major_min_rows: auto MLA key-major backward from this mean chunk length.
        causal_pairs_min_rows: MLA rectangles of at least this many query rows run their
            backward as causal pairs.
        mla_decode: the absorbed MLA decode kernel on CUDA: ``"auto"`` (the Gluon kernel where
            it serves the shape: sm_90, bf16/fp16, heads a multiple of 64, latent 512 + rope
            64; else Triton), ``"gluon"`` (refused where it does not serve) or ``"triton"``.
        window_exchange: layers with a sliding window receive only the K/V their queries see
            from the other PCP ranks (one uneven all-to-all; at most ``2 * (c + W)`` tokens
            per request) instead of all-gathering every new token; False keeps the all-gather.
        cudnn_build_s: seconds of cuDNN plan builds a new shape is worth renting varlen for.
        training_rents_cudnn: whether a forward that autograd will differentiate (training)
            rents the varlen call for new shapes too; by default (False) it runs on cuDNN at
            once, as HF's ``sdpa`` does: its backward builds cuDNN plans for the same shapes
            at once anyway, and training meets its shapes over many steps.
        varlen_max_flop_per_segment: mean forward FLOPs per segment up to which a batch runs
            as one varlen call, per direction (``forward``, ``backward``; ``*_padded`` for
            values narrower than the queries, MLA). An empty mapping: never.

    Raises:
        ValueError: for a choice outside the listed ones or a negative threshold.
    """

    pcp_varlen: str = "auto"
    pcp_masked: str = "auto"
    mla_backward: str = "auto"
    overlap_gradient_sums: bool = True
    direct_grad_min_rows_per_run: int = 1024
    key_major_min_rows: int = 2048
    causal_pairs_min_rows: int = 8192
    mla_decode: str = "auto"
    window_exchange: bool = True
    cudnn_build_s: float = 0.15
    training_rents_cudnn: bool = False
    varlen_max_flop_per_segment: dict[str, float] = field(
        default_factory=lambda: dict(_DEFAULT_VARLEN_LIMITS)
    )

    def __post_init__(self) -> None:
        if self.pcp_varlen not in PCP_VARLEN_CHOICES:
            raise ValueError(
                f"pcp_varlen must be one of {list(PCP_VARLEN_CHOICES)}, got {self.pcp_varlen!r}"
            )
        if self.pcp_masked not in PCP_MASKED_PATHS:
            raise ValueError(
                f"pcp_masked must be one of {list(PCP_MASKED_PATHS)}, got {self.pcp_masked!r}"
            )
        if self.mla_backward not in MLA_BACKWARD_PATHS:
            raise ValueError(
                f"mla_backward must be one of {list(MLA_BACKWARD_PATHS)}, got {self.mla_backward!r}"
            )
        if self.mla_decode not in MLA_DECODE_KERNELS:
            raise ValueError(
                f"mla_decode must be one of {list(MLA_DECODE_KERNELS)}, got {self.mla_decode!r}"
            )
        for name in (
            "direct_grad_min_rows_per_run",
            "key_major_min_rows",
            "causal_pairs_min_rows",
            "cudnn_build_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        limits = dict(self.varlen_max_flop_per_segment)
        bad = set(limits) - set(_DEFAULT_VARLEN_LIMITS)
        if bad:
            raise ValueError(
                f"varlen_max_flop_per_segment keys must be among {sorted(_DEFAULT_VARLEN_LIMITS)}, "
                f"got {sorted(bad)}"
            )
        object.__setattr__(self, "varlen_max_flop_per_segment", limits)

    def varlen_forced(self) -> bool | None:
        """True / False when :attr:`pcp_varlen` forces a path, None for auto."""
        return {"auto": None, "always": True, "never": False}[self.pcp_varlen]

    def varlen_limit(self, direction: str, d_qk: int, d_v: int) -> float | None:
        """The FLOPs-per-segment switch of ``direction`` for these head dims (``_padded``
        when the values are narrower than the queries), or None (never varlen)."""
        key = direction + ("_padded" if d_v != d_qk else "")
        return self.varlen_max_flop_per_segment.get(key)

    def with_(self, **changes: Any) -> CPPolicy:
        """A copy with ``changes`` applied (validated)."""
        return replace(self, **changes)

    def __hash__(self) -> int:
        return hash(
            (
                self.pcp_varlen,
                self.pcp_masked,
                self.mla_backward,
                self.overlap_gradient_sums,
                self.direct_grad_min_rows_per_run,
                self.key_major_min_rows,
                self.causal_pairs_min_rows,
                self.mla_decode,
                self.window_exchange,
                self.cudnn_build_s,
                self.training_rents_cudnn,
                tuple(sorted(self.varlen_max_flop_per_segment.items())),
            )
        )
