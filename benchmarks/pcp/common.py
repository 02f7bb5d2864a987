"""Shared pieces of the PCP benchmarks: shapes, the fp32 reference, the rank functions, timing and memory helpers."""

from __future__ import annotations

import torch

from cp_modules.ops.pcp_policy import (
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    attention_with_lse,
    attention_with_lse_backward,
)

# name: (S, Hq, Hkv, Dqk, Dv)
SHAPES = {
    "mha-32k": (32768, 32, 32, 128, 128),
    "mha-128k": (131072, 32, 32, 128, 128),
    "gqa-32k": (32768, 32, 8, 128, 128),
    "mla-32k": (32768, 32, 32, 192, 128),
}
GOAL_BALANCE, GOAL_SPEED = 1.05, 1.10
REF_CHUNK = 256
DEVICE = "cuda"
# Dense baselines that are not fused kernels (an [H, S, S] score matrix): skip such shapes.
NO_BASELINE = {"reference"}

# The two forced paths of cp_modules.ops.pcp_policy (the automatic choice is CPPolicy()).
NEVER_VARLEN, ALWAYS_VARLEN = CPPolicy(pcp_varlen="never"), CPPolicy(pcp_varlen="always")
# The block path whatever the automatic choice would take (it runs a plan of shapes that no
# earlier plan had as varlen calls, to spare cuDNN's plan builds): these are its timings.
BLOCKS = dict(policy=NEVER_VARLEN)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def low_precision_attention(q, k, v, scale):
    """Plain PyTorch attention in the inputs' dtype, bottom-right causal (the 2x rule's base)."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("lhd,mhd->hlm", q, k.repeat_interleave(group, 1)) * scale
    L, M = q.shape[0], k.shape[0]
    i = torch.arange(L, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(M, device=q.device)[None, :] > i + M - L, float("-inf"))
    return torch.einsum("hlm,mhd->lhd", torch.softmax(s, -1), v.repeat_interleave(group, 1))


def reference(q, k, v, dout, scale):
    """Dense causal attention in query chunks: fp32 (out, lse, dq, dk, dv) from the pure-PyTorch
    reference, and (out, dq, dk, dv) of plain PyTorch attention in the inputs' dtype."""
    q32, k32, v32, dout32 = (x.float() for x in (q, k, v, dout))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], device=q.device)
    lse = torch.empty(q.shape[:2], device=q.device)
    dq, dk, dv = torch.empty_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
    low = [
        torch.empty_like(out),
        torch.empty_like(q32),
        torch.zeros_like(k32),
        torch.zeros_like(v32),
    ]
    for a in range(0, q.shape[0], REF_CHUNK):
        b = min(a + REF_CHUNK, q.shape[0])
        # Bottom-right causal: query a + i sees keys 0 .. a + i.
        out[a:b], lse[a:b] = attention_with_lse(
            q32[a:b], k32[:b], v32[:b], scale=scale, causal=True
        )
        gq, gk, gv = attention_with_lse_backward(
            dout32[a:b], q32[a:b], k32[:b], v32[:b], out[a:b], lse[a:b], scale=scale, causal=True
        )
        dq[a:b] = gq
        dk[:b] += gk
        dv[:b] += gv
        leaves = [
            q[a:b].clone().requires_grad_(),
            k[:b].clone().requires_grad_(),
            v[:b].clone().requires_grad_(),
        ]
        o = low_precision_attention(*leaves, scale)
        gq, gk, gv = torch.autograd.grad(o, leaves, dout[a:b])
        low[0][a:b] = o.detach()
        low[1][a:b] = gq
        low[2][:b] += gk
        low[3][:b] += gv
    return (out, lse, dq, dk, dv), low


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


ROUNDS = 5


def rank_fns(plan, q, k, v, dout, scale):
    """(forward, backward, forward + backward) callables of one rank's head/tail attention."""
    ql, dl = q[plan.token_indices], dout[plan.token_indices]
    inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)

    def forward():
        return pcp_prefill_attention_cuda(inputs, **BLOCKS)

    o, lse = forward()
    return (
        forward,
        lambda: pcp_prefill_attention_backward_cuda(dl, o, lse, inputs, **BLOCKS),
        lambda: pcp_prefill_attention_backward_cuda(dl, *forward(), inputs, **BLOCKS),
    )


def median(xs):
    return sorted(xs)[len(xs) // 2]


def shape_inputs(name: str, device: str = DEVICE):
    """Seeded bf16 (q, k, v, dout) of one long sequence of shape ``name``, and its scale."""
    S, hq, hkv, dqk, dv = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(S, h, d, device=device, generator=g, dtype=torch.bfloat16)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    )
    dout = torch.randn(S, hq, dv, device=device, generator=g, dtype=torch.bfloat16)
    return q, k, v, dout, dqk**-0.5
