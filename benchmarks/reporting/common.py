"""What the report reads: the result kinds, the layer shapes of the cost model, and the flat metrics of a merged result."""

from __future__ import annotations

from cp_modules.policy import CPPolicy

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
