"""Helpers shipped for testing cp_modules and code built on it."""

from cp_modules.testing.distributed import DistributedTestError, run_distributed
from cp_modules.testing.hf import hf_greedy_tokens
from cp_modules.testing.memory import peak_rss_growth, rss_bytes
from cp_modules.testing.numerics import assert_close_to_reference, max_abs_err

__all__ = [
    "DistributedTestError",
    "assert_close_to_reference",
    "hf_greedy_tokens",
    "max_abs_err",
    "peak_rss_growth",
    "rss_bytes",
    "run_distributed",
]
