"""Which exact path PCP head/tail attention takes: one varlen call or the cuDNN blocks.

Shape letters: T = this rank's local queries, N = restored new tokens, C = cached-prefix
tokens, S = segments (``cp_modules.partition.plan.SEGMENT_FIELDS``), Hq / Hkv = heads,
Dqk / Dv = head dims.

Both paths give the same attention; they differ in speed. The kernels (launchers) live in
:mod:`cp_modules.kernels.prefill.pcp_blocks` and :mod:`cp_modules.kernels.prefill.pcp_varlen`; this module
holds the choice between them, made per call from a :class:`~cp_modules.policy.CPPolicy`:

* ``pcp_varlen`` ``"always"`` / ``"never"`` forces a path;
* ``"auto"``: a batch whose segments average fewer forward FLOPs than
  ``varlen_max_flop_per_segment`` runs as one varlen call (host time per segment dominates
  the blocks there); larger segments take the blocks, except that a forward whose blocks
  would run on cuDNN for shapes no earlier plan had *rents* the varlen call until its
  estimated extra time adds up to ``cudnn_build_s`` (cuDNN builds an execution plan per new
  shape, which pays off only over enough calls). The backward builds at once, and so does a
  forward whose output autograd will differentiate (training), unless
  ``CPPolicy.training_rents_cudnn``: its backward builds plans for the same shapes anyway,
  and training meets them over many steps (:func:`pcp_policy_args` passes such a call a
  ``cudnn_build_s`` of 0).

Measurements behind the defaults: ``docs/switch-points.md``.

What is kept per plan (its varlen packing, its rental's call counts) lives in a
:class:`PlanState` keyed by the plan's host segments tensor (by identity, dropped with the
tensor, renewed when the tensor is modified); the shapes seen by earlier plans in a
:class:`CudnnRental`. The op schemas carry the policy as scalars (:func:`pcp_policy_args`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cp_modules.kernels.masked.pack import MaskedPack
from cp_modules.kernels.prefill.attention_blocks import (
    BlockBackward,
    BlockForward,
    attention_block_backward,
    attention_block_forward,
    flash_serves,
    select_block_backend,
)
from cp_modules.kernels.prefill.grad_assembly import sum_pieces_into
from cp_modules.kernels.prefill.pcp_blocks import (
    host_segments,
    pcp_blocks_backward,
    pcp_blocks_forward,
)
from cp_modules.kernels.prefill.pcp_varlen import (
    VarlenPack,
    pcp_prefill_attention_varlen,
    pcp_prefill_attention_varlen_backward,
    varlen_pack,
)
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import PrefillInputs

__all__ = [
    "CUDNN_SHAPES_KEPT",
    "RENT_MIN_CALLS",
    "VARLEN_EXTRA_S_PER_FLOP",
    "CudnnRental",
    "PlanState",
    "choose_varlen",
    "pcp_policy_args",
    "pcp_prefill_attention_backward_cuda",
    "pcp_prefill_attention_cuda",
    "plan_state",
    "policy_from_args",
    "segment_flop",
]

DEFAULT_POLICY = CPPolicy()

# Extra seconds a varlen forward takes per forward FLOP of the plan over warm cuDNN blocks
# (docs/switch-points.md); the backward has none (it never rents).
VARLEN_EXTRA_S_PER_FLOP = {"forward": 1.2e-15, "forward_padded": 2.1e-15}
# A plan whose estimated build time is worth fewer varlen calls than this builds at once:
# models have more attention layers than that, so renting would only add its extra time to
# the build it ends with (MLA at 16k tokens a rank: ~6 calls; GQA: ~57).
RENT_MIN_CALLS = 8
# How many plans' shapes the rental remembers.
CUDNN_SHAPES_KEPT = 4096


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


@dataclass
class PlanState:
    """What the PCP paths keep for one plan: its varlen packings (by device, prefix lengths
    and row count), its masked packings (:mod:`cp_modules.ops.pcp_masked`) and the rental's
    ``[calls, rented calls]`` per call kind."""

    version: int
    packs: dict[tuple, VarlenPack] = field(default_factory=dict)
    masked_packs: dict[tuple, MaskedPack] = field(default_factory=dict)
    calls: dict[tuple, list[int]] = field(default_factory=dict)

    def varlen_pack(
        self, segments: torch.Tensor, device: torch.device, prefix_cu: list[int] | None, rows: int
    ) -> VarlenPack:
        """:func:`~cp_modules.kernels.prefill.pcp_varlen.varlen_pack` of the plan, built once."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (str(device), None if prefix_cu is None else tuple(prefix_cu), rows)
        pack = self.packs.get(key)
        if pack is None:
            pack = self.packs[key] = varlen_pack(segments, device, prefix_cu, rows)
        return pack


_PLAN_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def plan_state(segments: torch.Tensor) -> PlanState:
    """The :class:`PlanState` of the plan whose host segments tensor is ``segments`` (a fresh
    one for a tensor not seen before, or modified in place since)."""
    state = _PLAN_STATES.get(segments)
    if state is None or state.version != segments._version:
        state = _PLAN_STATES[segments] = PlanState(segments._version)
    return state


@dataclass
class CudnnRental:
    """The cuDNN plan-build rental: which plans' block shapes cuDNN has built plans for.

    Args:
        extra_s_per_flop: extra seconds per plan FLOP of a varlen call over warm blocks, by
            ``direction`` (``_padded`` for values narrower than the queries); a direction
            without one never rents.
        shapes_kept: how many plans' shapes are remembered (the oldest are forgotten).
        min_rent_calls: a plan rents only when its build time is worth at least this many
            varlen calls (:data:`RENT_MIN_CALLS`), else it builds at once.
    """

    extra_s_per_flop: dict[str, float] = field(
        default_factory=lambda: dict(VARLEN_EXTRA_S_PER_FLOP)
    )
    shapes_kept: int = CUDNN_SHAPES_KEPT
    min_rent_calls: int = RENT_MIN_CALLS
    seen: dict[int, None] = field(default_factory=dict)

    def blocks_ready(
        self,
        state: PlanState,
        segs: list[list[int]],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_cu: list[int] | None,
        direction: str,
        flop: float,
        *,
        cudnn_build_s: float,
        backend: str | None = None,
    ) -> bool:
        """Whether this call of the plan (``state``) should run the blocks: True unless it is
        a forward that would run on cuDNN (``backend``, else asked) for shapes no earlier plan
        had, and the plan's calls so far have not yet rented the varlen path for as long as a
        build costs (``cudnn_build_s``). ``flop``: the plan's forward FLOPs."""
        kind = (direction, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], str(q.device))
        calls = state.calls.get(kind)
        if calls is None:
            rent = 0
            if (backend or select_block_backend(q, k, v, True)) == "cudnn":
                prefix = None if prefix_cu is None else tuple(prefix_cu)
                # A hash keeps the memory small (a collision would only take the blocks early).
                key = hash((kind, tuple(map(tuple, segs)), prefix))
                extra = self.extra_s_per_flop.get(
                    direction + ("_padded" if v.shape[2] != q.shape[2] else "")
                )
                if key not in self.seen and extra and flop > 0:
                    worth = cudnn_build_s / (flop * extra)  # varlen calls a build is worth
                    rent = math.ceil(worth) if worth >= self.min_rent_calls else 0
                self.seen.pop(key, None)
                self.seen[key] = None  # most recent last
                while len(self.seen) > self.shapes_kept:
                    del self.seen[next(iter(self.seen))]
            calls = state.calls[kind] = [0, rent]
        calls[0] += 1
        return calls[0] > calls[1]


_RENTAL = CudnnRental()


def choose_varlen(
    policy: CPPolicy,
    direction: str,
    segments: torch.Tensor,
    segs: list[list[int]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_cu: list[int] | None,
    *,
    rental: CudnnRental | None = None,
) -> bool:
    """Whether this call (``direction`` ``"forward"`` / ``"backward"``) runs as one varlen call.

    Raises:
        ValueError: if ``policy`` forces the varlen path on a GPU whose FlashAttention-2 does
            not serve these queries.
    """
    forced = policy.varlen_forced()
    if forced is not None:
        if forced and q.device.type == "cuda" and not flash_serves(q):
            raise ValueError(
                f"the varlen PCP path was requested but FlashAttention-2 does not serve "
                f"{q.dtype} queries of head dim {q.shape[-1]} on this GPU (it takes float16 / "
                f"bfloat16, head dims up to 256); use CPPolicy(pcp_varlen='auto') or 'never'"
            )
        return forced
    limit = policy.varlen_limit(direction, q.shape[-1], v.shape[-1])
    if limit is None or q.device.type != "cuda":
        return False
    flop = [f for f in segment_flop(segs, q.shape[1], q.shape[2], v.shape[2], prefix_cu) if f > 0]
    if not flop or not flash_serves(q):
        return False
    if sum(flop) < limit * len(flop):
        return True
    # Large segments: the blocks, unless cuDNN would first build plans for new shapes.
    rental = _RENTAL if rental is None else rental
    ready = rental.blocks_ready(
        plan_state(segments), segs, q, k, v, prefix_cu, direction, sum(flop),
        cudnn_build_s=policy.cudnn_build_s,
    )  # fmt: skip
    return not ready


def pcp_policy_args(
    policy: CPPolicy, d_qk: int, d_v: int, *, differentiable: bool = False
) -> tuple:
    """The policy as the scalar arguments of the ``cp::pcp_prefill_attention*`` ops, for
    head dims ``d_qk`` / ``d_v``: (varlen, forward limit, backward limit, cudnn_build_s,
    causal_pairs_min_rows, overlap_gradient_sums, masked); :func:`policy_from_args` inverts
    it. ``differentiable``: the call's output will be differentiated (training); unless
    ``policy.training_rents_cudnn``, its forward then rents nothing (``cudnn_build_s`` 0):
    it runs on cuDNN at once, as HF's ``sdpa`` does."""
    rents = policy.training_rents_cudnn or not differentiable
    return (
        policy.pcp_varlen,
        policy.varlen_limit("forward", d_qk, d_v),
        policy.varlen_limit("backward", d_qk, d_v),
        float(policy.cudnn_build_s) if rents else 0.0,
        int(policy.causal_pairs_min_rows),
        bool(policy.overlap_gradient_sums),
        policy.pcp_masked,
    )


@functools.lru_cache(maxsize=64)
def policy_from_args(
    varlen: str,
    forward_limit: float | None,
    backward_limit: float | None,
    cudnn_build_s: float,
    causal_pairs_min_rows: int,
    overlap_gradient_sums: bool,
    masked: str = "auto",
) -> CPPolicy:
    """The :class:`CPPolicy` of an op call's :func:`pcp_policy_args` (its limits hold for the
    call's head dims, padded or not)."""
    limits = {}
    for direction, limit in (("forward", forward_limit), ("backward", backward_limit)):
        if limit is not None:
            limits[direction] = limits[direction + "_padded"] = limit
    return CPPolicy(
        pcp_varlen=varlen,
        pcp_masked=masked,
        overlap_gradient_sums=overlap_gradient_sums,
        causal_pairs_min_rows=causal_pairs_min_rows,
        cudnn_build_s=cudnn_build_s,
        varlen_max_flop_per_segment=limits,
    )


def _contiguous_inputs(inputs: PrefillInputs) -> tuple[PrefillInputs, list[int] | None]:
    # The inputs with contiguous tensors, and the prefix offsets as host ints (None without).
    q, k, v, _, prefix_k, prefix_v, prefix_cu_seqlens, _ = inputs
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    prefix_cu = None
    if prefix_k is not None and prefix_cu_seqlens is not None:
        assert prefix_v is not None, "prefix_k and prefix_v come together"
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
        prefix_cu = prefix_cu_seqlens.tolist()  # ok: host (CPU tensor)
    inputs = inputs._replace(q=q, k=k, v=v, prefix_k=prefix_k, prefix_v=prefix_v)
    return inputs, prefix_cu


def pcp_prefill_attention_cuda(
    inputs: PrefillInputs,
    *,
    policy: CPPolicy = DEFAULT_POLICY,
    block_forward: BlockForward = attention_block_forward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries on the path ``policy`` chooses (the CUDA
    implementation of ``cp::pcp_prefill_attention``; on CPU its kernels are the reference's).

    Args:
        inputs: the queries, keys, values, host segments, prefixes and scale
            (:class:`~cp_modules.reference.pcp_attention.PrefillInputs`).
        policy: the path choice (:func:`choose_varlen`).
        block_forward: the blocks' per-block kernel.

    Returns:
        out [T, Hq, Dv] in q's dtype (0 on padding rows), lse [T, Hq] fp32 (-inf on padding).
    """
    segments = inputs.segments
    segs = host_segments(segments)
    inputs, prefix_cu = _contiguous_inputs(inputs)
    q, k, v = inputs.q, inputs.k, inputs.v
    if choose_varlen(policy, "forward", segments, segs, q, k, v, prefix_cu):
        pack = plan_state(segments).varlen_pack(segments, q.device, prefix_cu, q.shape[0])
        return pcp_prefill_attention_varlen(inputs, pack=pack)
    return pcp_blocks_forward(inputs, block_forward=block_forward, segs=segs)


def pcp_prefill_attention_backward_cuda(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: PrefillInputs,
    *,
    policy: CPPolicy = DEFAULT_POLICY,
    block_backward: BlockBackward = attention_block_backward,
    dk_into: list[tuple[int, torch.Tensor]] | None = None,
    dv_into: list[tuple[int, torch.Tensor]] | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]:
    """Gradients of :func:`pcp_prefill_attention_cuda` on the path ``policy`` chooses.

    ``dout``: [T, Hq, Dv] gradient of the output; ``out``, ``lse``: the forward's results;
    ``inputs``: as in the forward.
    ``dk_into`` / ``dv_into``: targets tiling the N rows of dK / dV
    (:func:`~cp_modules.kernels.prefill.grad_assembly.sum_pieces_into`) that receive the gradient
    instead of a fresh tensor; that result is then None.

    Returns:
        dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k, dprefix_v (None
        without a prefix), each in its input's dtype.
    """
    segments = inputs.segments
    segs = host_segments(segments)
    contiguous, prefix_cu = _contiguous_inputs(inputs)
    q, k, v = contiguous.q, contiguous.k, contiguous.v
    if choose_varlen(policy, "backward", segments, segs, q, k, v, prefix_cu):
        pack = plan_state(segments).varlen_pack(segments, q.device, prefix_cu, q.shape[0])
        dq, dk, dv, *dprefix = pcp_prefill_attention_varlen_backward(
            dout.contiguous(), out.contiguous(), lse.contiguous(), contiguous, pack=pack
        )
        dpk, dpv = dprefix if dprefix else (None, None)
        if dk_into is not None:
            assert dv_into is not None, "dk_into and dv_into come together"
            sum_pieces_into(dk_into, [(0, dk)])
            sum_pieces_into(dv_into, [(0, dv)])
            return dq, None, None, dpk, dpv
        return dq, dk, dv, dpk, dpv
    return pcp_blocks_backward(
        dout, out, lse, contiguous,
        block_backward=block_backward,
        causal_pairs_min_rows=policy.causal_pairs_min_rows,
        overlap_gradient_sums=policy.overlap_gradient_sums,
        dk_into=dk_into, dv_into=dv_into, segs=segs,
    )  # fmt: skip
