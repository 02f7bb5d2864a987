"""PCP head/tail prefill attention with a sliding window or a logit soft-cap, in one packed call.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens,
C = cached-prefix tokens, Tq = packed queries (the segments' real queries), Tk = packed keys,
Hq / Hkv = query / KV heads, Dqk / Dv = head dims, S = segments
(``cp_modules.partition.plan.SEGMENT_FIELDS``).

Packing (:func:`masked_pack`): every segment (a request's head or tail chunk on this rank) is
one sequence of the call: its real queries against its request's cached prefix followed by
its new keys ``[k_start, k_start + k_len)``. Positions count from the request's first cached
token: key ``p`` of the sequence sits at ``p``, query ``i`` of ``q_len`` at
``prefix + k_len - q_len + i`` (bottom-right causal over prefix and new keys, as the
reference). A query at position ``t`` sees keys ``t - W < p <= t``, so with a window W no
query of the segment sees a key before ``prefix + k_len - q_len - W + 1``: the packing keeps
only the last ``q_len + W - 1`` keys of each sequence (dropping keys from the front keeps the
bottom-right alignment), and a rank's work grows with W, not with the sequence. Packed keys
are rows of ``[k; prefix_k]`` (the prefix rows after the N new ones), so one call covers the
cached prefix too and needs no LSE merge.

Two kernels over the same packing:

* ``flash`` (:mod:`cp_modules.kernels.masked_flash`): FlashAttention-2's varlen entry with ``window_size_left = W - 1`` and
  ``window_size_right = 0`` (bottom-right causal for varlen sequences): one call forward and
  one backward, which takes the given output and LSE. fp16 / bf16, Dqk == Dv <= 256, windows
  without soft-cap. On CPU its twin is the reference, sequence by sequence (for tests: only
  the kernel call itself differs).
* ``flex``: FlexAttention with a document mask (``mask_mod``: same sequence, causal, inside
  the window, by the positions above) and the soft-cap as ``score_mod``; compiled on CUDA
  (one compiled function, dynamic shapes), eager on CPU. Its backward on CUDA is
  FlexAttention's own backward kernel from the given output and LSE, one kernel and no
  recompute (:mod:`cp_modules.kernels.flex_backward`). On CPU (FlexAttention has no
  backward there), and where torch lacks what that call needs, it recomputes the forward
  under autograd: on CPU a dense twin that evaluates the same ``mask_mod`` and ``score_mod``
  on the whole score grid.

Backward contract (as every PCP path): the gradients of the attention whose *given* output
and LSE are the final ones, e.g. with attention sinks applied after the merge
(``out = sigma * O``, ``sigma = exp(L - lse)``, L the forward's own LSE). The flash and flex
backward kernels take them as they are (probabilities ``exp(s - lse)``, ``delta =
rowsum(dout * out)``); the recompute gives exactly the same
(:func:`~cp_modules.kernels.flex_backward.recomputed_grads`).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from cp_modules.kernels.flex_backward import (
    flex_attention_backward_call,
    flex_backward_supported,
    key_run_mask,
    recomputed_grads,
)
from cp_modules.kernels.masked_flash import (
    flash_window_backward,
    flash_window_backward_twin,
    flash_window_forward,
    flash_window_forward_twin,
)
from cp_modules.kernels.pcp_varlen import _cumsum0, _ragged, _to_device
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    lse_dtype,
)

__all__ = [
    "MASKED_KERNELS",
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
    "flex_lse_kwargs",
    "masked_pack",
    "masked_prefill_backward",
    "masked_prefill_forward",
    "softcap_score_mod",
]

MASKED_KERNELS = ("flash", "flex")


@dataclass(frozen=True, eq=False)
class MaskedPack:
    """The packed sequences of one plan for one window.

    Attributes:
        q_index: [Tq] int64, local query rows, sequence by sequence.
        k_index: [Tk] int64, rows of ``[k; prefix_k]`` (prefix rows from ``num_new`` on).
        cu_q, cu_k: [S + 1] int32 cumulative query / key counts (FlashAttention-2's varlen).
        cu_q_host, cu_k_host: the same as host lists.
        max_q, max_k: the longest sequence's query / key count.
        q_seq, q_pos, k_seq, k_pos: [Tq] / [Tk] int32, each packed row's sequence and its
            position in its request (the FlexAttention mask reads them).
        key_ranges_host: [Tq, 2] int64 numpy, the packed keys ``[lo, hi)`` each packed query
            sees (its sequence's keys inside its window, up to itself): the block sparsity of
            the FlexAttention mask.
        window: W, or None (full causal).
        num_new: N, the new-key rows before the prefix rows in ``[k; prefix_k]``.
        flex_cache: the pack's FlexAttention mask function and block masks, built on first use.
        q_lo, q_hi: [Tq] int32, the run of packed keys ``[lo, hi)`` each packed query sees
            (``key_ranges_host`` on the device: the FlexAttention mask reads them).
        q_range: ``(a, b)`` when ``q_index`` is the run ``a .. b - 1`` (the packed queries are
            a slice of the local rows, e.g. every row of an unpadded one-rank plan), else None.
        k_range: the same for ``k_index``.
        k_unique: whether no row of ``[k; prefix_k]`` is packed twice (each key's gradient
            has one contribution: no wider accumulation is needed).
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_q_host: list[int]
    cu_k_host: list[int]
    max_q: int
    max_k: int
    q_seq: torch.Tensor
    q_pos: torch.Tensor
    k_seq: torch.Tensor
    k_pos: torch.Tensor
    key_ranges_host: np.ndarray
    window: int | None
    num_new: int
    flex_cache: dict = field(default_factory=dict)
    q_lo: torch.Tensor | None = None
    q_hi: torch.Tensor | None = None
    q_range: tuple[int, int] | None = None
    k_range: tuple[int, int] | None = None
    k_unique: bool = False

    @property
    def num_queries(self) -> int:
        """Tq."""
        return self.cu_q_host[-1]

    def mask_mod(self):
        """The FlexAttention ``mask_mod`` of the pack (same sequence, causal, inside the
        window), one function object per pack (compiled code is reused for it).

        Each packed query sees one run of packed keys (``key_ranges_host``: its sequence's
        keys from its window's first to itself), so the mask is ``lo[q] <= kv < hi[q]``:
        two loads per query row and none per key, where comparing sequences and positions
        would load per key as well."""
        fn = self.flex_cache.get("mask_mod")
        if fn is None:
            fn = self.flex_cache["mask_mod"] = _key_run_mask(self.q_lo, self.q_hi)
        return fn


def _key_run_mask(q_lo, q_hi):
    # A closure over tensors, the form FlexAttention's compiled path traces without guarding
    # on the values.
    def mask_mod(b, h, q_idx, kv_idx):
        return key_run_mask(b, h, q_idx, kv_idx, q_lo, q_hi)

    return mask_mod


def masked_pack(
    segments: torch.Tensor,
    num_new: int,
    prefix_cu: list[int] | None,
    window: int | None,
    device: torch.device | str,
) -> MaskedPack:
    """The packing of a plan's segments ([S, 5] int64 host tensor) over ``num_new`` restored
    new keys and the cached prefixes ragged by ``prefix_cu`` ([R + 1] host ints, or None),
    keeping only the keys a window W (or None) lets the queries see."""
    segs = (segments if segments.device.type == "cpu" else segments.cpu()).numpy()
    segs = segs[segs[:, 2] > 0]
    req, qs, ql, ks, kl = (segs[:, j].astype(np.int64) for j in range(5))
    pcu = None if prefix_cu is None else np.asarray(prefix_cu, dtype=np.int64)
    plen = np.zeros_like(kl) if pcu is None else pcu[req + 1] - pcu[req]
    total = plen + kl
    first = np.zeros_like(total) if window is None else np.maximum(total - ql - (window - 1), 0)
    nk = total - first
    pstart = np.zeros_like(req) if pcu is None else pcu[req]
    seq = np.arange(segs.shape[0], dtype=np.int64)
    k_pos = _ragged(first, nk)
    k_seq = np.repeat(seq, nk)
    # Key position p: a prefix row below the request's prefix length, else a new-key row.
    k_rows = np.where(
        k_pos < plen[k_seq],
        num_new + pstart[k_seq] + k_pos,
        ks[k_seq] + k_pos - plen[k_seq],
    )
    # Query at position t of a sequence whose kept keys start at position ``first`` (packed
    # from cu_k): it sees positions [max(first, t - W + 1), t].
    q_pos = _ragged(total - ql, ql)
    q_seq = np.repeat(seq, ql)
    cu_k = _cumsum0(nk)
    lo_pos = q_pos - (window - 1) if window is not None else first[q_seq]
    key_ranges = np.stack(
        [cu_k[q_seq] + np.maximum(lo_pos, first[q_seq]) - first[q_seq],
         cu_k[q_seq] + q_pos - first[q_seq] + 1], 1,
    )  # fmt: skip
    parts = {
        "q_index": (_ragged(qs, ql), torch.int64),
        "k_index": (k_rows, torch.int64),
        "cu_q": (_cumsum0(ql), torch.int32),
        "cu_k": (cu_k, torch.int32),
        "q_seq": (q_seq, torch.int32),
        "q_pos": (q_pos, torch.int32),
        "k_seq": (k_seq, torch.int32),
        "k_pos": (k_pos, torch.int32),
        "q_lo": (key_ranges[:, 0], torch.int32),
        "q_hi": (key_ranges[:, 1], torch.int32),
    }
    views = _to_device(parts, device)  # one host-to-device copy for all of them
    q_rows = parts["q_index"][0]
    return MaskedPack(
        q_index=views["q_index"],
        k_index=views["k_index"],
        cu_q=views["cu_q"],
        cu_k=views["cu_k"],
        q_seq=views["q_seq"],
        q_pos=views["q_pos"],
        k_seq=views["k_seq"],
        k_pos=views["k_pos"],
        cu_q_host=parts["cu_q"][0].tolist(),  # ok: host (numpy)
        cu_k_host=parts["cu_k"][0].tolist(),  # ok: host (numpy)
        max_q=int(ql.max()) if ql.size else 0,
        max_k=int(nk.max()) if nk.size else 0,
        key_ranges_host=key_ranges.reshape(-1, 2),
        window=window,
        num_new=num_new,
        q_lo=views["q_lo"],
        q_hi=views["q_hi"],
        q_range=_run_of(q_rows),
        k_range=_run_of(k_rows),
        k_unique=bool(np.unique(k_rows).size == k_rows.size),
    )


def _run_of(rows: np.ndarray) -> tuple[int, int] | None:
    # (a, b) when ``rows`` is a .. b - 1 (non-empty), else None.
    if rows.size == 0 or not bool((np.diff(rows) == 1).all()):
        return None
    return int(rows[0]), int(rows[-1]) + 1


# --------------------------------------------------------------------------- FlexAttention


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


SPARSE_BLOCK = 128


def flex_block_tables(pack: MaskedPack, block: int = SPARSE_BLOCK):
    """The FlexAttention block sparsity of the pack, from its queries' key ranges (exact, on
    the host): per query block, the kv blocks some of whose entries it sees (``mask_mod``
    applied) and those all of whose entries it sees (complete blocks only). Returns
    (kv_num_blocks [Bq], kv_indices [Bq, Bk], full_num_blocks [Bq], full_indices [Bq, Bk])
    int32 numpy, indices ascending, padded with 0."""
    a, b = pack.key_ranges_host[:, 0], pack.key_ranges_host[:, 1]
    tq, tk = a.size, pack.cu_k_host[-1]
    n_qb, n_kb = -(-tq // block), -(-tk // block)
    starts = np.arange(0, tq, block)
    # A query block's rows see a contiguous range of packed keys: every sequence's rows do,
    # and a sequence's last query sees up to the first key of the next.
    t_lo = np.minimum.reduceat(a, starts) // block
    t_hi = -(-np.maximum.reduceat(b, starts) // block)
    f_lo = -(-np.maximum.reduceat(a, starts) // block)
    f_hi = np.minimum(np.minimum.reduceat(b, starts) // block, tk // block)
    f_hi = np.where(starts + block <= tq, f_hi, f_lo)  # a partial query block: none full
    n_full = np.maximum(f_hi - f_lo, 0)
    has_full = n_full > 0
    # Partial blocks: the touched range less the full one (before it and after it).
    p1_hi = np.where(has_full, f_lo, t_hi)
    p2_lo = np.where(has_full, f_hi, t_hi)
    n1, n2 = p1_hi - t_lo, t_hi - p2_lo
    j = np.arange(n_kb)[None, :]
    n1c, n2c = n1[:, None], n2[:, None]
    idx = np.where(j < n1c, t_lo[:, None] + j, np.where(j < n1c + n2c, p2_lo[:, None] + j - n1c, 0))
    full = np.where(j < n_full[:, None], f_lo[:, None] + j, 0)
    assert idx.shape == (n_qb, n_kb)
    return (
        (n1 + n2).astype(np.int32),
        idx.astype(np.int32),
        n_full.astype(np.int32),
        full.astype(np.int32),
    )


def _block_mask(pack: MaskedPack, device: torch.device):
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
    with warnings.catch_warnings(), flex_compile_config():
        # The eager (CPU) path warns that it is unfused: it is the CPU twin by design.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        res = fn(
            q4, k4, v4, softcap_score_mod(softcap), _block_mask(pack, q.device), scale,
            q.shape[1] != k.shape[1], flex_lse_kwargs(),
        )  # fmt: skip
    out, aux = res
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def flex_backward(dout, q, k, v, out, lse, pack: MaskedPack, *, scale, softcap, backend="inductor"):
    """Gradients (dq, dk, dv) of :func:`flex_attention_call` from its final ``out`` / ``lse``
    (natural log) by FlexAttention's backward kernel alone
    (:func:`~cp_modules.kernels.flex_backward.flex_attention_backward_call`; ``backend=None``:
    the operator's eager dense implementation)."""
    with flex_compile_config():
        return flex_attention_backward_call(
            dout, q, k, v, out, lse, block_mask=_block_mask(pack, q.device),
            mask_mod=key_run_mask, mask_buffers=(pack.q_lo, pack.q_hi), scale=scale,
            score_mod=softcap_score_mod(softcap), backend=backend,
        )  # fmt: skip


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
                                       softcap=softcap)  # fmt: skip
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
