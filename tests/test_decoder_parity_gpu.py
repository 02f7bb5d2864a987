"""One GPU, decoder training: the attention forward runs on cuDNN as HF's ``sdpa`` does (no
FlashAttention-2 rental for new shapes), and its gradients equal the fp32 reference.

GQA (Llama-3-8B heads) through ``gqa_attention`` at world 1, one plan reused over steps (the
case where a rental would have served every step); MLA (DeepSeek-V3 head dims) through
``mla_attention`` at world 1 (the up-projection outside the op, its K / V kept by autograd).
Tolerance: the flash-attention rule (``assert_close_to_reference``: at most twice the error
of the same computation in plain PyTorch in bf16).
"""

from __future__ import annotations

import pytest
import torch

from cp_modules.ops import pcp_policy
from cp_modules.ops.cp_attention import gqa_attention
from cp_modules.ops.mla_attention import mla_attention
from cp_modules.policy import CPPolicy
from cp_modules.step import CPRuntime, build_step_metadata, cp_step
from cp_modules.testing.numerics import assert_close_to_reference

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _count_varlen(monkeypatch) -> list[int]:
    calls: list[int] = []
    inner = pcp_policy.pcp_prefill_attention_varlen

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(pcp_policy, "pcp_prefill_attention_varlen", counted)
    return calls


def _causal(q, k, v, scale):
    """Dense causal attention [T, H, D] (K / V heads repeated), torch's math kernel."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale
        )
    return o[0].transpose(0, 1)


def _kernel_names(fn) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _check_grads(got, want_fp32, want_bf16, names):
    for name, a, b, c in zip(names, got, want_fp32, want_bf16):
        scale = b.abs().max().item()
        assert_close_to_reference(a, b, c, atol=1e-3 * scale, name=name)


@pytest.mark.parametrize("rents", [False, True], ids=["default", "training_rents_cudnn"])
def test_gpu_gqa_training_forward_on_cudnn_with_reference_gradients(monkeypatch, rents):
    torch.manual_seed(0)
    n, h, hkv, d = 4096 + (37 if rents else 41), 32, 8, 128  # a length no earlier test had
    policy = CPPolicy(training_rents_cudnn=rents)
    meta = build_step_metadata(CPRuntime.single(policy=policy), [n], device="cuda")
    q = torch.randn(n, h, d, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(n, hkv, d, device="cuda", dtype=BF16, requires_grad=True)
    v = torch.randn(n, hkv, d, device="cuda", dtype=BF16, requires_grad=True)
    dout = torch.randn(n, h, d, device="cuda", dtype=BF16)
    calls = _count_varlen(monkeypatch)
    results = []

    def step():
        with cp_step(meta):  # the same plan every step
            out = gqa_attention(q, k, v, scale=d**-0.5)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))

    names = set()
    for _ in range(3):
        names |= _kernel_names(step)
    # Rented (FlashAttention-2 varlen) only when the policy asks for it.
    assert bool(calls) is rents
    if not rents:
        assert any("cudnn" in x.lower() for x in names), sorted(names)[:20]
        assert not any("flash_fwd" in x for x in names), sorted(names)[:20]
    x32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o32 = _causal(*x32, d**-0.5)
    want32 = (o32, *torch.autograd.grad(o32, x32, dout.float()))
    x16 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o16 = _causal(*x16, d**-0.5)
    want16 = (o16, *torch.autograd.grad(o16, x16, dout))
    for got in results:
        _check_grads(got, want32, want16, ("out", "dq", "dk", "dv"))

    # An inference forward of a new length still rents (the first calls of a new shape).
    calls.clear()
    m = n + 128
    meta2 = build_step_metadata(CPRuntime.single(policy=policy), [m], device="cuda")
    qi, ki, vi = (torch.randn(m, *x.shape[1:], device="cuda", dtype=BF16) for x in (q, k, v))
    with torch.no_grad(), cp_step(meta2):
        gqa_attention(qi, ki, vi, scale=d**-0.5)
    assert calls


def _mla_reference(q, kv_c, k_pe, w_kv, scale, dn):
    h = w_kv.shape[0]
    kv = torch.nn.functional.linear(kv_c, w_kv.reshape(-1, w_kv.shape[2])).view(
        -1, h, w_kv.shape[1]
    )
    k = torch.cat((kv[..., :dn], k_pe[:, None].expand(-1, h, -1)), dim=-1)
    return _causal(q, k, kv[..., dn:], scale)


def test_gpu_mla_training_at_one_rank_has_reference_gradients(monkeypatch):
    torch.manual_seed(1)
    n, h, dn, dr, dv, rk = 2048 + 5, 16, 128, 64, 128, 512
    scale = (dn + dr) ** -0.5
    meta = build_step_metadata(CPRuntime.single(), [n], device="cuda")
    q = torch.randn(n, h, dn + dr, device="cuda", dtype=BF16, requires_grad=True)
    kv_c = torch.randn(n, rk, device="cuda", dtype=BF16, requires_grad=True)
    k_pe = torch.randn(n, dr, device="cuda", dtype=BF16, requires_grad=True)
    w_kv = (torch.randn(h, dn + dv, rk, device="cuda") * rk**-0.5).to(BF16).requires_grad_()
    dout = torch.randn(n, h, dv, device="cuda", dtype=BF16)
    inputs = (q, kv_c, k_pe, w_kv)
    calls = _count_varlen(monkeypatch)
    with cp_step(meta):
        out = mla_attention(q, (kv_c, k_pe), w_kv, None, scale=scale, kv_lora_rank=rk)
    got = (out, *torch.autograd.grad(out, inputs, dout))
    assert not calls
    x32 = [t.detach().float().requires_grad_() for t in inputs]
    o32 = _mla_reference(*x32, scale, dn)
    want32 = (o32, *torch.autograd.grad(o32, x32, dout.float()))
    x16 = [t.detach().clone().requires_grad_() for t in inputs]
    o16 = _mla_reference(*x16, scale, dn)
    want16 = (o16, *torch.autograd.grad(o16, x16, dout))
    _check_grads(got, want32, want16, ("out", "dq", "dkv_c", "dk_pe", "dw_kv"))
