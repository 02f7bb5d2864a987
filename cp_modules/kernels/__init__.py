"""Triton, Gluon and PyTorch-kernel launchers, by job: ``prefill`` (PCP head/tail attention),
``masked`` (window / soft-cap prefill), ``decode`` (paged decode, MLA and its Gluon kernel),
``merge`` (LSE merges) and ``cache`` (KV-cache writes). The flat module names of earlier
versions (``cp_modules.kernels.pcp_blocks``, ...) still import, as the same module objects."""
