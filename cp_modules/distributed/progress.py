"""Progress bars on rank 0 only: every other rank of a job turns tqdm's bars off.

Each rank of a job runs the same code, so without this every rank draws the same bars (model
loading, GGUF conversion, generation) into the same terminal, interleaved.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

__all__ = ["generation_bar", "progress_bars_on_rank_zero"]

_SILENCED = "_cp_modules_silenced"


def progress_bars_on_rank_zero(rank: int) -> None:
    """On a rank other than 0, turn progress bars off for the rest of this process.

    A tqdm bar created afterwards starts disabled unless its caller passes ``disable=False``
    (what the ``TQDM_DISABLE`` variable does when it is set before tqdm is imported; this
    works after the import too, so it covers bars of libraries that give no switch, such as
    transformers' GGUF conversion). transformers' and huggingface_hub's own switches are
    turned off as well (where they are installed). Rank 0 is left as it is.
    """
    if rank == 0:
        return
    import tqdm.std

    cls = tqdm.std.tqdm
    if not getattr(vars(cls).get("__init__"), _SILENCED, False):
        quiet = functools.partialmethod(cls.__init__, disable=True)
        setattr(quiet, _SILENCED, True)
        cls.__init__ = quiet
    for module, switch in (
        ("huggingface_hub.utils", "disable_progress_bars"),
        ("transformers.utils.logging", "disable_progress_bar"),
    ):
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            getattr(importlib.import_module(module), switch)()


def generation_bar(total: int, enabled: bool):
    """A tqdm bar of ``total`` generated tokens (off unless ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="tok", desc="generate", leave=False)
