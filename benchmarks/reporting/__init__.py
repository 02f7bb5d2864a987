"""Parts of ``benchmarks.report``: what it reads, its plots and its Markdown page."""
