"""Progress bars on rank 0 only: every other rank of a job turns tqdm's bars off.

Each rank of a job runs the same code, so without this every rank draws the same bars (model
loading, GGUF conversion, generation) into the same terminal, interleaved.
"""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["progress_bars_on_rank_zero"]

_SILENCED = "_cp_modules_silenced"


def progress_bars_on_rank_zero(rank: int) -> None:
    """On a rank other than 0, turn progress bars off for the rest of this process.

    A tqdm bar created afterwards starts disabled unless its caller passes ``disable=False``
    (what the ``TQDM_DISABLE`` variable does when it is set before tqdm is imported; this
    works after the import too, so it covers bars of libraries that give no switch, such as
    transformers' GGUF conversion). transformers' and huggingface_hub's own switches are
    turned off as well, and the variables are set for processes this one starts. Rank 0 is
    left as it is.
    """
    if rank == 0:
        return
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import tqdm.std

    cls = tqdm.std.tqdm
    if not getattr(vars(cls).get("__init__"), _SILENCED, False):
        quiet = functools.partialmethod(cls.__init__, disable=True)
        setattr(quiet, _SILENCED, True)
        cls.__init__ = quiet
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        hub.disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()
