"""PCP head/tail prefill attention with a sliding window or a logit soft-cap, in one packed call.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens,
C = cached-prefix tokens, Tq = packed queries (the segments' real queries), Tk = packed keys,
Hq / Hkv = query / KV heads, Dqk / Dv = head dims, S = segments
(``cp_modules.partition.plan.SEGMENT_FIELDS``).

Packing (:mod:`cp_modules.kernels.masked.pack`): every segment (a request's head or tail
chunk on this rank) is one sequence of queries against its request's cached prefix and new
keys, in one call for all segments (no LSE merge); the FlashAttention-2 kernel takes the
``"varlen"`` layout, FlexAttention either (its forward and backward paths build ``"runs"``).

Two kernels:

* ``flash`` (:mod:`cp_modules.kernels.masked.flash`): FlashAttention-2's varlen entry with ``window_size_left = W - 1`` and
  ``window_size_right = 0`` (bottom-right causal for varlen sequences): one call forward and
  one backward, which takes the given output and LSE. fp16 / bf16, Dqk == Dv <= 256, windows
  without soft-cap. On CPU its twin is the reference, sequence by sequence (for tests: only
  the kernel call itself differs).
* ``flex``: FlexAttention with a document mask (``mask_mod``: each query's run of packed keys,
  causal and inside the window) and the soft-cap as ``score_mod``; compiled on CUDA
  (one compiled function, dynamic shapes), eager on CPU. Its backward on CUDA is
  FlexAttention's own backward kernel from the given output and LSE, one kernel and no
  recompute (:mod:`cp_modules.kernels.masked.flex_backward`), over rows whose long key runs are
  cut in pieces where the longest query blocks would end a short kernel alone
  (:func:`~cp_modules.kernels.masked.pack.row_split`). On CPU (FlexAttention has no
  backward there), and where torch lacks what that call needs, it recomputes the forward
  under autograd: on CPU a dense twin that evaluates the same ``mask_mod`` and ``score_mod``
  on the whole score grid.

Backward contract (as every PCP path): the gradients of the attention whose *given* output
and LSE are the final ones, e.g. with attention sinks applied after the merge
(``out = sigma * O``, ``sigma = exp(L - lse)``, L the forward's own LSE). The flash and flex
backward kernels take them as they are (probabilities ``exp(s - lse)``, ``delta =
rowsum(dout * out)``); the recompute gives exactly the same
(:func:`~cp_modules.kernels.masked.flex_backward.recomputed_grads`).
"""

from __future__ import annotations

import functools
import warnings

import torch

from cp_modules.kernels.masked.flash import (
    flash_window_backward,
    flash_window_backward_twin,
    flash_window_forward,
    flash_window_forward_twin,
)
from cp_modules.kernels.masked.flex_backward import (
    flex_attention_backward_call,
    flex_backward_supported,
    key_run_mask,
    recomputed_grads,
)
from cp_modules.kernels.masked.pack import (
    PACK_LAYOUTS,
    SPARSE_BLOCK,
    MaskedPack,
    RowSplit,
    flex_block_tables,
    masked_pack,
    row_split,
)
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    lse_dtype,
)

__all__ = [
    "MASKED_KERNELS",
    "PACK_LAYOUTS",
    "SPARSE_BLOCK",
    "MaskedPack",
    "dense_twin_attention",
    "flash_window_backward",
    "flash_window_forward",
    "flex_attention_call",
    "FLEX_RECOMPILE_LIMIT",
    "flex_backward",
    "flex_block_tables",
    "flex_compile_config",
    "block_options_for",
    "flex_block_options",
    "flex_divisible",
    "flex_lse_kwargs",
    "masked_pack",
    "masked_prefill_backward",
    "masked_prefill_forward",
    "softcap_score_mod",
]

MASKED_KERNELS = ("flash", "flex")


@functools.lru_cache(maxsize=64)
def softcap_score_mod(softcap: float | None):
    """FlexAttention ``score_mod`` of a soft-cap c (``c * tanh(score / c)``), None for none;
    one function object per value (compiled code is reused for it)."""
    if not softcap:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _flex_entry(q, k, v, score_mod, block_mask, scale, enable_gqa, kwargs):
    # The compiled frame (its own code object: its compiled variants are counted apart from
    # other compilations of FlexAttention, e.g. a user's own).
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
        **kwargs,
    )  # fmt: skip


@functools.cache
def _compiled_flex(backend: str = "inductor"):
    # One compiled FlexAttention for every call: dynamic shapes, so that a new batch
    # composition (new packed lengths) does not compile anew.
    return torch.compile(_flex_entry, dynamic=True, backend=backend)


# Compiled variants of the entry: grad mode x soft-cap value x window or not x shape
# specialisations. Past dynamo's recompile limit a frame would run eagerly, and eager
# FlexAttention evaluates the whole score grid (tens of GiB at long sequences): the limit is
# raised for this frame and hitting it is an error, never a silent eager run.
FLEX_RECOMPILE_LIMIT = 64


def flex_compile_config():
    """The dynamo settings of the compiled FlexAttention calls (a ``config.patch`` context):
    the soft-cap a constant (with dynamic shapes a float would be traced as a symbolic
    scalar, which the FlexAttention lowering cannot take), :data:`FLEX_RECOMPILE_LIMIT`
    compiled variants, and an error rather than an eager fallback past it."""
    cfg = torch._dynamo.config
    settings: dict = {"specialize_float": True}
    if hasattr(cfg, "recompile_limit"):
        settings["recompile_limit"] = max(cfg.recompile_limit, FLEX_RECOMPILE_LIMIT)
    else:  # older name
        settings["cache_size_limit"] = max(cfg.cache_size_limit, FLEX_RECOMPILE_LIMIT)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        settings["fail_on_recompile_limit_hit"] = True
    return cfg.patch(**settings)


def _block_mask(pack: MaskedPack | RowSplit, device: torch.device):
    key = str(device)
    mask = pack.flex_cache.get(key)
    if mask is None:
        from torch.nn.attention.flex_attention import BlockMask

        tables = [torch.from_numpy(x).to(device) for x in flex_block_tables(pack)]
        num, idx, full_num, full_idx = (t[None, None] for t in tables)  # [1, 1, ...]
        mask = pack.flex_cache[key] = BlockMask.from_kv_blocks(
            kv_num_blocks=num, kv_indices=idx, full_kv_num_blocks=full_num,
            full_kv_indices=full_idx, BLOCK_SIZE=SPARSE_BLOCK, mask_mod=pack.mask_mod(),
            seq_lengths=(pack.num_queries, pack.cu_k_host[-1]),
        )  # fmt: skip
    return mask


def flex_divisible(num_queries: int, num_keys: int) -> bool:
    """Whether FlexAttention's kernels may skip their bounds checks (``IS_DIVISIBLE``): both
    lengths are multiples of 128 (every block size its kernels pick divides 128). Its lowering
    proves this only for static lengths; the library compiles with dynamic lengths (one
    compiled function for every packing), where the proof fails and every block's loads are
    bounds-checked, so the library states it from the actual lengths (one more compiled
    variant)."""
    return num_queries % 128 == 0 and num_keys % 128 == 0


# FlexAttention's block sizes for soft-capped attention on sm_90 at head dim 128, 16-bit, in
# its option names (``fwd_`` / ``bwd_`` prefixes: forward / backward kernel). Measured on the
# H200 (torch 2.11, triton 3.6; S = 32k, 32 heads, c = 50, docs/experiments/
# 2026-12-01-masked-prefill-speed.md): torch's defaults there (forward 128 x 64, 8 warps;
# backward 64 / 128 / 128 / 64, 8 warps) took 42.5 ms forward and 151.7 ms forward + backward
# over the whole sequence, these 40.4 and 144.6 ms; one rank of eight (4k queries, 32k keys)
# 21.4 ms forward + backward with the defaults, 19.8 ms with this backward. Without the
# soft-cap the defaults were as fast or faster, and other block sizes measured slower.
SOFTCAP_SM90_BLOCKS = {
    "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 3, "bwd_num_warps": 4,
}  # fmt: skip


def flex_block_options(q: torch.Tensor, softcap: float | None) -> dict:
    """FlexAttention kernel options of block sizes for the packed queries ``q`` [Tq, Hq, D]
    (:func:`block_options_for` on its device; none on CPU)."""
    if not q.is_cuda:
        return {}
    capability = torch.cuda.get_device_capability(q.device)
    return block_options_for(softcap, q.shape[0], q.shape[-1], q.dtype, capability)


def block_options_for(
    softcap: float | None, num_queries: int, head_dim: int, dtype: torch.dtype, capability
) -> dict:
    """The measured :data:`SOFTCAP_SM90_BLOCKS` for a soft-cap on sm_90 (``capability``
    (9, 0)), head dim 128, fp16 / bf16; else none (torch's defaults). Below 128 queries
    FlexAttention's forward is its decoding kernel, which would take ``fwd_BLOCK_M`` as its
    own query block (sized there for the query count and GQA group): the forward's keys are
    left out. A compiled variant never meets calls of another choice: the soft-cap's score
    graph, head dim, dtype and device are guarded, and so is the query count against 128 (the
    lowering's choice of kernel)."""
    if softcap is None or head_dim != 128 or tuple(capability) != (9, 0):
        return {}
    if dtype not in (torch.float16, torch.bfloat16):
        return {}
    if num_queries < 128:
        return {k: v for k, v in SOFTCAP_SM90_BLOCKS.items() if not k.startswith("fwd_")}
    return dict(SOFTCAP_SM90_BLOCKS)


def flex_lse_kwargs() -> dict:
    """FlexAttention's keyword arguments that return the LSE: ``return_aux`` where it exists
    (``return_lse`` is deprecated there), else ``return_lse``."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        return {"return_aux": fa.AuxRequest(lse=True)}
    return {"return_lse": True}


def flex_attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pack: MaskedPack,
    *,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention of the packed rows: out [Tq, Hq, Dv] in q's dtype, lse [Tq, Hq]
    (natural log: FlexAttention returns it so whatever base its kernel computes in).
    ``q`` [Tq, Hq, Dqk], ``k`` [Tk, Hkv, Dqk], ``v`` [Tk, Hkv, Dv]. Compiled on CUDA, eager
    on CPU (forward only there)."""
    fn = _compiled_flex() if q.is_cuda else _flex_entry
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    kwargs = flex_lse_kwargs()
    if q.is_cuda:
        # Stated either way: dynamo guards the keys a compiled variant saw, so a flag that is
        # only present when true would let a later divisible call reuse a ragged variant.
        kwargs["kernel_options"] = {
            "IS_DIVISIBLE": flex_divisible(q.shape[0], k.shape[0]),
            **flex_block_options(q, softcap),
        }
    with warnings.catch_warnings(), flex_compile_config():
        # The eager (CPU) path warns that it is unfused: it is the CPU twin by design.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        res = fn(
            q4, k4, v4, softcap_score_mod(softcap), _block_mask(pack, q.device), scale,
            q.shape[1] != k.shape[1], kwargs,
        )  # fmt: skip
    out, aux = res
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def flex_backward(dout, q, k, v, out, lse, pack: MaskedPack, *, scale, softcap, backend="inductor",
                  split: RowSplit | None = None):  # fmt: skip
    """Gradients (dq, dk, dv) of :func:`flex_attention_call` from its final ``out`` / ``lse``
    (natural log) by FlexAttention's backward kernel alone
    (:func:`~cp_modules.kernels.masked.flex_backward.flex_attention_backward_call`; ``backend=None``:
    the operator's eager dense implementation). ``split``: the pack's rows with long key runs
    cut in pieces (:func:`~cp_modules.kernels.masked.pack.row_split`); each piece's dq is
    added to its row's in fp32."""
    assert pack.q_lo is not None and pack.q_hi is not None, "a pack's key runs are set"
    rows: MaskedPack | RowSplit = pack
    runs = (pack.q_lo, pack.q_hi)
    if split is not None:
        rows, runs = split, (split.q_lo, split.q_hi)
        dout, q, out, lse = (x.index_select(0, split.src) for x in (dout, q, out, lse))
    with flex_compile_config():
        dq, dk, dv = flex_attention_backward_call(
            dout, q, k, v, out, lse, block_mask=_block_mask(rows, q.device),
            mask_mod=key_run_mask, mask_buffers=runs, scale=scale,
            score_mod=softcap_score_mod(softcap), backend=backend,
            divisible=backend is not None and flex_divisible(q.shape[0], k.shape[0]),
            block_options=flex_block_options(q, softcap) if backend is not None else None,
        )  # fmt: skip
    if split is not None:
        pieces = dq.index_select(0, split.extra_pos).to(lse_dtype(dq.dtype))
        dq = dq[: pack.num_queries].to(pieces.dtype).index_add_(0, split.extra_dst, pieces)
        dq = dq.to(q.dtype)
    return dq, dk, dv


def dense_twin_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pack: MaskedPack,
    *,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`flex_attention_call` computes, densely and differentiably: the pack's
    ``mask_mod`` and the soft-cap ``score_mod`` evaluated on the whole [Hq, Tq, Tk] grid (at
    least fp32). FlexAttention's backward on CPU, and its test twin."""
    acc = lse_dtype(q.dtype)
    hq = q.shape[1]
    kk = k.to(acc).repeat_interleave(hq // k.shape[1], dim=1)
    vv = v.to(acc).repeat_interleave(hq // v.shape[1], dim=1)
    s = torch.einsum("lhd,mhd->hlm", q.to(acc), kk) * scale
    h = torch.arange(hq, device=q.device)[:, None, None]
    qi = torch.arange(q.shape[0], device=q.device)[None, :, None]
    ki = torch.arange(k.shape[0], device=q.device)[None, None, :]
    score_mod = softcap_score_mod(softcap)
    if score_mod is not None:
        s = score_mod(s, 0, h, qi, ki)
    s = s.masked_fill(~pack.mask_mod()(0, h, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hlm,mhd->lhd", torch.exp(s - lse[..., None]), vv)
    return out.to(q.dtype), lse.transpose(0, 1)


# --------------------------------------------------------------------------- PCP attention


def _prefix(inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    # The cached prefix's keys and values, or None (without them or their offsets).
    if inputs.prefix_k is None or inputs.prefix_v is None or inputs.prefix_cu_seqlens is None:
        return None
    return inputs.prefix_k, inputs.prefix_v


def _packed_inputs(inputs: PrefillInputs, pack: MaskedPack):
    # Slices where the packed rows are a run of the inputs (no copy), else gathers.
    q, k, v = inputs.q, inputs.k, inputs.v
    qp = q[slice(*pack.q_range)] if pack.q_range else q.index_select(0, pack.q_index)
    if pack.k_range and pack.k_range[1] <= k.shape[0]:  # new keys only: no prefix rows
        rows = slice(*pack.k_range)
        return qp, k[rows], v[rows]
    prefix = _prefix(inputs)
    if prefix is not None:
        k, v = torch.cat((k, prefix[0])), torch.cat((v, prefix[1]))
    return qp, k.index_select(0, pack.k_index), v.index_select(0, pack.k_index)


def _covers(run: tuple[int, int] | None, n: int) -> bool:
    # Whether the packed rows are exactly rows 0 .. n - 1.
    return run == (0, n)


def _check_kernel(kernel: str, pack: MaskedPack, softcap: float | None) -> None:
    assert kernel in MASKED_KERNELS, kernel
    assert kernel == "flex" or (pack.window is not None and not softcap), (
        "the FlashAttention-2 kernel serves windows without soft-cap"
    )
    assert kernel == "flex" or pack.layout == "varlen", "FlashAttention-2 takes varlen packs"


def masked_prefill_forward(
    inputs: PrefillInputs,
    pack: MaskedPack,
    *,
    kernel: str,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries with the pack's window and ``softcap``, on
    ``kernel`` (:data:`MASKED_KERNELS`; CPU runs its twin). Same contract as
    :func:`~cp_modules.reference.pcp_attention.pcp_prefill_attention_reference`: out
    [T, Hq, Dv] in q's dtype (0 on padding rows), lse [T, Hq] in ``lse_dtype(q.dtype)``
    (-inf there)."""
    _check_kernel(kernel, pack, softcap)
    q, v, scale = inputs.q, inputs.v, inputs.scale
    if pack.num_queries == 0:  # padding rows only
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        return out, q.new_full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype))
    qp, kp, vp = (x.detach() for x in _packed_inputs(inputs, pack))  # slices may be views
    if kernel == "flash":
        fwd = flash_window_forward if q.is_cuda else flash_window_forward_twin
        op, lsep = fwd(qp, kp, vp, pack, scale)
    else:
        with torch.no_grad():
            op, lsep = flex_attention_call(qp, kp, vp, pack, scale=scale, softcap=softcap)
    if _covers(pack.q_range, q.shape[0]):  # every local row packed, in order
        return op.to(q.dtype).contiguous(), lsep.to(lse_dtype(q.dtype)).contiguous()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype))
    out.index_copy_(0, pack.q_index, op.to(out.dtype))
    lse.index_copy_(0, pack.q_index, lsep.to(lse.dtype))
    return out, lse


def masked_prefill_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: PrefillInputs,
    pack: MaskedPack,
    *,
    kernel: str,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`masked_prefill_forward` from the final ``out`` / ``lse`` (module
    docstring): dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k [C, Hkv, Dqk],
    dprefix_v [C, Hkv, Dv] (None without a prefix), each in its input's dtype. A key row's
    contributions (a request's head and tail sequences) are summed at least in fp32."""
    _check_kernel(kernel, pack, softcap)
    q, k, v, scale = inputs.q, inputs.k, inputs.v, inputs.scale
    prefix = _prefix(inputs)
    n = k.shape[0]
    num_src = n + (0 if prefix is None else prefix[0].shape[0])
    if not pack.num_queries:
        gq = gk = gv = None
    else:
        qp, kp, vp = _packed_inputs(inputs, pack)
        if pack.q_range:
            dop, op, lsep = (x[slice(*pack.q_range)] for x in (dout, out, lse))
        else:
            dop, op, lsep = (x.index_select(0, pack.q_index) for x in (dout, out, lse))
        if kernel == "flash":
            bwd = flash_window_backward if q.is_cuda else flash_window_backward_twin
            gq, gk, gv = bwd(dop.contiguous(), qp, kp, vp, op, lsep, pack, scale)
        elif q.is_cuda and flex_backward_supported():
            gq, gk, gv = flex_backward(dop, qp, kp, vp, op, lsep, pack, scale=scale,
                                       softcap=softcap, split=row_split(pack, q.device))  # fmt: skip
        else:
            call = flex_attention_call if q.is_cuda else dense_twin_attention
            attend = functools.partial(call, pack=pack, scale=scale, softcap=softcap)
            gq, gk, gv = recomputed_grads(attend, dop, qp, kp, vp, op, lsep)
    if gq is not None and _covers(pack.q_range, q.shape[0]):
        dq = gq.to(q.dtype).contiguous()
    else:
        dq = torch.zeros_like(q)
        if gq is not None:
            dq.index_copy_(0, pack.q_index, gq.to(q.dtype))
    if gk is not None and gv is not None and prefix is None and _covers(pack.k_range, n):
        # Every new key packed once, in order: its gradient as the kernel gives it.
        return dq, gk.to(k.dtype).contiguous(), gv.to(v.dtype).contiguous(), None, None
    # One contribution per key row: sums in the inputs' dtype; else at least fp32.
    acc = k.dtype if pack.k_unique else lse_dtype(q.dtype)
    dk_src = k.new_zeros((num_src, *k.shape[1:]), dtype=acc)
    dv_src = v.new_zeros((num_src, *v.shape[1:]), dtype=acc)
    if gk is not None and gv is not None:
        put = torch.Tensor.index_copy_ if pack.k_unique else torch.Tensor.index_add_
        put(dk_src, 0, pack.k_index, gk.to(acc))
        put(dv_src, 0, pack.k_index, gv.to(acc))
    dk, dv = dk_src[:n].to(k.dtype), dv_src[:n].to(v.dtype)
    if prefix is None:
        return dq, dk, dv, None, None
    return dq, dk, dv, dk_src[n:].to(prefix[0].dtype), dv_src[n:].to(prefix[1].dtype)
