"""Deprecated location of the step metadata: it lives in :mod:`cp_modules.step`."""

from cp_modules.step import (  # noqa: F401
    CPRuntime,
    CPStepMetadata,
    build_step_metadata,
    cp_step,
    current_step,
    restore_tokens,
)
