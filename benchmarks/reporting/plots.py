"""The report's PNG plots (decode bandwidth, PCP balance, roofline)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.reporting.common import (
    _decode_tbps,
)


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
