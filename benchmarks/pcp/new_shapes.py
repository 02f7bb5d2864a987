"""``bench_pcp new-shapes``: the first call on prompts of new lengths against the next, per path."""

from __future__ import annotations

import time

import torch

from benchmarks.pcp.common import (
    ALWAYS_VARLEN,
    NEVER_VARLEN,
)
from benchmarks.pcp.varlen import (
    MANY_SHAPES,
)
from cp_modules.ops.pcp_policy import (
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
)

# --- new-shapes: prompts of lengths the process has not seen --------------------------------
# cuDNN builds an execution plan for every new attention shape; FlashAttention-2 has no per-shape
# cost. For single prompts of random lengths, the last rank's first and second forward and
# backward, through the varlen path, the automatic choice (which rents the varlen path for a plan
# of new shapes) and the block path, in that order on the same lengths (the blocks come last, so
# their first calls meet shapes cuDNN has not seen).

NEW_SHAPE_PATHS = {
    "varlen": ALWAYS_VARLEN,
    "auto": CPPolicy(pcp_varlen="auto"),
    "blocks": NEVER_VARLEN,
}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def new_shape_prompt(shape, S, P, policy):
    hq, hkv, dqk, dv = MANY_SHAPES[shape]
    q = torch.randn(S, hq, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(S, hkv, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(S, hkv, dv, device="cuda", dtype=torch.bfloat16)
    plan = plan_pcp([S], [0], P, P - 1, device="cuda")
    ql = q[plan.token_indices]
    inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, dqk**-0.5)
    res = {}
    for call in ("first", "second"):
        t_f, (o, lse) = timed(lambda: pcp_prefill_attention_cuda(inputs, policy=policy))
        dout = torch.randn_like(o)
        grads = (dout, o, lse, inputs)
        t_b, _ = timed(lambda g=grads: pcp_prefill_attention_backward_cuda(*g, policy=policy))
        res[call] = {"fwd_ms": t_f, "bwd_ms": t_b}
    return res
