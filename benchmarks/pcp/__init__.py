"""Parts of ``benchmarks.bench_pcp``: shared helpers and one module per study."""
