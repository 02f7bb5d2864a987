"""``cp::pcp_prefill_attention``: PCP head/tail prefill attention as one differentiable op.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens of the
batch, C = cached-prefix tokens, R = requests, S = segments (2R), Hq / Hkv = query / KV heads,
Dqk / Dv = head dims.

The per-request metadata travels as tensors (the plan's host copy of its segments), so a new
batch composition changes only tensor sizes and a compiled caller does not recompile; the loop
over requests lives inside the op. Autograd is registered on the op: its backward is a second
op (``cp::pcp_prefill_attention_backward``) that recomputes block probabilities from the saved
merged output and LSE. CPU runs the pure-PyTorch reference (or, with a policy of
``pcp_varlen="always"``, the varlen packing on reference kernels); CUDA runs the block
decomposition on PyTorch's fused attention kernels, or one varlen call for batches of small
segments, as :mod:`cp_modules.ops.pcp_policy` chooses. With a sliding window or a logit
soft-cap, :mod:`cp_modules.ops.pcp_masked` chooses instead: on CUDA FlashAttention-2's window
arguments or FlexAttention (one packed call per step), on CPU the reference (or, with a policy
of ``pcp_masked="flash"`` / ``"flex"``, those paths' packing on their CPU twins). The path
policy travels in the schemas as scalars (:func:`~cp_modules.ops.pcp_policy.pcp_policy_args`):
nothing is read from the environment.
"""

from __future__ import annotations

import torch

from cp_modules.ops._lib import lib
from cp_modules.ops.pcp_masked import (
    choose_masked_path,
    pcp_masked_attention,
    pcp_masked_attention_backward,
)
from cp_modules.ops.pcp_policy import (
    pcp_policy_args,
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
    policy_from_args,
)
from cp_modules.partition.plan import PCPPlan
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    lse_dtype,
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)

__all__ = ["pcp_prefill_attention"]

_DEFAULT_POLICY = CPPolicy()

# The policy's scalars (pcp_policy_args), the same in both schemas.
_POLICY_ARGS = (
    "str varlen, float? varlen_max_flop_forward, float? varlen_max_flop_backward, "
    "float cudnn_build_s, int causal_pairs_min_rows, bool overlap_gradient_sums, str masked"
)
lib.define(
    "pcp_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor segments, Tensor? prefix_k, "
    f"Tensor? prefix_v, Tensor? prefix_cu_seqlens, float scale, {_POLICY_ARGS}, "
    "int window=0, float softcap=0.0) -> (Tensor, Tensor)"
)
lib.define(
    "pcp_prefill_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor lse, Tensor segments, Tensor? prefix_k, Tensor? prefix_v, "
    f"Tensor? prefix_cu_seqlens, float scale, {_POLICY_ARGS}, "
    "int window=0, float softcap=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


_NUM_POLICY_ARGS = 7


def _split_policy(policy_args: tuple) -> tuple[tuple, int, float]:
    # The policy's scalars, then window and softcap (schema defaults: 0, 0.0). A window
    # (W > 0) or a soft-cap (c > 0) sends the call to the masked paths.
    n = _NUM_POLICY_ARGS
    extra = policy_args[n:] + (0, 0.0)[len(policy_args) - n :]
    return policy_args[:n], int(extra[0]), float(extra[1])


@torch.library.impl("cp::pcp_prefill_attention", "CPU", lib=lib)
def _forward_cpu(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args):
    inputs = PrefillInputs(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale)
    policy_args, window, softcap = _split_policy(policy_args)
    if window or softcap:
        return pcp_masked_attention(
            inputs, window=window or None, softcap=softcap or None,
            policy=policy_from_args(*policy_args),
        )  # fmt: skip
    if policy_args[0] == "always":
        # The varlen packing on the reference kernels.
        return pcp_prefill_attention_cuda(inputs, policy=policy_from_args(*policy_args))
    return pcp_prefill_attention_reference(inputs)


@torch.library.impl("cp::pcp_prefill_attention", "CUDA", lib=lib)
def _forward_cuda(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args):
    inputs = PrefillInputs(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale)
    policy_args, window, softcap = _split_policy(policy_args)
    policy = policy_from_args(*policy_args)
    if window or softcap:
        return pcp_masked_attention(
            inputs, window=window or None, softcap=softcap or None, policy=policy
        )
    return pcp_prefill_attention_cuda(inputs, policy=policy)


@torch.library.register_fake("cp::pcp_prefill_attention", lib=lib)
def _forward_fake(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=lse_dtype(q.dtype))
    return out, lse


def _no_prefix_grad(x: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    # The schema has a fixed arity: a missing prefix gets an empty gradient placeholder.
    return like if like is not None else x.new_empty((0,))


@torch.library.impl("cp::pcp_prefill_attention_backward", "CPU", lib=lib)
def _backward_cpu(
    dout, q, k, v, out, lse, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args
):
    inputs = PrefillInputs(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale)
    args = (dout, out, lse, inputs)
    policy_args, window, softcap = _split_policy(policy_args)
    if window or softcap:
        grads = pcp_masked_attention_backward(
            *args, window=window or None, softcap=softcap or None,
            policy=policy_from_args(*policy_args),
        )  # fmt: skip
    elif policy_args[0] == "always":
        # The varlen packing on the reference kernels.
        grads = pcp_prefill_attention_backward_cuda(*args, policy=policy_from_args(*policy_args))
    else:
        grads = pcp_prefill_attention_backward_reference(*args)
    dq, dk, dv, dpk, dpv = grads
    return dq, dk, dv, _no_prefix_grad(k, dpk), _no_prefix_grad(v, dpv)


@torch.library.impl("cp::pcp_prefill_attention_backward", "CUDA", lib=lib)
def _backward_cuda(
    dout, q, k, v, out, lse, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args
):
    policy_args, window, softcap = _split_policy(policy_args)
    policy = policy_from_args(*policy_args)
    inputs = PrefillInputs(q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale)
    if window or softcap:
        dq, dk, dv, dpk, dpv = pcp_masked_attention_backward(
            dout, out, lse, inputs, window=window or None, softcap=softcap or None,
            policy=policy,
        )  # fmt: skip
    else:
        dq, dk, dv, dpk, dpv = pcp_prefill_attention_backward_cuda(
            dout, out, lse, inputs, policy=policy
        )
    return dq, dk, dv, _no_prefix_grad(k, dpk), _no_prefix_grad(v, dpv)


@torch.library.register_fake("cp::pcp_prefill_attention_backward", lib=lib)
def _backward_fake(
    dout, q, k, v, out, lse, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args
):
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        torch.empty_like(prefix_k) if has_prefix else k.new_empty((0,)),
        torch.empty_like(prefix_v) if has_prefix else v.new_empty((0,)),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale, *policy_args = inputs
    out, lse = output
    ctx.scale = scale
    ctx.policy_args = tuple(policy_args)
    ctx.has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    # The LSE is an output for merging and inspection; what training needs from it (the cached
    # prefix merge) happens inside the op, so no gradient flows back through it.
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, segments, prefix_k, prefix_v, prefix_cu_seqlens)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, segments, prefix_k, prefix_v, prefix_cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dpk, dpv = torch.ops.cp.pcp_prefill_attention_backward(
        dout, q, k, v, out, lse, segments, prefix_k, prefix_v, prefix_cu_seqlens, ctx.scale,
        *ctx.policy_args,
    )  # fmt: skip
    if not ctx.has_prefix:
        dpk = dpv = None
    return dq, dk, dv, None, dpk, dpv, None, None, *(None,) * len(ctx.policy_args)


torch.library.register_autograd(
    "cp::pcp_prefill_attention", _backward, setup_context=_setup_context, lib=lib
)


def pcp_prefill_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    plan: PCPPlan,
    *,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_cu_seqlens: torch.Tensor | None = None,
    policy: CPPolicy | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    differentiable: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's DualChunkSwap queries over the gathered K/V, with LSE.

    Each request's head and tail queries attend its new keys up to their own position (bottom
    right aligned) and, if given, its whole cached prefix; the two are merged exactly by LSE.
    Equal to dense causal attention of every request over (prefix + new tokens), restricted
    to this rank's queries. Differentiable w.r.t. q, k_full, v_full, prefix_k and prefix_v; the
    returned LSE carries no gradient.

    Args:
        q: [T, Hq, Dqk] local queries in ``plan.token_indices`` order.
        k_full: [N, Hkv, Dqk] and v_full: [N, Hkv, Dv] the restored, unpadded K/V of all new
            tokens (``pcp_gather_restore``); Hq must be a multiple of Hkv. Same dtype as q.
        plan: this rank's :class:`~cp_modules.partition.PCPPlan`.
        scale: softmax scale (usually ``Dqk ** -0.5``).
        prefix_k: [C, Hkv, Dqk] and prefix_v: [C, Hkv, Dv] cached keys/values of the requests,
            concatenated request by request (gathered from the KV cache by the caller).
        prefix_cu_seqlens: [R + 1] int cumulative prefix lengths. Defaults to the plan's
            (each request's whole context, ``cumsum(num_computed_tokens)``). A CPU tensor
            avoids a device sync.
        policy: the path choices and thresholds (:class:`~cp_modules.policy.CPPolicy`; default
            ``CPPolicy()``); usually the step's ``runtime.policy``. They change speed only.
        sliding_window: W >= 1: each query attends only its W latest keys (itself included,
            the cached prefix counted), or None.
        softcap: c > 0: scores become ``c * tanh(scores / c)`` before masking, or None.
            Either one takes the masked paths (:mod:`cp_modules.ops.pcp_masked`, chosen by
            ``policy.pcp_masked``).
        differentiable: whether autograd will differentiate the result (training), which
            changes the path choice only (:func:`~cp_modules.ops.pcp_policy.pcp_policy_args`:
            such a forward runs on cuDNN at once); None: whether grad mode is on and an input
            requires grad (callers inside an op, where grad mode is off, pass it).

    Returns:
        out [T, Hq, Dv] in q's dtype and lse [T, Hq] fp32 (fp64 for fp64 inputs; natural log);
        padding rows hold 0 and ``-inf``.

    Raises:
        ValueError: for shapes, dtypes or prefix arguments that do not fit the plan, a window
            < 1, a soft-cap <= 0, or a masked path that ``policy`` forces and that does not
            serve the call.
    """
    if q.dim() != 3 or k_full.dim() != 3 or v_full.dim() != 3:
        raise ValueError(
            f"q, k_full and v_full must be 3-D [tokens, heads, dim], got shapes "
            f"{tuple(q.shape)}, {tuple(k_full.shape)}, {tuple(v_full.shape)}"
        )
    if q.shape[0] != plan.token_indices.shape[0]:
        raise ValueError(
            f"q must hold the plan's {plan.token_indices.shape[0]} local tokens, got {q.shape[0]}"
        )
    if k_full.shape[0] != plan.gather_index.shape[0] or v_full.shape[0] != k_full.shape[0]:
        raise ValueError(
            f"k_full and v_full must hold the plan's {plan.gather_index.shape[0]} restored "
            f"tokens, got {k_full.shape[0]} and {v_full.shape[0]}"
        )
    if k_full.shape[1] != v_full.shape[1] or q.shape[1] % k_full.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of the KV heads, and k_full and "
            f"v_full must have equal head counts; got {k_full.shape[1]} and {v_full.shape[1]}"
        )
    if q.shape[2] != k_full.shape[2]:
        raise ValueError(
            f"q and k_full head dims must match, got {q.shape[2]} and {k_full.shape[2]}"
        )
    if not q.dtype == k_full.dtype == v_full.dtype:
        raise ValueError(
            f"q, k_full and v_full must share a dtype, got {q.dtype}, {k_full.dtype}, {v_full.dtype}"
        )
    if (prefix_k is None) != (prefix_v is None):
        raise ValueError("prefix_k and prefix_v must be given together")
    if prefix_k is None and prefix_cu_seqlens is not None:
        raise ValueError("prefix_cu_seqlens needs prefix_k and prefix_v")
    if prefix_k is not None:
        assert prefix_v is not None
        if prefix_k.dim() != 3 or prefix_k.shape[1:] != k_full.shape[1:]:
            raise ValueError(
                f"prefix_k must be [C, {k_full.shape[1]}, {k_full.shape[2]}] like k_full, got "
                f"{tuple(prefix_k.shape)}"
            )
        if (
            prefix_v.dim() != 3
            or prefix_v.shape[1:] != v_full.shape[1:]
            or (prefix_v.shape[0] != prefix_k.shape[0])
        ):
            raise ValueError(
                f"prefix_v must be [{prefix_k.shape[0]}, {v_full.shape[1]}, {v_full.shape[2]}], "
                f"got {tuple(prefix_v.shape)}"
            )
        if prefix_k.dtype != q.dtype or prefix_v.dtype != q.dtype:
            raise ValueError(f"prefix_k and prefix_v must have q's dtype {q.dtype}")
        if prefix_cu_seqlens is None:
            prefix_cu_seqlens = plan.prefix_cu_seqlens_host
        elif prefix_cu_seqlens.shape != (plan.prefix_cu_seqlens_host.shape[0],):
            raise ValueError(
                f"prefix_cu_seqlens must have one entry per request plus one "
                f"({plan.prefix_cu_seqlens_host.shape[0]}), got shape {tuple(prefix_cu_seqlens.shape)}"
            )
        prefix_cu_seqlens = prefix_cu_seqlens.to("cpu", torch.int64)
        if not torch.compiler.is_compiling():
            # Reads host values: skipped while tracing, where it would be data-dependent.
            cu = prefix_cu_seqlens
            if cu[0] != 0 or cu[-1] != prefix_k.shape[0] or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(
                    f"prefix_cu_seqlens must rise from 0 to the {prefix_k.shape[0]} prefix "
                    f"tokens, got {cu.tolist()}"  # ok: host (error path, CPU tensor)
                )
    check_masking(sliding_window, softcap)
    policy = _DEFAULT_POLICY if policy is None else policy
    if differentiable is None:
        differentiable = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k_full, v_full, prefix_k, prefix_v)
        )
    if sliding_window or softcap:
        # The path choice's errors before any kernel runs.
        choose_masked_path(policy.pcp_masked, q, v_full, sliding_window, softcap)
    return torch.ops.cp.pcp_prefill_attention(
        q, k_full, v_full, plan.segments_host, prefix_k, prefix_v, prefix_cu_seqlens, scale,
        *pcp_policy_args(policy, q.shape[2], v_full.shape[2], differentiable=differentiable),
        int(sliding_window or 0), float(softcap or 0.0),
    )  # fmt: skip


def check_masking(sliding_window: int | None, softcap: float | None) -> None:
    """Validate a sliding window and a soft-cap (host values, before any collective).

    Raises:
        ValueError: for W < 1 or c <= 0.
    """
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"sliding_window must be an integer >= 1 (or None), got {sliding_window!r}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap!r}")
