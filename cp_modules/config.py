"""ParallelConfig: the parallel degrees of a run and every rule that makes them valid.

Sizes: tp (tensor), pcp (prefill context), dcp (decode context), dp (data), pp (pipeline).
World = dp * pp * pcp * tp; dcp adds no ranks, it regroups the (pcp, tp) ranks of a slice.
Every rule raises ``ValueError`` naming the field, the value and what would be valid, so a bad
configuration is refused before any process group or collective exists.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

__all__ = ["DCP_COMM_BACKENDS", "ParallelConfig", "valid_dcp_sizes"]

DCP_COMM_BACKENDS = ("ag_rs", "a2a")

_warned_deprecated_interleave = False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_dcp_sizes(tp: int, pcp: int) -> list[int]:
    """DCP sizes accepted for a (tp, pcp) slice.

    With pcp == 1 a DCP group lies inside the TP group: dcp divides tp. With pcp > 1 a DCP group
    spans all pcp ranks of ``dcp // pcp`` TP positions (groups span PCP first), so dcp is pcp
    times a divisor of tp; dcp == 1 (no KV sharding) is always valid.
    """
    if pcp == 1:
        return _divisors(tp)
    return [1] + [k * pcp for k in _divisors(tp)]


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass
class ParallelConfig:
    """Parallel degrees of a context-parallel run.

    Args:
        tensor_parallel_size: ranks a layer's heads are split over (tp).
        prefill_context_parallel_size: ranks a prompt's tokens are split over with
            DualChunkSwap (pcp).
        decode_context_parallel_size: ranks a request's KV cache is sharded over (dcp); it
            reuses the (pcp, tp) ranks, spanning PCP first.
        dcp_comm_backend: how partial decode outputs are combined: ``"ag_rs"`` (all-gather the
            LSEs, correct, reduce-scatter / all-reduce) or ``"a2a"`` (all-to-all of outputs and
            LSEs, then a local LSE-weighted combine).
        dcp_kv_cache_interleave_size: tokens stored consecutively on one DCP rank before the
            next rank takes over; must divide the KV-cache block size.
        cp_kv_cache_interleave_size: deprecated alias of ``dcp_kv_cache_interleave_size``.
        data_parallel_size: data-parallel replicas (dp).
        pipeline_parallel_size: pipeline stages (pp).

    Raises:
        ValueError: for any size, backend or interleave the layout cannot serve.
    """

    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_comm_backend: str = "ag_rs"
    dcp_kv_cache_interleave_size: int = 1
    cp_kv_cache_interleave_size: int | None = field(default=None, repr=False)
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "data_parallel_size",
            "pipeline_parallel_size",
        ):
            _check_size(name, getattr(self, name))
        self._move_deprecated_interleave()
        _check_size("dcp_kv_cache_interleave_size", self.dcp_kv_cache_interleave_size)

        if self.dcp_comm_backend not in DCP_COMM_BACKENDS:
            raise ValueError(
                f"dcp_comm_backend must be one of {list(DCP_COMM_BACKENDS)}, "
                f"got {self.dcp_comm_backend!r}"
            )
        if self.dcp_comm_backend == "a2a" and self.dcp == 1:
            raise ValueError(
                "dcp_comm_backend='a2a' requires decode_context_parallel_size > 1 "
                "(with dcp=1 there is nothing to combine); use 'ag_rs' or set dcp >= 2"
            )

        valid = valid_dcp_sizes(self.tp, self.pcp)
        if self.dcp not in valid:
            if self.pcp == 1:
                why = (
                    f"with prefill_context_parallel_size=1 it must divide "
                    f"tensor_parallel_size={self.tp}"
                )
            else:
                why = (
                    f"with prefill_context_parallel_size={self.pcp} a DCP group spans all PCP "
                    f"ranks of dcp/pcp TP positions, so it must be 1 or pcp times a divisor of "
                    f"tensor_parallel_size={self.tp}"
                )
            raise ValueError(
                f"decode_context_parallel_size={self.dcp} is invalid: {why}; valid values: {valid}"
            )

    def _move_deprecated_interleave(self) -> None:
        global _warned_deprecated_interleave
        old = self.cp_kv_cache_interleave_size
        if old is None:
            return
        _check_size("cp_kv_cache_interleave_size", old)
        if self.dcp_kv_cache_interleave_size not in (1, old):
            raise ValueError(
                f"cp_kv_cache_interleave_size={old} conflicts with "
                f"dcp_kv_cache_interleave_size={self.dcp_kv_cache_interleave_size}; set only "
                "dcp_kv_cache_interleave_size (cp_kv_cache_interleave_size is deprecated)"
            )
        if not _warned_deprecated_interleave:
            warnings.warn(
                "cp_kv_cache_interleave_size is deprecated; use dcp_kv_cache_interleave_size",
                DeprecationWarning,
                stacklevel=4,
            )
            _warned_deprecated_interleave = True
        self.dcp_kv_cache_interleave_size = old
        self.cp_kv_cache_interleave_size = None

    # Short names used throughout the package.
    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pcp(self) -> int:
        return self.prefill_context_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def interleave(self) -> int:
        return self.dcp_kv_cache_interleave_size

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.pcp * self.tp

    @property
    def tp_positions_per_dcp_group(self) -> int:
        """Distinct TP positions one DCP group covers (``dcp // pcp``, at least 1)."""
        return max(1, self.dcp // self.pcp)

    def validate_heads(self, num_heads: int, num_kv_heads: int | None = None) -> None:
        """Check that this layout can serve an attention layer with these head counts.

        Args:
            num_heads: query heads of the layer (all TP ranks together).
            num_kv_heads: KV heads (GQA/MHA); ``None`` for MLA, whose single latent is shared
                by every head and so is the same on every rank.

        Raises:
            ValueError: when heads do not split over TP, or when the ranks of a DCP group would
                hold different KV heads (which would make decode attention silently wrong).
        """
        _check_size("num_heads", num_heads)
        if num_heads % self.tp:
            raise ValueError(
                f"num_heads={num_heads} must be divisible by tensor_parallel_size={self.tp}; "
                f"valid tensor_parallel_size values: {_divisors(num_heads)}"
            )
        if num_kv_heads is None:
            return
        _check_size("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        if num_kv_heads % self.tp and self.tp % num_kv_heads:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} and tensor_parallel_size={self.tp}: one must divide "
                "the other (KV heads are split over TP, or replicated when tp > num_kv_heads)"
            )
        k = self.tp_positions_per_dcp_group
        if self.dcp == 1 or k == 1:
            return
        # TP positions t and t' hold the same KV head iff t // share == t' // share.
        share = self.tp // num_kv_heads if self.tp % num_kv_heads == 0 else 0
        if share == 0 or share % k:
            limit = max(1, self.tp // num_kv_heads) * self.pcp
            raise ValueError(
                f"decode_context_parallel_size={self.dcp} with tensor_parallel_size={self.tp}, "
                f"prefill_context_parallel_size={self.pcp} and num_kv_heads={num_kv_heads}: a DCP "
                f"group covers {k} TP positions, which hold different KV heads, so its ranks "
                f"cannot attend one shared KV cache. All ranks of a DCP group must hold the same "
                f"KV heads: need dcp/pcp to divide tp/num_kv_heads "
                f"(here dcp <= {limit} with dcp/pcp dividing {max(1, self.tp // num_kv_heads)})"
            )

    def validate_block_size(self, block_size: int) -> None:
        """Check the KV-cache block size against the DCP interleave.

        Raises:
            ValueError: if ``dcp_kv_cache_interleave_size`` exceeds or does not divide it.
        """
        _check_size("block_size", block_size)
        i = self.dcp_kv_cache_interleave_size
        if i > block_size or block_size % i:
            raise ValueError(
                f"dcp_kv_cache_interleave_size={i} must be <= block_size={block_size} and divide "
                f"it; valid values: {_divisors(block_size)}"
            )
