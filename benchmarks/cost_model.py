#!/usr/bin/env python
"""Communication cost model for DCP decode and PCP prefill (pure arithmetic, no GPU).

Per layer and step, per rank:
  DCP decode (B tokens, N = dcp, Hg = query heads the DCP group attends with, e = dtype bytes):
    query all-gather  : (G-1)/G * B*Hg*Dq*e          (G = query-gather group size; 0 when G = 1)
    ag_rs             : all-gather LSE (N-1)*B*Hg*4 + reduce-scatter/all-reduce of outputs
                        (N-1)/N * B*Hg*Dv*e (reduce-scatter; an all-reduce moves 2x that)
                        -> 3 collectives (query AG, LSE AG, output RS/AR)
    a2a               : (N-1)/N * B*Hg*(Dv*e + 4) in two all-to-alls (outputs, LSEs) + query AG
    packed a2a        : the same bytes in one all-to-all + query AG
  PCP prefill (T tokens of one sequence, P = pcp):
    K/V all-gather    : (P-1)/P * T * bytes_per_token (2*Hkv*D*e for GQA; (Rk+Dr)*e for the
                        MLA latent, which is what cp_modules gathers)
    attention compute : causal forward FLOPs / P = T^2*H*(Dqk+Dv)/P (two matmuls, half masked)
    the gather hides behind the attention when bytes/beta <= flops/F_attn, i.e. from
    T >= (P-1)*bytes_per_token*F_attn / (beta * H*(Dqk+Dv)).
Time model: t = n_collectives * alpha + bytes / beta, with alpha = 8 us (CUDA-graph captured) or
20 us (eager) and beta = 370 GB/s per rank (NVLink, non-all-reduce NCCL busbw on 8 H100/H200;
performance anchors). These are models, not measurements: one GPU cannot measure collectives.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

ALPHA_GRAPH_S = 8e-6
ALPHA_EAGER_S = 20e-6
BETA_BPS = 370e9
F_ATTN = 600e12  # bf16 causal attention rate per GPU (cuDNN measured 619 TFLOP/s on the H200)
HBM_BPS = 4.2e12  # device copy rate measured on the H200


@dataclass(frozen=True)
class Shapes:
    name: str
    heads: int  # query heads the DCP group attends with (all heads for MLA / full-TP gather)
    dq: int  # query head dim at decode (576 absorbed for MLA)
    dv: int  # output head dim at decode (512 latent for MLA)
    kv_bytes_per_token: int  # per layer, per rank holding all KV heads (bf16)
    prefill_gather_bytes_per_token: int  # what PCP gathers per token per layer
    prefill_dqk: int
    prefill_dv: int
    prefill_heads: int


LLAMA3_8B = Shapes("llama3_8b", 32, 128, 128, 2 * 8 * 128 * 2, 2 * 8 * 128 * 2, 128, 128, 32)
DEEPSEEK_V3 = Shapes("deepseek_v3", 128, 576, 512, 576 * 2, 576 * 2, 192, 128, 128)


def dcp_decode(s: Shapes, n: int, batch: int, gather: int | None = None, e: int = 2) -> dict:
    """Bytes and collective counts per layer and rank for the three combine backends.

    ``gather``: query all-gather group size (default ``n``: the dcp == tp, pcp == 1 case, where
    the query is all-gathered over the whole DCP group).
    """
    gather = n if gather is None else gather
    hg = s.heads
    q_ag = 0 if gather == 1 else (gather - 1) / gather * batch * hg * s.dq * e
    out = (n - 1) / n * batch * hg * s.dv * e
    res = {}
    res["ag_rs"] = dict(bytes=q_ag + (n - 1) * batch * hg * 4 + out, collectives=2 + (gather > 1))
    # a2a: each peer receives only the heads it owns (outputs and LSEs), N-fold fewer LSE bytes.
    res["a2a"] = dict(bytes=q_ag + out + (n - 1) / n * batch * hg * 4, collectives=2 + (gather > 1))
    res["a2a_packed"] = dict(bytes=res["a2a"]["bytes"], collectives=1 + (gather > 1))
    for v in res.values():
        v["t_graph_us"] = 1e6 * (v["collectives"] * ALPHA_GRAPH_S + v["bytes"] / BETA_BPS)
        v["t_eager_us"] = 1e6 * (v["collectives"] * ALPHA_EAGER_S + v["bytes"] / BETA_BPS)
    return res


def dcp_break_even_tokens(s: Shapes, n: int, t_comm_s: float) -> float:
    """B*S above which sharding the KV read over n ranks saves more than the combine costs."""
    return t_comm_s * HBM_BPS / (s.kv_bytes_per_token * (1 - 1 / n))


def pcp_gather(s: Shapes, p: int, tokens: int, e: int = 2) -> dict:
    """K/V (or latent) all-gather vs the causal attention it can hide behind, per layer."""
    gather_bytes = (p - 1) / p * tokens * s.prefill_gather_bytes_per_token
    t_gather = ALPHA_EAGER_S + gather_bytes / BETA_BPS
    flops = tokens**2 * s.prefill_heads * (s.prefill_dqk + s.prefill_dv) / p  # causal fwd / P
    t_attn = flops / F_ATTN
    # Smallest T for which the gather hides (solve bytes/beta <= flops/F for T).
    coef_b = (p - 1) / p * s.prefill_gather_bytes_per_token / BETA_BPS
    coef_f = s.prefill_heads * (s.prefill_dqk + s.prefill_dv) / p / F_ATTN
    return dict(
        gather_MB=gather_bytes / 1e6,
        t_gather_us=1e6 * t_gather,
        t_attn_us=1e6 * t_attn,
        hidden=t_gather <= t_attn,
        hide_from_tokens=int(coef_b / coef_f) + 1,
    )


def model(batches=(1, 8, 64, 256), sizes=(2, 4, 8), prefill_tokens=(8192, 32768, 131072)) -> dict:
    out = {
        "assumptions": dict(
            alpha_graph_us=ALPHA_GRAPH_S * 1e6,
            alpha_eager_us=ALPHA_EAGER_S * 1e6,
            beta_GBps=BETA_BPS / 1e9,
            attn_TFLOPs=F_ATTN / 1e12,
            hbm_TBps=HBM_BPS / 1e12,
        )
    }
    for s in (LLAMA3_8B, DEEPSEEK_V3):
        m = {"shapes": asdict(s), "decode": {}, "break_even_tokens": {}, "prefill": {}}
        for n in sizes:
            for b in batches:
                m["decode"][f"N{n}_B{b}"] = dcp_decode(s, n, b)
            packed = dcp_decode(s, n, 64)["a2a_packed"]["t_graph_us"] * 1e-6
            agrs = dcp_decode(s, n, 64)["ag_rs"]["t_graph_us"] * 1e-6
            m["break_even_tokens"][f"N{n}"] = dict(
                a2a_packed=dcp_break_even_tokens(s, n, packed),
                ag_rs=dcp_break_even_tokens(s, n, agrs),
            )
            for t in prefill_tokens:
                m["prefill"][f"P{n}_T{t}"] = pcp_gather(s, n, t)
        out[s.name] = m
    return out


def format_table(res: dict) -> str:
    lines = [
        "| model | N | B | ag_rs bytes / colls / us (graph) | a2a | packed a2a |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("llama3_8b", "deepseek_v3"):
        for key, v in res[name]["decode"].items():
            n, b = key.split("_")
            cells = [
                f"{v[k]['bytes'] / 1e3:.1f} KB / {v[k]['collectives']} / {v[k]['t_graph_us']:.1f}"
                for k in ("ag_rs", "a2a", "a2a_packed")
            ]
            lines.append(f"| {name} | {n[1:]} | {b[1:]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| model | P | T | gathered MB | gather us | attention us | hidden | hides from T |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("llama3_8b", "deepseek_v3"):
        for key, v in res[name]["prefill"].items():
            p, t = key.split("_")
            lines.append(
                f"| {name} | {p[1:]} | {t[1:]} | {v['gather_MB']:.1f} | {v['t_gather_us']:.0f} | "
                f"{v['t_attn_us']:.0f} | {v['hidden']} | {v['hide_from_tokens']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    r = model()
    if "--json" in sys.argv:
        print(json.dumps(r, indent=1))
    else:
        print(format_table(r))
