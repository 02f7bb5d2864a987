#!/usr/bin/env python
"""Merge the latest benchmark results into one dated report: JSON, Markdown table, PNG plots.

    python -m benchmarks.report [--results benchmarks/results] [--out benchmarks]

Reads the newest ``<kind>-<date>.json`` of each kind in ``KINDS``, checks the goals the kernel
issues set, adds the collective cost model, and writes
``<out>/<date>-<gpu>.json`` ({"date","gpu","torch","triton","metrics"}), ``<date>-<gpu>.md`` and
plots (``<date>-<gpu>-decode.png``, ``-pcp.png``, ``-roofline.png``). Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import cost_model
from cp_modules.ops.pcp_policy import segment_flop
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy

HERE = Path(__file__).resolve().parent
# The switch points the "picked" columns apply: the defaults of the library.
POLICY = CPPolicy()

KINDS = (
    "lse_combine",
    "decode",
    "pcp",
    "modules",
    "ceilings",
    "pcp-grad-layout",
    "pcp-varlen",
    "modules-many",
    "pcp-new-shapes",
    "pcp-key-major",
    "mla-train-paths",
    "pcp-timeline",
    "mla-decode",
    "mla-decode-gluon",
    "parity",
    "masked",
)
# (query heads, Dqk, Dv) of bench_modules' layers, for their FLOPs per segment.
LAYER_DIMS = {
    "llama3_8b": (32, 128, 128),
    "deepseek_v3_mla": (128, 192, 128),
    "deepseek_v3_mla_32heads": (32, 192, 128),
}
GRAD_LAYOUTS = ("restored", "direct", "kernels")


# Kinds whose metrics are flat rows measured in parts (bench_parity --only engine re-measures
# the engine rows alone): each row comes from the newest file that holds it.
MERGED_KINDS = ("parity",)


def latest(results: Path) -> dict[str, dict]:
    found = {}
    for kind in KINDS:
        # Dated full runs only (not decode-quick-* or decode-mla-heads-* partial runs).
        files = sorted(results.glob(f"{kind}-[0-9]*.json"))
        if not files:
            continue
        found[kind] = json.loads(files[-1].read_text())
        found[kind]["_file"] = files[-1].name
        if kind in MERGED_KINDS and len(files) > 1:
            metrics: dict = {}
            used = []
            for f in files:
                rows = json.loads(f.read_text())["metrics"]
                if any(k not in metrics or metrics[k] != v for k, v in rows.items()):
                    used.append(f.name)
                metrics.update(rows)
            found[kind]["metrics"] = metrics
            found[kind]["_file"] = " + ".join(used)
    # A schedule sweep of the Gluon MLA kernel is superseded by a full MLA decode run of the
    # same day or later: that run's default Gluon rows carry the same summary names.
    full, sweep = found.get("mla-decode"), found.get("mla-decode-gluon")
    if full and sweep and full["date"] >= sweep["date"]:
        del found["mla-decode-gluon"]
    return found


def goals(r: dict) -> list[dict]:
    """Every goal of the kernel issues: measured value, target, met or short by how much."""
    out = []

    def add(name, value, target, higher_is_better=True, note=""):
        if value is None:
            out.append(dict(goal=name, value=None, target=target, met=False, note="not measured"))
            return
        met = value >= target if higher_is_better else value <= target
        short = (
            ""
            if met
            else (
                f"{(target / value - 1) * 100:.1f}% short"
                if higher_is_better
                else f"{(value / target - 1) * 100:.1f}% over"
            )
        )
        out.append(
            dict(goal=name, value=round(value, 3), target=target, met=met, note=note or short)
        )

    lc = r.get("lse_combine", {}).get("metrics", {})
    for d, tgt in ((512, 3400), (128, 2000)):
        vals = [lc.get(f"lse_combine_GBps_D{d}_N{n}") for n in (2, 4, 8)]
        vals = [v for v in vals if v is not None]
        add(f"a2a combine GB/s at D={d} (worst of N=2/4/8)", min(vals) if vals else None, tgt)
    pcp = r.get("pcp", {}).get("metrics", {})
    km = r.get("pcp-key-major", {}).get("metrics", {})
    for shape in ("mha-32k", "mha-128k", "gqa-32k", "mla-32k"):
        for p, v in pcp.get(shape, {}).get("pcp", {}).items():
            add(
                f"PCP balance fwd {shape} P={p} (worst rank / (dense/P))",
                v.get("fwd_ratio_worst"),
                1.05,
                False,
            )
            k = km.get(shape, {}).get("pcp", {}).get(str(p), {}) if shape.startswith("mla") else {}
            if "key_major_worst" in k:
                # MLA's training backward runs key-major (cp_modules.ops.cp_attention).
                value, target = k["key_major_worst"], 1.10
                add(
                    f"PCP speed bwd {shape} P={p} (key-major, MLA's training path)",
                    value,
                    target,
                    False,
                    note=f"query-major blocks: {v.get('bwd_ratio_worst', float('nan')):.3f}"
                    + ("" if value <= target else f"; {(value / target - 1) * 100:.1f}% over"),
                )
            else:
                add(f"PCP speed bwd {shape} P={p}", v.get("bwd_ratio_worst"), 1.10, False)
    dec = r.get("decode", {}).get("metrics", {}).get("shapes", {})
    for kind in ("gqa", "mla"):
        big = [
            x
            for x in dec.get(kind, {}).get("results", [])
            if x["batch"] * x["context"] >= 2**20 and "kv_tbps" in x
        ]
        if big:
            worst = min(big, key=_decode_tbps)
            note = ""
            if kind == "mla":
                note = (
                    "128 heads share each 576-wide latent row: ~242 FLOP per KV byte, above the "
                    "H200 ridge (~206), so this shape is compute-bound and its TB/s ceiling is "
                    "~ matmul rate / 242; measured with the Triton kernel, before the Gluon "
                    "kernel became MLA's default (its TFLOP/s rows below)"
                )
            add(
                f"paged decode {kind} KV TB/s (CUDA graph), worst with B*ctx >= 1M "
                f"(B={worst['batch']}, ctx={worst['context']})",
                _decode_tbps(worst),
                3.4,
                note=note,
            )
        b1 = [x for x in dec.get(kind, {}).get("results", []) if x["batch"] == 1 and "kv_tbps" in x]
        if b1:
            add(
                f"paged decode {kind} B=1 ctx={b1[-1]['context']} KV TB/s (CUDA graph)",
                _decode_tbps(b1[-1]),
                3.4,
                note=note if kind == "mla" else "",
            )
    mla = (
        (r.get("mla-decode-gluon") or r.get("mla-decode", {})).get("metrics", {}).get("summary", {})
    )
    for name, row in mla.items():
        if name.startswith("paged decode mla TFLOP/s (128 heads)"):
            target = 300 if "B=1 " in name else 450
            sizes = ", ".join(
                f"bs {bs}: {v['tflops']:.0f}" for bs, v in row.get("per_block_size", {}).items()
            )
            value = row.get("value")
            short = (
                ""
                if value is None or value >= target
                else f"; {(target / value - 1) * 100:.1f}% short"
            )
            add(
                name, value, target, note=f"worst block size; {sizes} ({row.get('variant')}){short}"
            )
    masked = r.get("masked", {}).get("metrics", {})
    for shape, row in masked.items():
        # The op's path each way, as the run recorded it (runs before the record: windows took
        # FlexAttention forward and FlashAttention-2 backward, soft-cap FlexAttention).
        paths = row.get("paths") or {
            "forward": "flex",
            "backward": "flash" if row.get("window") and not row.get("softcap") else "flex",
        }
        path = f"{paths['forward']} fwd + {paths['backward']} bwd"
        for p, entry in sorted(row.get("pcp", {}).items(), key=lambda kv: int(kv[0])):
            for kind, label in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
                ratio = entry.get(f"{kind}_ratio")
                base = entry.get(f"{kind}_baseline_ms", {})
                best = min(base, key=base.get) if base else "?"
                add(
                    f"masked PCP rank time / (single-GPU {best} / P) {shape} P={p} {label}",
                    ratio, 1.10, False, note=f"path: {path}",
                )  # fmt: skip
    par = r.get("parity", {}).get("metrics", {})
    for name in ("llama3-8b", "qwen2.5-7b", "deepseek-v3"):
        for what in ("prefill", "new-length prefill", "training"):
            key = f"one-GPU parity {what} {name} (CP / HF sdpa)"
            add(key, par.get(key), 1.02, False)
    for label, target in (("16x2048+128 bf16", 2.5), ("4 prompts fp32", 1.5)):
        key = f"engine vs HF generate tokens/s {label}"
        hf, compiled = par.get(f"HF generate {label} tokens/s"), par.get(f"{key} (engine compiled)")
        note = "" if hf is None else f"HF generate {hf:.0f} tokens/s in this run"
        if compiled is not None:
            note += f"; compile=True: {compiled:.2f}"
        value = par.get(key)
        if value is not None and value < target:
            note += f"; {(target / value - 1) * 100:.1f}% short"
        add(key, value, target, note=note)
    return out


def _decode_tbps(x: dict) -> float:
    """The kernel's own rate: CUDA-graph replay when measured (eager adds ~0.1 ms of launch)."""
    return x.get("graph_kv_tbps", x["kv_tbps"])


def flat_metrics(r: dict) -> dict:
    m = {}
    lc = r.get("lse_combine", {}).get("metrics", {})
    for k, v in lc.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            m[k] = v
    for shape, sv in r.get("pcp", {}).get("metrics", {}).items():
        for p, v in sv.get("pcp", {}).items():
            for key in ("fwd_ratio_worst", "bwd_ratio_worst", "peak_mib_worst_rank"):
                if key in v:
                    m[f"pcp_{shape}_P{p}_{key}"] = v[key]
    for kind, sv in r.get("decode", {}).get("metrics", {}).get("shapes", {}).items():
        for x in sv.get("results", []):
            if "kv_tbps" in x:
                m[f"decode_{kind}_B{x['batch']}_ctx{x['context'] // 1024}k_TBps"] = x["kv_tbps"]
            if "graph_kv_tbps" in x:
                m[f"decode_{kind}_B{x['batch']}_ctx{x['context'] // 1024}k_graph_TBps"] = x[
                    "graph_kv_tbps"
                ]
    for x in r.get("decode", {}).get("metrics", {}).get("mla_heads", []):
        if "graph_kv_tbps" in x:
            m[f"decode_mla_H{x['heads']}_B{x['batch']}_ctx{x['context'] // 1024}k_graph_TBps"] = x[
                "graph_kv_tbps"
            ]
    for k, v in r.get("modules", {}).get("metrics", {}).items():
        m[f"module_{k}"] = v
    for shape, sv in r.get("pcp-grad-layout", {}).get("shapes", {}).items():
        for p, e in sv.items():
            for key in GRAD_LAYOUTS:
                m[f"pcp_train_{shape}_P{p}_{key}_bwd_ratio_worst"] = e[key]["worst"]
    ce = r.get("ceilings", {}).get("metrics", {})
    for k in ("copy_TBps", "matmul_bf16_TFLOPs"):
        if k in ce:
            m[f"ceiling_{k}"] = ce[k]
    return m


def plots(r: dict, stem: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    copy = (
        r.get("ceilings", {}).get("metrics", {}).get("copy_TBps")
        or r.get("lse_combine", {}).get("metrics", {}).get("copy_GBps", 4200) / 1e3
    )
    dec = r.get("decode", {}).get("metrics", {}).get("shapes", {})
    if dec:
        fig, axes = plt.subplots(1, len(dec), figsize=(6 * len(dec), 4))
        axes = axes if len(dec) > 1 else [axes]
        for ax, (kind, sv) in zip(axes, dec.items()):
            by_b: dict[int, list] = {}
            for x in sv.get("results", []):
                if "kv_tbps" in x:
                    by_b.setdefault(x["batch"], []).append((x["context"], _decode_tbps(x)))
            for b, pts in sorted(by_b.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"B={b}")
            ax.axhline(copy, color="k", ls="--", label=f"copy {copy:.2f} TB/s")
            ax.axhline(3.4, color="r", ls=":", label="goal 3.4 TB/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("KV read TB/s (CUDA-graph replay)")
            ax.set_title(f"paged decode, {kind}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{stem}-decode.png", dpi=90)
        made.append(f"{stem.name}-decode.png")
    # The shapes (older results also hold other entries).
    pcp = {k: v for k, v in r.get("pcp", {}).get("metrics", {}).items() if "pcp" in v}
    if pcp:
        fig, ax = plt.subplots(figsize=(7, 4))
        for shape, sv in pcp.items():
            ps = sorted(int(p) for p in sv.get("pcp", {}))
            ax.plot(
                ps,
                [sv["pcp"][str(p)]["fwd_ratio_worst"] for p in ps],
                marker="o",
                label=f"{shape} fwd",
            )
            ax.plot(
                ps,
                [sv["pcp"][str(p)]["bwd_ratio_worst"] for p in ps],
                marker="x",
                ls="--",
                label=f"{shape} bwd",
            )
        ax.axhline(1.05, color="r", ls=":", label="fwd goal 1.05")
        ax.axhline(1.10, color="m", ls=":", label="bwd goal 1.10")
        ax.set_xlabel("P (PCP ranks)")
        ax.set_ylabel("worst rank time / (dense time / P)")
        ax.set_title("PCP head/tail per-rank balance")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{stem}-pcp.png", dpi=90)
        made.append(f"{stem.name}-pcp.png")
    lc = r.get("lse_combine", {}).get("metrics", {})
    if lc:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels, vals = [], []
        for d in (128, 512):
            for n in (2, 4, 8):
                for kind in ("lse_combine", "lse_combine_packed", "correct_attn_out"):
                    v = lc.get(f"{kind}_GBps_D{d}_N{n}")
                    if v is not None:
                        labels.append(
                            f"{kind.replace('lse_combine', 'comb').replace('correct_attn_out', 'corr')}\nD{d} N{n}"
                        )
                        vals.append(v / 1e3)
        ax.bar(range(len(vals)), vals)
        ax.axhline(copy, color="k", ls="--", label=f"copy roofline {copy:.2f} TB/s")
        ax.set_xticks(range(len(vals)), labels, fontsize=5, rotation=90)
        ax.set_ylabel("TB/s (bytes read + written)")
        ax.set_title("memory-bound kernels vs the copy roofline")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{stem}-roofline.png", dpi=90)
        made.append(f"{stem.name}-roofline.png")
    return made


def markdown(r: dict, g: list[dict], cm: dict, pngs: list[str], head: dict) -> str:
    lines = [
        f"# Benchmark report {head['date']} — {head['gpu']}",
        "",
        f"torch {head['torch']}, triton {head['triton']}. Sources: "
        + ", ".join(v["_file"] for v in r.values()),
        "",
        "## Goals",
        "",
        "| goal | measured | target | met | note |",
        "|---|---|---|---|---|",
    ]
    for x in g:
        lines.append(
            f"| {x['goal']} | {x['value']} | {x['target']} | {'yes' if x['met'] else 'NO'} | {x['note']} |"
        )
    pcp = {k: v for k, v in r.get("pcp", {}).get("metrics", {}).items() if "pcp" in v}
    if pcp:
        lines += [
            "",
            "## PCP, one long sequence: every rank (bf16)",
            "",
            "Worst / mean rank time / (dense causal time / P), dense and rank timings "
            "alternating in one process; peak: MiB a rank allocates for its forward and "
            "backward above its inputs (worst rank), against the dense layer's.",
            "",
            "| shape | P | fwd worst / mean | bwd worst / mean | peak rank / dense (MiB) |",
            "|---|---|---|---|---|",
        ]
        for shape, sv in pcp.items():
            for p, e in sv["pcp"].items():
                if "fwd_ratio_worst" not in e:
                    continue
                lines.append(
                    f"| {shape} | {p} | {e['fwd_ratio_worst']:.3f} / {e['fwd_ratio_mean']:.3f} | "
                    f"{e['bwd_ratio_worst']:.3f} / {e['bwd_ratio_mean']:.3f} | "
                    f"{e['peak_mib_worst_rank']:.0f} / {sv.get('dense_peak_mib', float('nan')):.0f} |"
                )
        lines += [""] + [f"Note: {n}." for n in r["pcp"].get("notes", [])]
    km = r.get("pcp-key-major", {}).get("metrics", {})
    if km:
        lines += [
            "",
            "## PCP backward by key chunks against the current one (one rank at a time, bf16)",
            "",
            "Worst / mean rank time / (dense backward / P) for the key-major backward "
            "(bench_pcp key-major: a rank's own key chunks against every later query, one "
            "tall causal call each) and the current query-major one, in one process; bytes a "
            "token moves over the PCP group in the backward for each.",
            "",
            "| shape | P | key-major | query-major | bytes/token key / query |",
            "|---|---|---|---|---|",
        ]
        for shape, sv in km.items():
            b = sv.get("bytes_per_token", {})
            for p, e in sv.get("pcp", {}).items():
                if "key_major_worst" not in e:
                    continue
                lines.append(
                    f"| {shape} | {p} | {e['key_major_worst']:.3f} / {e['key_major_mean']:.3f} | "
                    f"{e['query_major_worst']:.3f} / {e['query_major_mean']:.3f} | "
                    f"{b.get('key_major')} / {b.get('query_major')} |"
                )
    mt = r.get("mla-train-paths", {}).get("metrics", {})
    if mt:
        lines += [
            "",
            "## MLA layer training step on several GPUs: key-major against query-major backward (bf16)",
            "",
            "bench_modules --train-paths: DeepSeek-V3 MLA layer with 32 heads, one sequence split by "
            "PCP over the GPUs (NCCL), forward + backward with every collective; slowest rank, "
            "medians; peak memory above the inputs; gradients of both paths compared (weights "
            "summed over ranks).",
            "",
            "| case | query-major ms | key-major ms | speed-up | peak MiB query / key | grad rel diff |",
            "|---|---|---|---|---|---|",
        ]
        for case, e in mt.items():
            ms, pk = e["step_ms_slowest_rank"], e["peak_mib_worst_rank"]
            lines.append(
                f"| {case} | {ms['query_major']:.2f} | {ms['key_major']:.2f} | "
                f"{e['key_major_speedup']:.3f} | {pk['query_major']:.0f} / {pk['key_major']:.0f} | "
                f"{e['grad_rel_diff']:.1e} |"
            )
        lines += [""] + [f"Note: {n}." for n in r["mla-train-paths"].get("notes", [])]
    tl = r.get("pcp-timeline", {}).get("metrics", {})
    if tl:
        lines += [
            "",
            "## Where a PCP rank's time goes (steady state, bf16)",
            "",
            "bench_pcp timeline: a rank's call in do_bench's pattern under the profiler; "
            "ratios over dense / P. Busy: the union of all kernels on all streams; idle: the "
            "rest of the call's GPU span. MLA's backward is its key-major training path.",
            "",
            "| shape | case | do_bench | busy | idle us | cuDNN attention | dO·O + dQ convert | "
            "sums, copies, fills | LSE merge |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for shape, sv in tl.items():
            for case, e in sv.get("pcp", {}).items():
                c = e["class_ratio"]
                per_row = c.get("cudnn_dO_dot_O", 0) + c.get("cudnn_dq_convert", 0)
                assembly = c.get("gradient_sum", 0) + c.get("copy", 0) + c.get("fill", 0)
                lines.append(
                    f"| {shape} | {case} | {e['do_bench_ratio']:.3f} | {e['busy_ratio']:.3f} | "
                    f"{e['idle_us']:.0f} | {c.get('cudnn_attention', 0):.3f} | {per_row:.3f} | "
                    f"{assembly:.3f} | {c.get('lse_merge', 0):.3f} |"
                )
    heads = r.get("decode", {}).get("metrics", {}).get("mla_heads", [])
    if heads:
        lines += [
            "",
            "## MLA decode by query heads per GPU (bf16, CUDA graph)",
            "",
            "128 heads (the goal rows) are compute-bound; DeepSeek's heads split by tensor "
            "parallelism are not. FLOP per KV byte against the H200's ridge (~206).",
            "",
            "| heads | B | context | splits | FLOP/byte | TB/s | TFLOP/s |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {x['heads']} | {x['batch']} | {x['context']} | {x['num_splits']} | "
            f"{x['flop_per_kv_byte']:.0f} | {x['graph_kv_tbps']:.2f} | {x['graph_tflops']:.0f} |"
            for x in heads
            if "graph_kv_tbps" in x
        ]
    mod = r.get("modules", {}).get("metrics", {})
    if mod:
        lines += [
            "",
            "## One attention layer (one rank, bf16)",
            "",
            "| metric | value |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v:.4g} |" for k, v in mod.items()]
    gl = r.get("pcp-grad-layout", {}).get("shapes", {})
    if gl:
        lines += [
            "",
            "## PCP training backward: K/V gradients for the reduce-scatter (one rank at a time, bf16)",
            "",
            "Worst / mean rank time / (dense backward / P). restored: gradients in restored order, "
            "then index-copied into the all-gathered buffer (the former path); direct: summed "
            "straight into it (the current path for long sequences); kernels: the kernel "
            "function alone, as bench_pcp times it (a separate run from the goal rows; the same code "
            "moves by 2-3 % between processes).",
            "",
            "| shape | P | " + " | ".join(GRAD_LAYOUTS) + " |",
            "|---|---|---|---|---|",
        ]
        for shape, sv in gl.items():
            for p, e in sv.items():
                lines.append(
                    f"| {shape} | {p} | "
                    + " | ".join(f"{e[k]['worst']:.3f} / {e[k]['mean']:.3f}" for k in GRAD_LAYOUTS)
                    + " |"
                )
    vl = r.get("pcp-varlen", {}).get("runs", [])
    if vl:
        lines += [
            "",
            "## PCP with many requests: blocks against one varlen call (one rank at a time, bf16)",
            "",
            "Worst of the first and last rank, ms (triton do_bench; a host-bound path is timed at its "
            "launch rate). FLOP/seg: mean forward FLOPs per segment, which picks the path "
            "(CPPolicy.varlen_max_flop_per_segment, docs/switch-points.md); picked: the "
            "automatic choice's time over the better of the two, for a plan whose shapes an "
            "earlier plan had (a plan of new shapes first rents the varlen call: see the "
            "new-lengths table).",
            "",
            "| shape | P | requests x tokens | FLOP/seg | fwd blocks / varlen | bwd blocks / varlen | picked fwd / bwd |",
            "|---|---|---|---|---|---|---|",
        ]
        shapes = r["pcp-varlen"]["shapes"]
        for x in vl:
            w, f = x["worst_ms"], x["ranks"][0]["flop_per_segment"]
            dims = (shapes[x["shape"]]["Dqk"], shapes[x["shape"]]["Dv"])
            pick = []
            for d in ("fwd", "bwd"):
                limit = POLICY.varlen_limit("forward" if d == "fwd" else "backward", *dims)
                path = "varlen" if limit is not None and f < limit else "blocks"
                pick.append(
                    f"{path} {w[f'{path}_{d}'] / min(w[f'blocks_{d}'], w[f'varlen_{d}']):.2f}"
                )
            pre = f" + {x['prefix']} cached" if x.get("prefix") else ""
            lines.append(
                f"| {x['shape']} | {x['P']} | {x['R']} x {x['L']}{pre} | {f:.1e} | "
                f"{w['blocks_fwd']:.2f} / {w['varlen_fwd']:.2f} | "
                f"{w['blocks_bwd']:.2f} / {w['varlen_bwd']:.2f} | {' / '.join(pick)} |"
            )
    mm = r.get("modules-many", {}).get("metrics", {})
    if mm:
        lines += [
            "",
            "## Whole layers with many prompts: blocks against one varlen call (one rank, P = 1, forward, bf16)",
            "",
            "bench_modules --many-only: one attention layer (projections included), eager, ms; "
            "auto: the automatic choice as run, picked: the path it takes and its time over the "
            "better of the two.",
            "",
            "| layer | requests x tokens | FLOP/seg | blocks | varlen | auto | picked |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, (heads, dqk, dv) in LAYER_DIMS.items():
            for key in sorted(
                (
                    k
                    for k in mm
                    if k.startswith(f"{name}_prefill_") and k.endswith("_blocks_eager_ms")
                ),
                key=lambda k: -int(k.split("_prefill_")[1].split("x")[0]),
            ):
                stem = key[: -len("blocks_eager_ms")]
                shape = stem.split("_prefill_")[1].rstrip("_")
                if not shape[0].isdigit() or stem.split("_prefill_")[0] != name:
                    continue
                b, n = (int(x) for x in shape.split("x"))
                plan = plan_pcp([n] * b, [0] * b, 1, 0)
                flop = segment_flop(
                    [x for x in plan.segments_host.tolist() if x[2]], heads, dqk, dv
                )
                f = sum(flop) / len(flop)
                t = {p: mm[f"{stem}{p}_eager_ms"] for p in ("blocks", "varlen", "auto")}
                limit = POLICY.varlen_limit("forward", dqk, dv)
                path = "varlen" if limit is not None and f < limit else "blocks"
                lines.append(
                    f"| {name} | {b} x {n} | {f:.1e} | {t['blocks']:.2f} | {t['varlen']:.2f} | "
                    f"{t['auto']:.2f} | {path} {t[path] / min(t['blocks'], t['varlen']):.2f} |"
                )
    ns = r.get("pcp-new-shapes", {}).get("runs", [])
    if ns:
        lines += [
            "",
            "## PCP prompts of new lengths: the first call against the next (one rank, bf16)",
            "",
            "bench_pcp new-shapes: single prompts of random new lengths (12k-30k tokens), the "
            "last rank's first and second call, medians over the prompts, ms. cuDNN builds a plan "
            "per new block shape; the automatic choice rents the varlen path meanwhile "
            "(CPPolicy.cudnn_build_s, docs/switch-points.md).",
            "",
            "| shape | P | path | fwd first / second | bwd first / second |",
            "|---|---|---|---|---|",
        ]
        for x in ns:
            med = {}
            for c in ("first", "second"):
                for d in ("fwd", "bwd"):
                    vals = sorted(run[c][f"{d}_ms"] for run in x["calls"])
                    med[c, d] = (vals[(len(vals) - 1) // 2] + vals[len(vals) // 2]) / 2
            lines.append(
                f"| {x['shape']} | {x['P']} | {x['path']} | {med['first', 'fwd']:.1f} / "
                f"{med['second', 'fwd']:.2f} | {med['first', 'bwd']:.1f} / {med['second', 'bwd']:.2f} |"
            )
    ce = r.get("ceilings", {}).get("metrics", {})
    if ce:
        lines += [
            "",
            "## Ceilings and dense prefill kernels (same run)",
            "",
            f"copy {ce.get('copy_TBps', 0):.2f} TB/s, bf16 matmul {ce.get('matmul_bf16_TFLOPs', 0):.0f} TFLOP/s",
            "",
            "| shape | backend | fwd TFLOP/s | bwd TFLOP/s |",
            "|---|---|---|---|",
        ]
        for shape, v in ce.items():
            if isinstance(v, dict):
                for b in ("cudnn", "flash", "efficient"):
                    x = v.get(b, {})
                    if "fwd_tflops" in x:
                        lines.append(
                            f"| {shape} | {b}{' (best fwd)' if v.get('best_fwd') == b else ''} | "
                            f"{x['fwd_tflops']:.0f} | {x['bwd_tflops']:.0f} |"
                        )
                    elif "error" in x:
                        lines.append(f"| {shape} | {b} | no kernel | |")
    lines += [
        "",
        "## Collective cost model (not measured: one GPU cannot time NCCL)",
        "",
        "alpha = 8 us a collective (CUDA graph) / 20 us (eager), beta = 370 GB/s per rank.",
        "",
        cost_model.format_table(cm),
        "",
    ]
    for name in ("llama3_8b", "deepseek_v3"):
        be = cm[name]["break_even_tokens"]
        lines.append(
            f"- {name}: DCP break-even B*S (packed a2a / ag_rs): "
            + ", ".join(
                f"N={k[1:]}: {v['a2a_packed']:.0f} / {v['ag_rs']:.0f}" for k, v in be.items()
            )
        )
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument("--out", default=str(HERE))
    a = ap.parse_args(argv)
    r = latest(Path(a.results))
    if not r:
        print(f"no results under {a.results}", file=sys.stderr)
        return 1
    any_r = next(iter(r.values()))
    dates = sorted(v["date"] for v in r.values())
    head = dict(date=dates[-1], gpu=any_r["gpu"], torch=any_r["torch"], triton=any_r["triton"])
    g = goals(r)
    cm = cost_model.model()
    stem = Path(a.out) / f"{head['date']}-{head['gpu'].replace(' ', '_')}"
    pngs = plots(r, stem)
    report = dict(
        head,
        metrics=flat_metrics(r),
        goals=g,
        cost_model=cm,
        sources={k: v["_file"] for k, v in r.items()},
    )
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1))
    Path(f"{stem}.md").write_text(markdown(r, g, cm, pngs, head))
    print(f"wrote {stem}.json, {stem}.md, {len(pngs)} plots")
    missed = [x["goal"] for x in g if not x["met"]]
    print(
        f"{len(g) - len(missed)} of {len(g)} goals met"
        + (": missed " + "; ".join(missed) if missed else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
