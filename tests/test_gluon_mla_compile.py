"""The Gluon MLA decode kernel compiled for sm_90 without a GPU (``tools/compile_gluon_mla.py``):
each way its tiles reach shared memory (``paged_decode_mla_gluon_parts``: copies issued by warp
group 0 inline or hoisted, by one producer warp, by two, by a cp.async warp group, by each
compute warp group, or a latent half at once: ``mla_gluon_halves``) and each
split merge inside the kernel (``paged_decode_mla_gluon_epilogue``: fused, spread) compiles,
with the partitions its schedule asks for, within the H200's shared memory per block; so does
the fp8 cache path (``mla_gluon_fp8``). Every case compiles the compute warp groups
(``mla_gluon_wg``), and the ``-sp`` (scale_p) schedules their pair schedule
(``mla_gluon_scale_p``). The GPU tier runs the same kernels against the reference
(``test_paged_decode.py``, ``test_mla_gluon_fp8.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")

from cp_modules.kernels.decode.mla_gluon_config import (  # noqa: E402
    GLUON_MLA_VARIANTS,
    default_gluon_mla_config,
)

SMEM_PER_BLOCK = 232448  # the H200's largest shared memory per block (227 KB)
ROOT = Path(__file__).resolve().parents[1]

# variant -> warp-specialized partitions besides warp group 0 (warp group 1, producer warps)
SCHEDULES = {"base": 1, "hoist": 1, "loader-r232": 2, "loader2-r232": 3, "loader-r232-fused": 2,
             "loader-r232-early": 2, "loader2-r232-early": 3, "cpasync-r232-early": 2,
             "loader2-r232-early-spread": 3, "loader2-r232-early-pz": 3,
             "loader-r232-early-pz": 2, "loader-r232-early-pz-sp": 2,
             "loader2-r232-early-pz-sp": 3, "loader-r232-early-pz-sp-refill": 2,
             "wg-early": 1, "loader-r232-early-halves": 2, "wg-early-halves": 1,
             "loader-r232-early-pz-halves": 2}  # fmt: skip
# The split path (partial results) where the schedule runs it: the in-kernel merges, and the
# default (loader-r232-early-pz), the former default (loader2-r232-early) and the scale_p
# schedule both ways.
CASES = [
    (name, page, partial)
    for name in SCHEDULES
    for page in (16, 64)
    for partial in (
        [True] if GLUON_MLA_VARIANTS[name].fused_merge or GLUON_MLA_VARIANTS[name].spread_merge
        else [False, True] if name in ("loader2-r232-early", "loader-r232-early-pz",
                                        "loader-r232-early-pz-sp")
        else [False]
    )
]  # fmt: skip

# The fp8 cache path (mla_gluon_fp8) of the default schedule: both block sizes, one split and
# several; its partitions: warp group 1, the producer warp, the conversion warp group.
FP8_CASES = [("loader-r232-early-pz", page, partial, True) for page in (16, 64)
             for partial in (False, True)]  # fmt: skip

_COMPILE = """
import json, re, sys
sys.path.insert(0, "tools")
from compile_gluon_mla import compile_sm90
out = []
for name, page, partial, *fp8 in json.loads(sys.argv[1]):
    k = compile_sm90(name, page, partial, fp8=bool(fp8 and fp8[0]))
    regs = re.search(r"requestedRegisters = array<i32: ([\\d, ]+)>", k.asm["ttgir"])
    out.append([k.metadata.shared, regs.group(1) if regs else None])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    """Every case compiled in one process without the Triton interpreter (the test session
    runs Triton kernels under it; a compile for sm_90 needs the real frontend)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(CASES + FP8_CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(zip(map(tuple, CASES + FP8_CASES), json.loads(done.stdout.splitlines()[-1])))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-bs{c[1]}-partial{int(c[2])}")
def test_each_copy_schedule_compiles_for_sm90_within_shared_memory(compiled, case):
    shared, regs = compiled[tuple(case)]
    assert shared <= SMEM_PER_BLOCK, shared
    assert regs is not None
    per_partition = [int(r) for r in re.split(r",\s*", regs)]
    name = case[0]
    assert len(per_partition) == SCHEDULES[name], per_partition
    assert per_partition[0] == GLUON_MLA_VARIANTS[name].wg1_regs


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"fp8-bs{c[1]}-partial{int(c[2])}")
def test_the_fp8_path_compiles_for_sm90_within_shared_memory(compiled, case):
    from cp_modules.kernels.decode.mla_gluon_config import FP8_CONVERT_REGS

    shared, regs = compiled[tuple(case)]
    assert shared <= SMEM_PER_BLOCK, shared
    cfg = GLUON_MLA_VARIANTS[case[0]]
    assert [int(r) for r in re.split(r",\s*", regs)] == [cfg.wg1_regs, cfg.loader_regs,
                                                           FP8_CONVERT_REGS]  # fmt: skip


def test_the_default_schedules_are_among_those_compiled():
    assert {default_gluon_mla_config(16), default_gluon_mla_config(64)} <= {
        GLUON_MLA_VARIANTS[n] for n in SCHEDULES
    }
