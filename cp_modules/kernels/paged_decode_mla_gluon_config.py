"""Configuration of the Gluon MLA decode kernel: its schedule variants and what it serves.

Kept apart from the kernel (:mod:`cp_modules.kernels.paged_decode_mla_gluon`) so that the
choice can be made, and validated, without Triton's Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__ = [
    "GLUON_MLA_VARIANTS",
    "HAS_GLUON",
    "GluonMLAConfig",
    "default_gluon_mla_config",
    "gluon_mla_supported",
]

_HEADS = 64  # heads per program: the wgmma tile height
_TILE = 64  # tokens per latent tile
_PIECE = 64  # columns per TMA piece (128 bytes of bf16: the swizzle width)
_ISSUE_MODES = ("inline", "hoist", "loader")


@dataclass(frozen=True)
class GluonMLAConfig:
    """How the Gluon MLA kernel schedules its work (every variant computes the same thing).

    Attributes:
        issue: who issues the latent tile copies: ``"inline"`` (warp group 0, each block id
            looked up next to its copy: 36 dependent lookups per tile at block size 16),
            ``"hoist"`` (warp group 0, a tile's block ids looked up together before its
            copies) or ``"loader"`` (a third partition, one producer warp, issues Q and every
            tile as soon as both warp groups are done with its buffer; the compute warp groups
            issue nothing).
        peel: every pair of tiles but a split's last runs without the range mask and the
            row zeroing (and the branches around them, which make ptxas wait for in-flight
            products); the last pair runs the masked body.
        wg1_regs: registers per thread of warp group 1 (``setmaxnreg``).
        loader_regs: registers per thread of the producer warp (``issue="loader"``).
    """

    issue: str = "inline"
    peel: bool = False
    wg1_regs: int = 256
    loader_regs: int = 24

    def __post_init__(self):
        if self.issue not in _ISSUE_MODES:
            raise ValueError(
                f"GluonMLAConfig.issue must be one of {_ISSUE_MODES}, got {self.issue!r}"
            )

    def constexprs(self) -> dict:
        """The kernel's compile-time arguments for this configuration."""
        return {"ISSUE": _ISSUE_MODES.index(self.issue), "PEEL": self.peel,
                "WG1_REGS": self.wg1_regs, "LOADER_REGS": self.loader_regs}  # fmt: skip


# Named variants (the benchmark times each; the defaults below are picked from its sweep).
# With the producer warp the three partitions share 64K registers: warp group 0 gets what
# warp group 1 and the producer leave (wg1_regs 256 -> 224, 232 -> 248). The peeled variants
# spill ~1.6 KB under Triton 3.6 (the two loop bodies) and are not in the benchmark's default
# set.
GLUON_MLA_VARIANTS = {
    "base": GluonMLAConfig(),
    "hoist": GluonMLAConfig(issue="hoist"),
    "loader": GluonMLAConfig(issue="loader"),
    "loader-r232": GluonMLAConfig(issue="loader", wg1_regs=232),
    "hoist-peel": GluonMLAConfig(issue="hoist", peel=True),
    "loader-peel": GluonMLAConfig(issue="loader", peel=True),
}
# The default variant for blocks smaller than a 64-token tile (several copies per piece) and
# for the rest. Rule: from ``bench_mla_decode --gluon-only --variants ...``, per block size
# the variant whose checked rates have the highest geometric mean over the 128-head rows
# (none may be more than 3 % below the current default's on any row). The H200 sweep of
# 2026-12-01 (benchmarks/results/mla-decode-gluon-2026-12-01.json): loader-r232 for both
# (geometric mean 398 against 274 TFLOP/s at block size 16, 439 against 392 at 64).
_DEFAULT_SMALL_PAGE = "loader-r232"
_DEFAULT_LARGE_PAGE = "loader-r232"


def default_gluon_mla_config(block_size: int) -> GluonMLAConfig:
    """The configuration the kernel runs with when the caller names none."""
    return GLUON_MLA_VARIANTS[_DEFAULT_SMALL_PAGE if block_size < _TILE else _DEFAULT_LARGE_PAGE]


def gluon_mla_supported(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """None when the Gluon kernel serves these inputs, else why not (for the caller to say)."""
    if not HAS_GLUON:
        return "this Triton has no Gluon"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon MLA kernel needs an sm_90 (Hopper) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon MLA kernel takes bf16/fp16, got {q.dtype}"
    h, width = q.shape[1], q.shape[2]
    page = cache.shape[1]
    if h % _HEADS or kv_lora_rank != 512 or width != 576:
        return (
            f"the Gluon MLA kernel serves DeepSeek's shape (heads a multiple of 64, latent 512, "
            f"rope 64); got H={h}, R={kv_lora_rank}, row={width}"
        )
    if page & (page - 1) or not 8 <= page:
        return f"the Gluon MLA kernel needs a power-of-two block size >= 8, got {page}"
    if cache.stride(1) != width or cache.stride(0) != page * width:
        return "the Gluon MLA kernel needs a contiguous cache"
    return None
