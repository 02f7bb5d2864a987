"""Probe (CUDA): FlexAttention's backward from the saved output and LSE against the recompute.

One packed sequence of 32768 tokens, Hq=32, Hkv=8, D=128, bf16, soft-cap 50, with and without
a window of 4096. Times (median of 10 after warm-up, CUDA events): the forward
(``flex_attention_call``), the recompute backward it replaces, the new backward
(``flex_backward``), and torch's compiled FlexAttention forward+backward under autograd on the
same pack; prints the new gradients' max abs differences from the recompute's and the first
(compiling) call of each. Exits 0 whatever happens, saying what could not run.

    python tools/_probe_flexbwd.py
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's cp_modules

START = time.perf_counter()
BUDGET_S = 200.0


def _bench(fn, n=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _first_call(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = fn()
    torch.cuda.synchronize()
    return res, time.perf_counter() - t


def _try(label, fn):
    try:
        return fn()
    except Exception:  # report and go on: the probe always exits 0
        print(f"  {label}: UNAVAILABLE")
        traceback.print_exc(limit=6, file=sys.stdout)
        return None


def _probe(pack, q, k, v, dout, scale, softcap, supported):
    from cp_modules.kernels.flex_backward import recomputed_grads
    from cp_modules.kernels.masked_prefill import flex_attention_call, flex_backward

    call = functools.partial(flex_attention_call, pack=pack, scale=scale, softcap=softcap)

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    (out, lse), t0 = _first_call(fwd)
    print(f"  forward: first call {t0:.1f} s, {_bench(fwd):.3f} ms")

    def old():
        return recomputed_grads(call, dout, q, k, v, out, lse)

    g_old, t0 = _first_call(old)
    print(f"  recompute backward (old): first call {t0:.1f} s, {_bench(old):.3f} ms")

    def new():
        return flex_backward(dout, q, k, v, out, lse, pack, scale=scale, softcap=softcap)

    g_new = None
    if not supported:
        print("  new backward: UNAVAILABLE (flex_backward_supported() is False)")
    else:
        res = _try("new backward", lambda: _first_call(new))
        if res is not None:
            g_new, t0 = res
            print(f"  new backward: first call {t0:.1f} s, {_bench(new):.3f} ms")
    if g_new is not None:
        for name, a, b in zip(("dq", "dk", "dv"), g_new, g_old):
            diff = (a.float() - b.float()).abs().max().item()
            print(f"  {name}: max |new - old| {diff:.3e} (max |old| {b.abs().max().item():.3e})")
    if softcap is None and pack.window is not None:
        from cp_modules.kernels.masked_flash import flash_window_backward

        def fa2():
            return flash_window_backward(dout, q, k, v, out, lse, pack, scale)

        g_fa, t0 = _first_call(fa2)
        print(f"  FlashAttention-2 window backward: {_bench(fa2):.3f} ms")
        if g_new is not None:
            for name, a, b in zip(("dq", "dk", "dv"), g_new, g_fa):
                diff = (a.float() - b.float()).abs().max().item()
                print(f"  {name}: max |new - fa2| {diff:.3e}")
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        o, _ = call(*leaves)
        o.backward(dout)

    _, t0 = _first_call(fwd_bwd)
    print(f"  torch compiled fwd+bwd under autograd: first call {t0:.1f} s, "
          f"{_bench(fwd_bwd):.3f} ms")  # fmt: skip


def _probe_new_length(q, k, v, dout, scale, softcap):
    # A pack of another length (and window): the backward entry should not compile again.
    from cp_modules.kernels import flex_backward as fb
    from cp_modules.kernels.masked_prefill import flex_attention_call, flex_backward, masked_pack

    def variants():
        code = fb._backward_entry.__code__
        return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))

    m = 20000
    before = variants()
    pack = masked_pack(torch.tensor([[0, 0, m, 0, m]]), m, None, 1000, q.device)
    qm, km, vm, dm = (x[:m] for x in (q, k, v, dout))
    with torch.no_grad():
        out, lse = flex_attention_call(qm, km, vm, pack, scale=scale, softcap=softcap)
    res = _try("new backward, new length", lambda: _first_call(
        lambda: flex_backward(dm, qm, km, vm, out, lse, pack, scale=scale, softcap=softcap)))  # fmt: skip
    if res is not None:
        print(f"== new length S={m} window=1000: first call {res[1]:.1f} s; compiled variants "
              f"of the backward entry {before} -> {variants()}")  # fmt: skip


def main() -> int:
    print("torch", torch.__version__)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    import triton

    print("triton", triton.__version__, "device", torch.cuda.get_device_name())
    from cp_modules.kernels.flex_backward import flex_backward_supported
    from cp_modules.kernels.masked_prefill import masked_pack

    supported = flex_backward_supported()
    print("flex_backward_supported:", supported)
    n, hq, hkv, d, softcap = 32768, 32, 8, 128, 50.0
    scale = d**-0.5
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(n, hq, d, device=dev, dtype=dt)
    k = torch.randn(n, hkv, d, device=dev, dtype=dt)
    v = torch.randn(n, hkv, d, device=dev, dtype=dt)
    dout = torch.randn(n, hq, d, device=dev, dtype=dt)
    for window, cap in ((None, softcap), (4096, softcap), (4096, None)):
        if time.perf_counter() - START > BUDGET_S:
            print(f"window={window}: skipped (time budget)")
            continue
        print(f"== S={n} Hq={hq} Hkv={hkv} D={d} bf16 softcap={cap} window={window}")
        pack = masked_pack(torch.tensor([[0, 0, n, 0, n]]), n, None, window, dev)
        _probe(pack, q, k, v, dout, scale, cap, supported)
        torch.cuda.empty_cache()
    if supported and time.perf_counter() - START <= BUDGET_S:
        _try("new length", lambda: _probe_new_length(q, k, v, dout, scale, softcap))
    print(f"total {time.perf_counter() - START:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:
        traceback.print_exc(file=sys.stdout)
        code = 0
    sys.exit(code)
