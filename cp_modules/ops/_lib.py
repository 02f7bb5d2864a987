"""The one ``cp`` torch.library fragment every op module registers into.

Hot-path ops (decode) are registered with ``Library.define`` + ``impl`` + ``register_fake``
(a few µs per eager call); ops that need autograd may use ``torch.library.custom_op`` with
``register_autograd``. Either way: namespace ``cp``, explicit schema, a fake that only
computes shapes, CPU = the pure-PyTorch reference, CUDA = the Triton kernel or PyTorch's own
attention kernels. Process groups cross op boundaries as names (``str``) plus world size.
"""

from __future__ import annotations

import torch

__all__ = ["lib"]

lib = torch.library.Library("cp", "FRAGMENT")
