"""Shared pieces of the paged decode benchmark: shapes, the models' head layouts, inputs, checks against the reference, timing."""

from __future__ import annotations

import math

import torch
import triton
from triton.testing import do_bench

from cp_modules.cache import (
    kv_cache_bytes_per_block,
)
from cp_modules.kernels.decode.mla import (
    paged_mla_attention_kernel,
)
from cp_modules.kernels.decode.paged import (
    DecodeConfig,
    default_config,
    paged_attention_kernel,
)
from cp_modules.reference.paged_decode import (
    paged_attention_ref,
    paged_mla_attention_ref,
)

BATCHES = (1, 8, 64, 256)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
CACHE_LIMIT_BYTES = 40e9
BLOCK_SIZE = 64
DTYPE = torch.bfloat16
GQA_HQ, GQA_HKV, GQA_D = 32, 8, 128
MLA_H, MLA_RK, MLA_ROPE = 128, 512, 64
TIME_BUDGET_S = 170.0  # optional sections (SDPA, DCP emulation, sweep) are skipped past this
DEVICE = "cuda"
DCP_BATCH, DCP_LENGTH = 8, 131072
SWEEP_SHAPES = ((64, 16384), (1, 131072))
# MLA with fewer query heads per GPU (DeepSeek's 128 split by tensor parallelism, or gathered
# from a smaller DCP group): the FLOP per KV byte falls with the heads, and with them whether
# the kernel is compute- or bandwidth-bound.
MLA_HEAD_SHAPES = ((1, 131072), (8, 131072), (64, 32768), (256, 16384))
FLEX_BATCHES = (1, 8, 64)
FLEX_CONTEXTS = (16384, 131072)
FLEX_BUDGET_S = 30.0  # per model: wall time the flex comparison may add, compiles included
FLEX_Q_BLOCK = 128  # the block mask's query block: flex_decoding needs a multiple of its BLOCK_M


class Model:
    """One attention flavour: its cache, kernel, reference and byte/FLOP counts."""

    def __init__(self, name: str, heads: int | None = None):
        self.name = name
        self.mla = name == "mla"
        if self.mla:
            self.heads, self.dq, self.dv = heads or MLA_H, MLA_RK + MLA_ROPE, MLA_RK
            self.scale = (128 + MLA_ROPE) ** -0.5
            bpb = kv_cache_bytes_per_block(
                BLOCK_SIZE, kv_lora_rank=MLA_RK, rope_dim=MLA_ROPE, dtype=DTYPE
            )
        else:
            self.heads, self.dq, self.dv = GQA_HQ, GQA_D, GQA_D
            self.scale = GQA_D**-0.5
            bpb = kv_cache_bytes_per_block(
                BLOCK_SIZE, num_kv_heads=GQA_HKV, head_dim=GQA_D, dtype=DTYPE
            )
        self.bytes_per_block = bpb
        self.bytes_per_token = bpb // BLOCK_SIZE
        self.caches: tuple[torch.Tensor, ...] = ()

    def allocate(self, num_blocks: int) -> None:
        self.caches = ()
        torch.cuda.empty_cache()
        if self.mla:
            shape = (num_blocks, BLOCK_SIZE, MLA_RK + MLA_ROPE)
            self.caches = (torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(),)
        else:
            shape = (num_blocks, BLOCK_SIZE, GQA_HKV, GQA_D)
            self.caches = tuple(
                torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_() for _ in range(2)
            )

    def kernel(self, q, bt, seq, kv_len, splits=None, config=None):
        if self.mla:
            return paged_mla_attention_kernel(
                q, self.caches[0], bt, seq, kv_len, self.scale, MLA_RK, splits, config=config
            )
        return paged_attention_kernel(
            q, *self.caches, bt, seq, kv_len, self.scale, splits, config=config
        )

    def reference(self, q, bt, seq, kv_len, upcast=True):
        if self.mla:
            return paged_mla_attention_ref(
                q, self.caches[0], bt, seq, kv_len, self.scale, MLA_RK, upcast=upcast
            )
        return paged_attention_ref(q, *self.caches, bt, seq, kv_len, self.scale, upcast=upcast)

    def kv_bytes(self, kv_len: torch.Tensor) -> float:
        return float(kv_len.double().sum()) * self.bytes_per_token

    def flops(self, kv_len: torch.Tensor) -> float:
        return float(kv_len.double().sum()) * self.heads * 2 * (self.dq + self.dv)

    def default_config(self, split: bool = True) -> DecodeConfig:
        """The kernel's own tiles (GQA's depend on whether the KV range is split)."""
        if self.mla:
            return default_config(self.heads, MLA_RK, MLA_RK, MLA_ROPE)
        return default_config(GQA_HQ // GQA_HKV, GQA_D, GQA_D, 0, split)

    def num_programs(self, batch: int, cfg: DecodeConfig) -> int:
        group = self.heads if self.mla else GQA_HQ // GQA_HKV
        kv_heads = 1 if self.mla else GQA_HKV
        return batch * kv_heads * triton.cdiv(group, cfg.block_h)


def make_inputs(model: Model, batch: int, kv_len: int, table_len: int | None = None, seed=0):
    """Queries, a scrambled block table over the whole cache and per-query lengths."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    table_len = table_len or kv_len
    width = triton.cdiv(table_len, BLOCK_SIZE)
    num_blocks = model.caches[0].shape[0]
    assert batch * width <= num_blocks
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)[: batch * width]
    bt = perm.view(batch, width).to(torch.int32)
    q = torch.randn(batch, model.heads, model.dq, device=DEVICE, generator=g).to(DTYPE)
    seq = torch.arange(batch, device=DEVICE, dtype=torch.int32)
    lens = torch.full((batch,), kv_len, device=DEVICE, dtype=torch.int32)
    return q, bt, seq, lens


def check(model: Model, q, bt, seq, kv_len, out, lse) -> dict:
    """Kernel vs fp32 reference on a few queries, bounded by 2x the same-dtype error."""
    idx = torch.tensor(sorted({0, q.shape[0] // 2, q.shape[0] - 1}), device=DEVICE)
    sub = (q[idx], bt, seq[idx], kv_len[idx])
    ref_out, ref_lse = model.reference(*sub)
    same_out, same_lse = model.reference(*sub, upcast=False)
    err_out = (out[idx].float() - ref_out.float()).abs().max().item()
    err_lse = (lse[idx] - ref_lse).abs().max().item()
    base_out = (same_out.float() - ref_out.float()).abs().max().item()
    base_lse = (same_lse - ref_lse).abs().max().item()
    ok = (
        math.isfinite(err_out) and err_out <= 2 * base_out + 1e-4 and err_lse <= 2 * base_lse + 1e-4
    )
    return {
        "ok": bool(ok),
        "err_out": err_out,
        "err_lse": err_lse,
        "same_dtype_err_out": base_out,
        "same_dtype_err_lse": base_lse,
    }


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def bench_ms(fn) -> float:
    return float(do_bench(fn, warmup=5, rep=30, return_mode="median"))


def graph_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: the device time without the eager
    launch path (Python, allocations, Triton's dispatch), which decode hides the same way."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench_ms(graph.replay)
    del graph
    return ms
