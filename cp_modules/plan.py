"""Print the rank layout, groups, head ownership and decode communication plan of a config.

    python -m cp_modules.plan --tp 4 --pcp 2 --dcp 4 [--dcp-comm-backend a2a]
        [--num-heads 32 --num-kv-heads 8] [--dp 1] [--pp 1] [--interleave 1 --block-size 16]
        [--json]

An invalid configuration exits with status 2 and the validation message on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cp_modules.config import ParallelConfig
from cp_modules.distributed.layout import comm_plan, head_range, rank_layout

__all__ = ["build_plan", "main"]


def build_plan(
    config: ParallelConfig, num_heads: int | None = None, num_kv_heads: int | None = None
) -> dict:
    """The planner's report as a JSON-serialisable dict (validates head counts if given)."""
    if num_heads is not None:
        config.validate_heads(num_heads, num_kv_heads)
    layout = rank_layout(config)
    plan = comm_plan(config)
    ranks = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        entry: dict[str, Any] = {"rank": r, **c, "dcp_group": layout.group_of("dcp", r)}
        entry["dcp_rank"] = sorted(entry["dcp_group"]).index(r)
        if num_heads is not None:
            entry["heads"] = list(head_range(num_heads, config.tp, c["tp"]))
            if num_kv_heads is not None:
                if num_kv_heads >= config.tp:
                    entry["kv_heads"] = list(head_range(num_kv_heads, config.tp, c["tp"]))
                else:
                    h = c["tp"] * num_kv_heads // config.tp
                    entry["kv_heads"] = [h, h + 1]
        ranks.append(entry)
    return {
        "config": {
            "tensor_parallel_size": config.tp,
            "prefill_context_parallel_size": config.pcp,
            "decode_context_parallel_size": config.dcp,
            "dcp_comm_backend": config.dcp_comm_backend,
            "dcp_kv_cache_interleave_size": config.interleave,
            "data_parallel_size": config.dp,
            "pipeline_parallel_size": config.pp,
            "world_size": config.world_size,
        },
        "tp_groups": layout.tp_groups,
        "pcp_groups": layout.pcp_groups,
        "dcp_groups": layout.dcp_groups,
        "partial_tp_groups": layout.partial_tp_groups,
        "dp_groups": layout.dp_groups,
        "ep_groups": layout.ep_groups,
        "query_gather": plan.query_gather,
        "query_gather_size": plan.query_gather_size,
        "query_gather_fraction": plan.query_gather_fraction,
        "query_gather_savings": plan.query_gather_savings,
        "reduce": plan.reduce,
        "ranks": ranks,
    }


def _format(report: dict) -> str:
    c = report["config"]
    lines = [
        f"world {c['world_size']} = dp {c['data_parallel_size']} x pp {c['pipeline_parallel_size']}"
        f" x pcp {c['prefill_context_parallel_size']} x tp {c['tensor_parallel_size']}; "
        f"dcp {c['decode_context_parallel_size']} ({c['dcp_comm_backend']}), "
        f"interleave {c['dcp_kv_cache_interleave_size']}",
        "",
    ]
    for key in (
        "tp_groups",
        "pcp_groups",
        "dcp_groups",
        "partial_tp_groups",
        "dp_groups",
        "ep_groups",
    ):
        lines.append(f"{key:<18} {report[key]}")
    lines += [
        "",
        "rank  dp pp pcp tp  dcp_group      dcp_rank  heads      kv_heads",
    ]
    for e in report["ranks"]:
        heads = "[{}, {})".format(*e["heads"]) if "heads" in e else "-"
        kv = "[{}, {})".format(*e["kv_heads"]) if "kv_heads" in e else "-"
        lines.append(
            f"{e['rank']:>4}  {e['dp']:>2} {e['pp']:>2} {e['pcp']:>3} {e['tp']:>2}  "
            f"{str(e['dcp_group']):<14} {e['dcp_rank']:>8}  {heads:<10} {kv}"
        )
    lines += [
        "",
        f"decode query all-gather: {report['query_gather']} (group size {report['query_gather_size']},"
        f" {report['query_gather_fraction']:.0%} of a full TP gather,"
        f" saves {report['query_gather_savings']:.0%})",
        f"decode output reduce:    {report['reduce']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cp_modules.plan", description=__doc__.split("\n")[0]
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dcp-comm-backend", default="ag_rs")
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        if a.num_kv_heads is not None and a.num_heads is None:
            raise ValueError("--num-kv-heads needs --num-heads")
        cfg = ParallelConfig(
            tensor_parallel_size=a.tp,
            prefill_context_parallel_size=a.pcp,
            decode_context_parallel_size=a.dcp,
            dcp_comm_backend=a.dcp_comm_backend,
            dcp_kv_cache_interleave_size=a.interleave,
            data_parallel_size=a.dp,
            pipeline_parallel_size=a.pp,
        )
        if a.block_size is not None:
            cfg.validate_block_size(a.block_size)
        report = build_plan(cfg, a.num_heads, a.num_kv_heads)
    except ValueError as e:
        print(f"invalid configuration: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report) if a.json else _format(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
