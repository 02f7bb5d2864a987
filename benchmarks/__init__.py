"""The GPU benchmark suite of cp_modules (run from the repository root).

    python -m benchmarks.suite             # every part on one GPU, then the dated report
    python -m benchmarks.bench_pcp --help  # one part, with its further options

Each ``bench_<op>.py`` checks its kernels against their references on the benchmark shapes
before it times them, and writes ``results/<kind>-<date>.json``; ``report.py`` merges the
newest results into ``<date>-<gpu>.{json,md}``. Nothing here imports Hydra.
"""
