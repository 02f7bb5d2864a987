"""FlexAttention's backward: its own kernel from a given output and LSE (no forward
recompute), and the recompute under autograd where that kernel cannot be called.

Shape letters: Tq = queries, Tk = keys, Hq / Hkv = query / KV heads, D = head dim.

FlexAttention's backward is a higher-order operator of its own,
``torch._higher_order_ops.flex_attention_backward(q, k, v, out, logsumexp, grad_out,
grad_logsumexp, fw_graph, joint_graph, block_mask, scale, kernel_options,
score_mod_other_buffers, mask_mod_other_buffers)`` (tensors [B, H, L, D], fewer KV heads
native). It takes the output and LSE from outside, so it serves the PCP contract directly: the
gradients of the attention whose *given* output and LSE are the final ones (attention sinks
applied after the merge included): the kernel's probabilities are ``exp(s - lse)`` and its
``delta`` is ``rowsum(dout * out)``, as in FlashAttention-2's backward.

Calling it outside the library's autograd path needs what that path prepares:

* ``fw_graph`` / ``joint_graph`` / the mask graph as ``GraphModule`` s. The score graph and the
  mask graph are traced here with ``make_fx`` (the mask with its tensors as explicit
  ``mask_mod_other_buffers``, so one graph serves every pack), the joint graph by the library's
  ``create_fw_bw_graph``; one set per (``score_mod``, ``mask_mod``, device, dtype).
* Compiled: the eager operator is the dense math (the whole score grid). Dynamo proxies
  pre-traced graphs only when each is read as an item of a dict that is itself an item of a
  dict (``FlexAttentionBackwardHighOrderVariable.proxy_submod`` asserts ``arg.source.base``
  is a ``DictGetItemSource``), and only while the module counts as dynamic: installing a
  subgraph marks it static (``torchdynamo_force_dynamic = False``), so the mark is reset
  before each call, else a recompile would meet a static module it cannot proxy (and so
  would a restarted analysis within one trace: the float specialisation of
  ``flex_compile_config`` avoids the one a symbolic ``scale`` causes). Torch 2.13 also derives the joint graph from a plain ``score_mod``, but not for a
  soft-cap: its ``create_fw_bw_graph`` builds the example gradient as a real tensor inside
  dynamo's fake mode, which ``tanh_backward`` refuses; the pre-traced form works on 2.11 and
  2.13.
* ``kernel_options``: the full internal dict of the public API (``_apply_kernel_options``).
* The LSE in log2 units (the public API multiplies the operator's by ln 2 unless the backend
  is FLASH) and contiguous fp32 [B, Hq, Tq]: the Triton backward indexes it as
  ``(b * Hq + h) * Tq + i`` whatever its strides.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from collections.abc import Callable

import torch

from cp_modules.reference.pcp_attention import lse_dtype

__all__ = [
    "flex_attention_backward_call",
    "flex_backward_supported",
    "key_run_mask",
    "recomputed_grads",
]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_HOP_MODULE = "torch._higher_order_ops.flex_attention"
_HOP_PARAMETERS = (
    "query", "key", "value", "out", "logsumexp", "grad_out", "grad_logsumexp", "fw_graph",
    "joint_graph", "block_mask", "scale", "kernel_options", "score_mod_other_buffers",
    "mask_mod_other_buffers",
)  # fmt: skip


def key_run_mask(b, h, q_idx, kv_idx, q_lo, q_hi):
    """FlexAttention ``mask_mod`` of key runs: query ``q`` sees the keys ``[q_lo[q], q_hi[q])``
    (``q_lo`` / ``q_hi`` [Tq] int32 passed as mask buffers)."""
    return (kv_idx >= q_lo[q_idx]) & (kv_idx < q_hi[q_idx])


def _score_identity(score, b, h, q_idx, kv_idx):
    return score


@functools.cache
def flex_backward_supported() -> bool:
    """Whether this torch has what :func:`flex_attention_backward_call` uses: the backward
    operator with its 14 arguments, ``create_fw_bw_graph``, and dynamo's proxying of
    pre-traced graphs for that operator (feature detection, not versions)."""
    try:
        hop = importlib.import_module(_HOP_MODULE)
        from torch._dynamo.variables.higher_order_ops import (
            FlexAttentionBackwardHighOrderVariable as variable,
        )
        from torch.nn.attention.flex_attention import _apply_kernel_options  # noqa: F401
    except ImportError:
        return False
    op = getattr(hop, "flex_attention_backward", None)
    if op is None or not callable(getattr(hop, "create_fw_bw_graph", None)):
        return False
    names = tuple(inspect.signature(type(op).__call__).parameters)[1:]
    return names == _HOP_PARAMETERS and callable(getattr(variable, "proxy_submod", None))


@functools.lru_cache(maxsize=64)
def _graphs(score_mod: Callable, mask_mod: Callable, num_buffers: int, device: str, dtype):
    # The operator's graphs, as dynamo proxies them: {name: {"graph": GraphModule}}.
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    hop = importlib.import_module(_HOP_MODULE)
    score = torch.zeros((), device=device, dtype=dtype, requires_grad=True)
    index = tuple(torch.zeros((), device=device, dtype=torch.int32) for _ in range(4))
    buffers = tuple(torch.zeros(1, device=device, dtype=torch.int32) for _ in range(num_buffers))
    with TransformGetItemToIndex():  # tensor[scalar tensor] as aten.index
        fw = make_fx(score_mod)(score, *index)
        mask = make_fx(mask_mod)(*index, *buffers)
    _, joint = hop.create_fw_bw_graph(fw, (score, *index), ())
    return {
        "fw_graph": {"graph": fw},
        "joint_graph": {"graph": joint},
        "mask_graph": {"graph": mask},
    }


def _backward_entry(q, k, v, out, lse2, dout, graphs, blocks, scale, kernel_options, buffers):
    # The compiled frame (its own code object: its variants are counted apart).
    from torch._higher_order_ops import flex_attention_backward

    if torch.compiler.is_dynamo_compiling():
        # Heads and head dims static (the lowering takes them as kernel constants), as the
        # public FlexAttention marks its inputs; lengths stay dynamic.
        for x in (q, k, v, out, dout):
            torch._dynamo.mark_static(x, -3)
            torch._dynamo.mark_static(x, -1)
    return flex_attention_backward(
        q, k, v, out, lse2, dout, None, graphs["fw_graph"]["graph"],
        graphs["joint_graph"]["graph"], (*blocks, graphs["mask_graph"]["graph"]), scale,
        kernel_options, (), buffers,
    )  # fmt: skip


@functools.cache
def _compiled_backward(backend: str):
    # One compiled backward for every call: dynamic shapes (new packed lengths reuse it);
    # fullgraph, since a graph break would run the dense eager operator.
    return torch.compile(_backward_entry, dynamic=True, fullgraph=True, backend=backend)


def flex_attention_backward_call(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_mask,
    mask_mod: Callable,
    mask_buffers: tuple[torch.Tensor, ...],
    scale: float,
    score_mod: Callable | None,
    backend: str | None = "inductor",
    divisible: bool = False,
    block_options: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv], in q's dtype) of the
    FlexAttention whose output and natural-log LSE are ``out`` [Tq, Hq, Dv] / ``lse`` [Tq, Hq],
    for ``dout`` [Tq, Hq, Dv]; one backward kernel. ``block_mask`` is the forward's
    ``BlockMask`` (its ``mask_mod`` is replaced by ``mask_mod(b, h, q, kv, *mask_buffers)``,
    which must be the same mask), ``score_mod`` the forward's (None: none).

    ``backend``: the ``torch.compile`` backend (the caller applies its dynamo settings), or
    None for the operator's eager dense implementation (CPU tests). ``divisible``: both lengths
    are multiples of 128, so the kernel may skip its bounds checks
    (:func:`~cp_modules.kernels.masked.prefill.flex_divisible`). ``block_options``: kernel
    options of block sizes in FlexAttention's names (``bwd_BLOCK_M1``, ...; ``fwd_`` keys are
    ignored here), None: torch's defaults. Requires
    :func:`flex_backward_supported`."""
    from torch.nn.attention.flex_attention import _apply_kernel_options

    dt = q.dtype
    q4, k4, v4, out4, dout4 = (
        x.detach().to(dt).transpose(0, 1).unsqueeze(0) for x in (q, k, v, out, dout)
    )  # fmt: skip
    kernel_options: dict = dict(_apply_kernel_options(q4, k4, v4, True, None))
    if divisible:
        assert q.shape[0] % 128 == 0 and k.shape[0] % 128 == 0, "lengths not multiples of 128"
    # Stated either way: dynamo guards only the keys a compiled variant saw (a flag present
    # only when true would let a divisible call reuse a variant compiled for ragged lengths).
    kernel_options["IS_DIVISIBLE"] = bool(divisible)
    kernel_options.update(block_options or {})
    log2 = kernel_options["BACKEND"] != "FLASH"
    lse_t = lse.detach().transpose(0, 1) * (1 / math.log(2) if log2 else 1.0)
    lse4 = lse_t.to(torch.promote_types(lse.dtype, torch.float32)).contiguous().unsqueeze(0)
    graphs = _graphs(score_mod or _score_identity, mask_mod, len(mask_buffers), str(q.device), dt)
    blocks = block_mask.as_tuple()[:-1]
    args = (q4, k4, v4, out4, lse4, dout4, graphs, blocks, scale, kernel_options,
            tuple(mask_buffers))  # fmt: skip
    if backend is None:
        dq, dk, dv, _ = _backward_entry(*args)
    else:
        for item in graphs.values():
            item["graph"].torchdynamo_force_dynamic = True  # module docstring: why
        dq, dk, dv, _ = _compiled_backward(backend)(*args)
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


# --------------------------------------------------------------------------- recompute


# Dispatch keys that an op implementation running below autograd has excluded.
_AUTOGRAD_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor,
    torch._C.DispatchKey.ADInplaceOrView,
)


@contextlib.contextmanager
def _autograd_inside_op():
    # An op's implementation may run below autograd (a ``torch.library.custom_op`` calling
    # this one excludes the autograd dispatch keys for its whole body), where even
    # ``enable_grad`` records nothing; the recompute needs autograd, so the keys are
    # re-included for it alone (the private guard torch's own compiled regions use).
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def recomputed_grads(attend: Attend, dout, q, k, v, out, lse):
    """Gradients (dq, dk, dv) of the attention whose final output and LSE are ``out`` /
    ``lse``, by autograd through a recompute ``attend(q, k, v) -> (O, L)``: with
    ``sigma = exp(L - lse)`` (attention sinks applied after the merge make ``out = sigma * O``;
    sigma is 1 without), autograd gets ``dO = sigma * dout`` and
    ``dL = (1 - sigma) * rowsum(dout * out)``, which gives exactly the probabilities
    ``exp(s - lse)`` and the ``rowsum(dout * out)`` term a backward kernel uses."""
    acc = lse_dtype(q.dtype)
    with _autograd_inside_op():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o, l_new = attend(*leaves)
        sigma = torch.exp(l_new.detach().to(acc) - lse.to(acc))
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        do = (dout.to(acc) * sigma[..., None]).to(o.dtype)
        dl = ((1 - sigma) * delta).to(l_new.dtype)
        return torch.autograd.grad((o, l_new), leaves, (do, dl))
