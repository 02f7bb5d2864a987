"""Parts of ``benchmarks.bench_decode``: shared helpers and the FlexAttention comparison."""
