"""The report's Markdown page: the goals table and the sections that explain each row."""

from __future__ import annotations

from benchmarks import cost_model
from benchmarks.reporting.common import (
    GRAD_LAYOUTS,
    LAYER_DIMS,
    POLICY,
)
from cp_modules.ops.pcp_policy import segment_flop
from cp_modules.partition import plan_pcp


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
