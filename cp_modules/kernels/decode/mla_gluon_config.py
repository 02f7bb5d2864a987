"""Configuration of the Gluon MLA decode kernel: its schedule variants and what it serves.

Kept apart from the kernel (:mod:`cp_modules.kernels.decode.mla_gluon`) so that the
choice can be made, and validated, without Triton's Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_modules.kernels.decode.arrival_counters import (  # noqa: F401 (re-exported)
    _counters,
    _retired_counters,
    merge_counters,
    reserve_merge_counters,
)
from cp_modules.kernels.decode.mla import _MLA_MAX_SPLITS as _MAX_SPLITS

try:
    import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__ = [
    "GLUON_MLA_VARIANTS",
    "HAS_GLUON",
    "MLA_FP8_GLUON",
    "GluonMLAConfig",
    "check_trace_buffer",
    "choose_gluon_mla_num_splits",
    "default_gluon_mla_config",
    "gluon_mla_fp8_supported",
    "gluon_mla_supported",
    "merge_counters",
    "reserve_merge_counters",
]

_HEADS = 64  # heads per program: the wgmma tile height
_TILE = 64  # tokens per latent tile
_PIECE = 64  # columns per TMA piece (128 bytes of bf16: the swizzle width)
_SPREAD_MAX_SPLITS = 8  # the spread merge hands out the 8 column blocks of 64
_ISSUE_MODES = ("inline", "hoist", "loader", "loader2", "cpasync", "wg")


@dataclass(frozen=True)
class GluonMLAConfig:
    """How the Gluon MLA kernel schedules its work (every variant computes the same thing).

    Attributes:
        issue: who issues the latent tile copies: ``"inline"`` (warp group 0, each block id
            looked up next to its copy: 36 dependent lookups per tile at block size 16),
            ``"hoist"`` (warp group 0, a tile's block ids looked up together before its
            copies) or ``"loader"`` (a third partition, one producer warp, issues Q and every
            tile as soon as both warp groups are done with its buffer; the compute warp groups
            issue nothing); ``"loader2"``: two producer warps, each issuing about half of every
            tile's pieces (the first also Q); ``"cpasync"``: a producer warp group (4 warps)
            issues Q by TMA and copies the tiles with cp.async, each thread 16 bytes of 4 rows
            per piece (9 copy instructions a thread per tile at any block size), with
            ``early_release`` only; ``"wg"`` (with ``early_release`` only): no producer, warp
            group 0 issues Q and the first two tiles, then each compute warp group copies the
            next tile's parts that it uses last (the rope piece of its tile, its latent half)
            as soon as its product on them completes (FlashMLA's copies: no free barrier and
            no producer wake-up between a part's release and its refill).
        peel: every pair of tiles but a split's last runs without the range mask and the
            row zeroing (and the branches around them, which make ptxas wait for in-flight
            products); the last pair runs the masked body.
        wg1_regs: registers per thread of warp group 1 (``setmaxnreg``).
        loader_regs: registers per thread of the producer warps (``loader``, ``loader2``,
            ``cpasync``).
        fused_merge: with several KV splits, the program that finishes last for a (query,
            head tile) merges the splits' fp32 partials into the result itself (an arrival
            counter per (query, head tile) in a per-device workspace), instead of a separate
            merge launch.
        merge_own_from_registers: with ``fused_merge``, the last program takes its own split
            from its registers instead of reading back the partial it just wrote (1/S less of
            the merge's reads) and adds it first; the result's last bits then depend on which
            split finished last. Off: every split is read back in split order, and every run
            gives the same bits.
        fused_max_splits: the fused merge serves at most this many splits (the last program
            reads every other split's partial alone, so its tail grows with the count); more
            splits take the separate merge launch. Only with ``fused_merge``.
        spread_merge: with 2 to 8 KV splits and every program resident at once (at most one
            per SM: the launch is cooperative, so a grid that cannot all be resident fails
            instead of waiting forever), the row's programs wait for each other after storing
            their partials, and program s merges the 64-column blocks c = s (mod S) of its row
            (reading every split's partial of them from L2), instead of a separate merge
            launch. Every split is read in split order: the same bits on every run. Other
            launches take the separate merge. Not with ``fused_merge``.
        split_cost_tiles: the split chooser's fixed cost of one split program, in 64-token
            tiles (``None``: the Triton kernel's, ``paged_decode_mla._SPLIT_COST_TILES``).
        merge_tiles_per_split: the split chooser's cost of the last program's merge per extra
            split, in tiles, added once per (query, head tile) (0: not modelled).
        max_box_rows: rows of one TMA copy at most (a page's rows, up to a 64-token tile, by
            default): 16 makes a 64-token page take the copies of block size 16.
        early_release: (producer warps, or ``issue="wg"``) a tile buffer is freed in three parts, each by
            the warp group that uses it last: the rope piece after the tile's scores, each
            256-column latent half after its P @ V; the producers refill each part as soon as
            it is free and the scores take the pieces in that order (rope, then the half freed
            first). Off: a buffer is refilled once both warp groups are done with all of it.
        producer_zeroing: (TMA producer warps with ``early_release``) the rows past the
            range in a split's last tiles are zeroed by the producer warps once the tile has
            landed, before the consumers are told it is ready; the consumer warp groups then
            never branch on the range (off: each warp group zeroes the rows before its P @ V,
            behind a branch in every pair).
        scale_p: (with ``producer_zeroing``, not ``peel``) warp group 1 takes tile B's softmax
            from tile A's running max as soon as warp group 0 publishes it, and warp group 0
            rescales P_A to tile B's max before handing it over, so each output half is
            rescaled only with none of its products in flight and warp group 1's softmax runs
            under warp group 0's P @ V (FlashMLA's order; :mod:`~cp_modules.kernels.decode.
            mla_gluon_scale_p`). Off: warp group 1 adds P_A V_A before its softmax of tile B.
            Measured slower than the default on the H200 (2026-12-03).
        sp_refill: (with ``scale_p``) the producer refills a pair's parts in the order
            ``scale_p`` frees them (A's rope, B's rope, A's half [0, 256), B's [256, 512), A's
            [256, 512), B's [0, 256)) instead of all of tile A's, then tile B's, so that B's
            early-freed parts do not wait behind A's last one. Not yet run on a GPU.
        half_copies: (``early_release`` with one TMA producer warp, which may zero the rows
            past the range, or with ``issue="wg"``) each 256-column latent half of a tile
            lands as one copy per box of rows (a rank-3 view of the cache, [piece, row,
            column]) on one barrier: 3 copies and 3 barrier waits a 64-token tile instead of
            9 (:mod:`~cp_modules.kernels.decode.mla_gluon_halves`). Not yet run on a GPU.
    """

    issue: str = "inline"
    peel: bool = False
    wg1_regs: int = 256
    loader_regs: int = 24
    fused_merge: bool = False
    fused_max_splits: int = _MAX_SPLITS
    merge_own_from_registers: bool = False
    spread_merge: bool = False
    split_cost_tiles: float | None = None
    merge_tiles_per_split: float = 0.0
    max_box_rows: int = 64
    early_release: bool = False
    producer_zeroing: bool = False
    scale_p: bool = False
    sp_refill: bool = False
    half_copies: bool = False

    def __post_init__(self):
        if self.issue not in _ISSUE_MODES:
            raise ValueError(
                f"GluonMLAConfig.issue must be one of {_ISSUE_MODES}, got {self.issue!r}"
            )
        if not 2 <= self.fused_max_splits <= _MAX_SPLITS:
            raise ValueError(
                f"GluonMLAConfig.fused_max_splits must be in [2, {_MAX_SPLITS}], "
                f"got {self.fused_max_splits}"
            )
        if self.split_cost_tiles is not None and not self.split_cost_tiles >= 0:
            raise ValueError(
                f"GluonMLAConfig.split_cost_tiles must be None or >= 0, got {self.split_cost_tiles}"
            )
        if self.max_box_rows not in (8, 16, 32, 64):
            raise ValueError(
                f"GluonMLAConfig.max_box_rows must be 8, 16, 32 or 64, got {self.max_box_rows}"
            )
        if self.early_release and self.issue not in ("loader", "loader2", "cpasync", "wg"):
            raise ValueError(
                "GluonMLAConfig.early_release needs producer warps (issue 'loader', 'loader2' "
                f"or 'cpasync') or issue 'wg', got issue={self.issue!r}"
            )
        if self.producer_zeroing and not (
            self.early_release and self.issue in ("loader", "loader2")
        ):
            raise ValueError(
                "GluonMLAConfig.producer_zeroing needs TMA producer warps with early_release "
                f"(issue 'loader' or 'loader2'), got issue={self.issue!r}, "
                f"early_release={self.early_release}"
            )
        if self.scale_p and (
            not self.producer_zeroing or self.peel or self.fused_merge or self.spread_merge
        ):
            raise ValueError(
                "GluonMLAConfig.scale_p needs producer_zeroing, no peel and the separate "
                f"merge, got producer_zeroing={self.producer_zeroing}, peel={self.peel}, "
                f"fused_merge={self.fused_merge}, spread_merge={self.spread_merge}"
            )
        if self.sp_refill and not self.scale_p:
            raise ValueError("GluonMLAConfig.sp_refill needs scale_p")
        if self.half_copies and not (
            self.early_release and self.issue in ("loader", "wg") and not self.scale_p
        ):
            raise ValueError(
                "GluonMLAConfig.half_copies needs early_release with issue 'loader' or 'wg' and "
                f"no scale_p, got issue={self.issue!r}, early_release={self.early_release}, "
                f"scale_p={self.scale_p}"
            )
        if self.issue in ("cpasync", "wg") and not self.early_release:
            raise ValueError(
                f"GluonMLAConfig.issue={self.issue!r} is built with early_release=True only"
            )
        if self.spread_merge and self.fused_merge:
            raise ValueError("GluonMLAConfig.spread_merge and fused_merge exclude each other")
        if not self.merge_tiles_per_split >= 0:
            raise ValueError(
                "GluonMLAConfig.merge_tiles_per_split must be >= 0, got "
                f"{self.merge_tiles_per_split}"
            )

    def fuses_merge(self, num_splits: int) -> bool:
        """Whether a launch with ``num_splits`` splits merges them in the kernel."""
        return self.fused_merge and 1 < num_splits <= self.fused_max_splits

    def spreads_merge(self, num_splits: int, num_programs: int, num_sms: int) -> bool:
        """Whether a launch of ``num_programs`` programs (rows x splits) merges its splits
        spread over the row's programs (all resident: one per SM at most)."""
        return (self.spread_merge and 1 < num_splits <= _SPREAD_MAX_SPLITS
                and num_programs <= num_sms)  # fmt: skip

    def constexprs(self, num_splits: int = 1, spread: bool = False) -> dict:
        """The kernel's compile-time arguments for this configuration and split count
        (``spread``: :meth:`spreads_merge` holds for the launch)."""
        return {"ISSUE": _ISSUE_MODES.index(self.issue), "PEEL": self.peel,
                "WG1_REGS": self.wg1_regs, "LOADER_REGS": self.loader_regs,
                "FUSED": self.fuses_merge(num_splits),
                "OWN_REGS": self.fuses_merge(num_splits) and self.merge_own_from_registers,
                "EARLY": self.early_release, "SPREAD": spread,
                "PZERO": self.producer_zeroing, "SCALE_P": self.scale_p, "SP_REFILL": self.sp_refill,
                "HALVES": self.half_copies}  # fmt: skip


def _fused(**kw) -> GluonMLAConfig:
    """``loader-r232`` with the split merge in the kernel (the fused variants' common base)."""
    base = {"issue": "loader", "wg1_regs": 232, "fused_merge": True, "split_cost_tiles": 3,
            "merge_tiles_per_split": 0.25}  # fmt: skip
    return GluonMLAConfig(**{**base, **kw})


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
    # Two producer warps share each tile's copies (36 per tile at block size 16). Three were
    # no faster, four slower (more spills): docs/experiments/2026-12-01-mla-decode-gluon-schedules.md
    "loader2-r232": GluonMLAConfig(issue="loader2", wg1_regs=232),
    # loader-r232 with copies of 16 rows at any block size: what the copy count alone costs.
    "loader-r232-box16": GluonMLAConfig(issue="loader", wg1_regs=232, max_box_rows=16),
    # Each buffer refilled in three parts as each is freed (rope, then the latent halves).
    "loader-r232-early": GluonMLAConfig(issue="loader", wg1_regs=232, early_release=True),
    "loader2-r232-early": GluonMLAConfig(issue="loader2", wg1_regs=232, early_release=True),
    # The rows past the range zeroed by the producers: no branch in the consumers' pairs.
    "loader2-r232-early-pz": GluonMLAConfig(
        issue="loader2", wg1_regs=232, early_release=True, producer_zeroing=True
    ),
    "loader-r232-early-pz": GluonMLAConfig(
        issue="loader", wg1_regs=232, early_release=True, producer_zeroing=True
    ),
    # Tile B's softmax from tile A's max, P_A rescaled to tile B's by warp group 0: each
    # output half rescaled with none of its products in flight (FlashMLA's order of work).
    # Measured slower than loader-r232-early-pz (2026-12-03, docs/experiments/2026-12-02-peers.md).
    "loader-r232-early-pz-sp": GluonMLAConfig(
        issue="loader", wg1_regs=232, early_release=True, producer_zeroing=True, scale_p=True
    ),
    "loader2-r232-early-pz-sp": GluonMLAConfig(
        issue="loader2", wg1_regs=232, early_release=True, producer_zeroing=True, scale_p=True
    ),
    # The same with the refills in the order scale_p frees the parts (not yet measured).
    "loader-r232-early-pz-sp-refill": GluonMLAConfig(
        issue="loader",
        wg1_regs=232,
        early_release=True,
        producer_zeroing=True,
        scale_p=True,
        sp_refill=True,
    ),
    # No producer: each compute warp group refills the parts it used last right after its
    # product on them (FlashMLA's copies). Built 2026-12-07; not yet run on a GPU.
    "wg-early": GluonMLAConfig(issue="wg", early_release=True),
    # Each latent half of a tile as one copy (3 copies and barrier waits a tile, not 9), with
    # one producer warp or with the warp groups' own copies. Built 2026-12-07; not yet run.
    "loader-r232-early-halves": GluonMLAConfig(
        issue="loader", wg1_regs=232, early_release=True, half_copies=True
    ),
    "wg-early-halves": GluonMLAConfig(issue="wg", early_release=True, half_copies=True),
    "loader-r232-early-pz-halves": GluonMLAConfig(
        issue="loader", wg1_regs=232, early_release=True, producer_zeroing=True, half_copies=True
    ),
    # The tiles copied by a producer warp group with cp.async (9 instructions a thread per
    # tile at any block size) instead of TMA (36 copies a tile at block size 16). Measured:
    # block size 16 as fast as 64 with it, but +1 % at 16 and -6 % at 64 against the default
    # (docs/experiments/2026-12-02-mla-decode-copies-and-merges.md).
    "cpasync-r232-early": GluonMLAConfig(issue="cpasync", wg1_regs=232, early_release=True),
    # The split merge spread over each row's programs (no merge launch). Measured slower at
    # B=8 4k than the separate merge (same note).
    "loader2-r232-early-spread": GluonMLAConfig(
        issue="loader2", wg1_regs=232, early_release=True, spread_merge=True
    ),
    "cpasync-r232-early-spread": GluonMLAConfig(
        issue="cpasync", wg1_regs=232, early_release=True, spread_merge=True
    ),
    "hoist-peel": GluonMLAConfig(issue="hoist", peel=True),
    "loader-peel": GluonMLAConfig(issue="loader", peel=True),
    # The split merge fused into the kernel (the last program of a row merges; no merge
    # launch), with the split chooser's fixed cost per split lowered from 5 to 3 tiles and a
    # merge tail of about a quarter tile per extra split (128 KB of fp32 partial per split,
    # read by one SM). Every split read back in order: the same bits on every run.
    "loader-r232-fused": _fused(),
    # Its own split from the last program's registers (reads 1/S less; the last bits depend
    # on which split finished last).
    "loader-r232-fused-regs": _fused(merge_own_from_registers=True),
    # Fused up to 16 splits (short contexts, where the merge launch is a large share); more
    # splits (B = 1 at long contexts) keep the separate merge, spread over the whole GPU.
    "loader-r232-fused16": _fused(fused_max_splits=16),
}
# The default variant for blocks smaller than a 64-token tile (several copies per piece) and
# for the rest. Rule: from ``bench_mla_decode --gluon-only --variants ...``, per block size
# the variant whose checked rates have the highest geometric mean over the 128-head rows
# (none may be more than 3 % below the current default's on any row). The H200 sweep of
# 2026-12-01 (`git show 1e352f6:benchmarks/results/mla-decode-gluon-2026-12-01.json`):
# loader-r232 for both (geometric mean 398 against 274 TFLOP/s at block size 16, 439 against
# 392 at 64). Then loader2-r232 for small blocks: 2.5-4 % above loader-r232 on the 128-head
# shapes at block size 16 in two probes, +0.6 % geometric mean (-2.8 % to +3.3 % per shape) in
# the sweep benchmarks/results/mla-decode-gluon-2026-12-01.json; at block size 64 equal or up
# to 8 % slower, so large blocks keep loader-r232. Then loader2-r232-early for both (2026-12-02,
# benchmarks/results/mla-decode-gluon-early-2026-12-02.json: geometric mean of the medians
# 414 -> 444 at block size 16, 446 -> 468 at 64; no shape's median below the former default's;
# docs/experiments/2026-12-02-mla-decode-early-release.md). Then loader-r232-early-pz for both
# (2026-12-02, benchmarks/results/mla-decode-gluon-pz-2026-12-02.json: the rows past the range
# zeroed by one producer warp, so the consumers never branch on it; geometric mean over the
# ten 128-head shapes, three sweeps against loader2-r232-early in the same runs: 451 / 443 /
# 440 against 435 / 429 / 443 at block size 16, 476 / 473 / 477 against 457 / 457 / 467 at 64;
# per-shape medians +0.1 to +9.9 %, except B=64 4k / 32k at 16 (-0.9 / -1.5 %) and B=256 4k at
# 16: -3.7 % (435 against 452; that row spans 414-487 across runs of one schedule; with each
# schedule's full MLA decode run added, 452 against 455); docs/experiments/2026-12-02-mla-decode-fixed-costs.md).
# loader-r232-early-pz-sp (scale_p) was measured slower on 2026-12-03 (128 heads: +0 to +11 %
# time at block size 64, -5 to +5 % at 16; benchmarks/results/peers-mla-2026-12-03b.json, where it ran as
# the default "cp" beside this one; docs/experiments/2026-12-02-peers.md), so it is not used.
_DEFAULT_SMALL_PAGE = "loader-r232-early-pz"
_DEFAULT_LARGE_PAGE = "loader-r232-early-pz"


def default_gluon_mla_config(block_size: int) -> GluonMLAConfig:
    """The configuration the kernel runs with when the caller names none."""
    return GLUON_MLA_VARIANTS[_DEFAULT_SMALL_PAGE if block_size < _TILE else _DEFAULT_LARGE_PAGE]


def _device_why(q: torch.Tensor) -> str | None:
    if not HAS_GLUON:
        return "this Triton has no Gluon"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon MLA kernel needs an sm_90 (Hopper) GPU"
    return None


def gluon_mla_supported(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """None when the Gluon kernel serves these inputs, else why not (for the caller to say)."""
    why = _device_why(q)
    if why is not None:
        return why
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon MLA kernel takes bf16/fp16, got {q.dtype}"
    if cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        return (
            f"the Gluon MLA kernel needs the cache in q's dtype {q.dtype} or fp8, got {cache.dtype}"
        )
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
    if cache.data_ptr() % 16:
        return "the Gluon MLA kernel needs a 16-byte aligned cache"
    return None


# fp8 (e4m3) latent caches through the Gluon kernel (:mod:`~cp_modules.kernels.decode.
# mla_gluon_fp8`) instead of the Triton kernel, for the shapes and schedules it serves
# (:func:`gluon_mla_fp8_supported`; the rest run the Triton kernel). On by measurement: 0.79 /
# 0.82 / 0.76 of the bf16 kernel's speed at 128 heads (B=1 128k, B=8 4k, B=64 32k) against
# the Triton fp8 kernel's 0.41 / 0.56 (docs/experiments/2026-12-04-mla-fp8-gluon.md).
MLA_FP8_GLUON = True
# The fp8 path's conversion partition: warps, and registers per thread (setmaxnreg). 4 warps
# take a warp group's slot of their own (warp group 0: 256 minus this count, 224); 2 warps
# share one with the producer warp (at the same count: keep it the schedule's loader_regs), so
# warp groups 0 / 1 keep the 16-bit kernel's 248 / 232, at 0.62-0.63 of bf16 (measured).
FP8_CONVERT_WARPS = 4
FP8_CONVERT_REGS = 32


def gluon_mla_fp8_supported(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | float | None = None,
    config: GluonMLAConfig | None = None,
) -> str | None:
    """None when the Gluon kernel's fp8 path serves these inputs (an e4m3 ``cache``, one
    latent scale, a schedule with that path), else why not. ``config`` None: the default."""
    if cache.dtype != torch.float8_e4m3fn:
        return f"the Gluon MLA fp8 path takes an e4m3 cache, got {cache.dtype}"
    why = gluon_mla_supported(q, cache, kv_lora_rank)
    if why is not None:
        return why
    if isinstance(kv_scale, torch.Tensor) and (
        kv_scale.numel() != 1 or kv_scale.dtype != torch.float32 or kv_scale.device != q.device
    ):
        return (
            "the Gluon MLA fp8 path takes one fp32 latent scale on q's device, got "
            f"{kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}"
        )
    cfg = config if config is not None else default_gluon_mla_config(cache.shape[1])
    if (cfg.issue != "loader" or not cfg.early_release or not cfg.producer_zeroing
            or cfg.scale_p or cfg.fused_merge or cfg.spread_merge):  # fmt: skip
        return (
            "the Gluon MLA fp8 path is built for the one-producer-warp schedules with early "
            "release and producer zeroing and the separate split merge (as "
            "'loader-r232-early-pz'), not scale_p, fused_merge or spread_merge"
        )
    return None


def check_trace_buffer(trace: torch.Tensor, device: torch.device, num_programs: int) -> None:
    """Raise ValueError unless ``trace`` can take the kernel's stamps of ``num_programs``
    programs (rows x splits): a contiguous int64 tensor on ``device`` of at least 8 per
    program (the kernel writes 8 slots a program and checks nothing)."""
    need = 8 * num_programs
    if (trace.dtype != torch.int64 or trace.device != device or not trace.is_contiguous()
            or trace.numel() < need):  # fmt: skip
        raise ValueError(
            f"trace must be a contiguous int64 tensor on {device} of at least {need} elements "
            f"(8 per program, {num_programs} programs); got {trace.dtype} {tuple(trace.shape)} "
            f"on {trace.device}"
        )



def choose_gluon_mla_num_splits(
    config: GluonMLAConfig, num_programs: int, max_kv_len: int, num_sms: int
) -> int:
    """KV splits for ``num_programs`` (query, head tile) programs under ``config``'s costs.

    :func:`~cp_modules.kernels.decode.mla.choose_mla_num_splits` with the config's fixed
    cost per split and merge tail; when that asks for more splits than the fused merge serves
    (``fused_max_splits``), the count of the separate merge's costs (the Triton kernel's).
    """
    from cp_modules.kernels.decode.mla import _SPLIT_COST_TILES, choose_mla_num_splits

    fixed = _SPLIT_COST_TILES if config.split_cost_tiles is None else config.split_cost_tiles
    splits = choose_mla_num_splits(num_programs, max_kv_len, num_sms, _TILE, 1, fixed,
                                   config.merge_tiles_per_split)  # fmt: skip
    if config.fused_merge and splits > config.fused_max_splits:
        splits = choose_mla_num_splits(num_programs, max_kv_len, num_sms, _TILE, 1)
    return splits
