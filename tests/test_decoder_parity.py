"""One GPU, decoder training as HF's ``sdpa`` runs it: the path choices and the projections.

- A forward that autograd will differentiate rents no FlashAttention-2 call while cuDNN would
  build plans for new shapes (``CPPolicy.training_rents_cudnn``, default False): its
  ``cudnn_build_s`` reaches the op as 0, so the blocks (cuDNN on the GPU) run at once;
  inference forwards keep the rental.
- A swapped DeepSeek-V3 at world 1 runs no more GEMMs in a training step than the original
  model (the latent up-projection once, with kv_b_proj's whole weight) and no more
  concatenations, with equal loss and gradients (float64).

The kernels themselves and the gradients on them: ``test_decoder_parity_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cp_modules.modules.hf_families import build_tiny
from cp_modules.modules.hf_swap import swap_attention
from cp_modules.ops.pcp_policy import CudnnRental, PlanState, pcp_policy_args
from cp_modules.policy import CPPolicy
from cp_modules.step import CPRuntime, build_step_metadata, cp_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_differentiated_forward_builds_cudnn_at_once():
    build_s = pcp_policy_args(CPPolicy(), 128, 128)[3]
    assert build_s == CPPolicy().cudnn_build_s > 0
    assert pcp_policy_args(CPPolicy(), 128, 128, differentiable=True)[3] == 0.0
    keep = CPPolicy(training_rents_cudnn=True)
    assert pcp_policy_args(keep, 128, 128, differentiable=True)[3] == keep.cudnn_build_s
    # The rental on a large new shape (cuDNN asked for): rents at the policy's build time,
    # takes the blocks at once at 0.
    q = torch.empty(4096, 4, 128)
    segs = [[0, 0, 4096, 0, 4096]]
    for s, want in ((build_s, False), (0.0, True)):
        rental = CudnnRental()
        ready = rental.blocks_ready(
            PlanState(0), segs, q, q, q, None, "forward", 1e12, cudnn_build_s=s, backend="cudnn"
        )
        assert ready is want


# Ops that copy data (a cat, HF's key built by two copy_, a slice's zero-filled gradient).
_COPIES = ("cat", "copy_", "clone", "slice_backward", "select_backward", "index_select")


class _Count(TorchDispatchMode):
    """Counts 2-D GEMMs (the projections; attention runs batched) and copies."""

    def __init__(self):
        super().__init__()
        self.gemms = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm"):
            self.gemms += 1
        elif name in _COPIES:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_mla_training_runs_no_more_gemms_or_copies_than_deepseek():
    hf = build_tiny("deepseek_v3", dtype=torch.float64, num_hidden_layers=1)
    cp = swap_attention(copy.deepcopy(hf))
    ids = torch.randint(
        0, hf.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0)
    )
    attn_hf = hf.model.layers[0].self_attn
    attn_cp = cp.model.layers[0].self_attn
    meta = build_step_metadata(CPRuntime.single(), [ids.shape[1]])

    def counted(model, attn, call):
        # Counts inside the attention module only (forward and its backward).
        hidden = {}

        def keep(module, args, kwargs):
            hidden.setdefault("x", kwargs.get("hidden_states", args[0] if args else None))

        handle = attn.register_forward_pre_hook(keep, with_kwargs=True)
        model.zero_grad(set_to_none=True)
        h = call()
        handle.remove()
        counts = _Count()
        x = hidden["x"].detach().requires_grad_()
        pos = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
        with counts:
            if model is cp:
                with cp_step(meta):
                    y = attn(x, position_embeddings=pos, attention_mask=None)[0]
            else:
                y = attn(x, position_embeddings=pos, attention_mask=None)[0]
            y.square().sum().backward()
        return h, counts

    h_hf, n_hf = counted(
        hf, attn_hf, lambda: hf.model(input_ids=ids, use_cache=False).last_hidden_state
    )

    def cp_forward():
        with cp_step(meta):
            return cp.model(
                input_ids=ids, position_ids=meta.positions[None], use_cache=False
            ).last_hidden_state

    h_cp, n_cp = counted(cp, attn_cp, cp_forward)
    torch.testing.assert_close(h_cp, h_hf)
    assert n_hf.gemms > 0
    assert n_cp.gemms <= n_hf.gemms, (n_cp.gemms, n_hf.gemms)
    assert n_cp.copies <= n_hf.copies, (n_cp.copies, n_hf.copies)
    # The gradients of the module's parameters are equal too (float64).
    named = dict(attn_hf.named_parameters())
    for name, p in attn_cp.named_parameters():
        if name in named:
            torch.testing.assert_close(p.grad, named[name].grad, msg=name)
