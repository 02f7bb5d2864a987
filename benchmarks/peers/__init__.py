"""Parts of ``benchmarks.bench_peers``."""
