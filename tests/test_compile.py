"""Piecewise compilation: the captured graph splits at the CP attention ops, and matches eager."""

import torch
from torch import nn

from cp_modules.compile import piecewise_backend
from cp_modules.modules import (
    CPFlashAttention,
    CPMLAAttention,
    CPRuntime,
    build_step_metadata,
    cp_step,
)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleList(
            [
                CPFlashAttention(32, 4, 2),
                CPMLAAttention(
                    32,
                    4,
                    q_lora_rank=16,
                    kv_lora_rank=16,
                    qk_nope_head_dim=8,
                    qk_rope_head_dim=4,
                    v_head_dim=8,
                ),
            ]
        )
        self.mlp = nn.Linear(32, 32)

    def forward(self, x, pos):
        for a in self.attn:
            x = x + self.mlp(torch.relu(a(x, pos)))
        return x


def test_piecewise_split_and_equality_over_changing_batches():
    torch.manual_seed(0)
    model = TwoLayers()
    seen = []

    def backend(gm, example_inputs):
        split = piecewise_backend()(gm, example_inputs)
        seen.append((split.cp_attention_pieces, len(list(split.named_children()))))
        return split

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    rt = CPRuntime.single()
    for lens in ([7, 5], [9, 2, 3], [16]):
        meta = build_step_metadata(rt, lens)
        x = torch.randn(meta.num_local_tokens, 32)
        with cp_step(meta), torch.no_grad():
            torch.testing.assert_close(
                compiled(x, meta.positions), model(x, meta.positions), atol=1e-6, rtol=0
            )
    # One capture for all three batch compositions; the two attention ops are pieces of their
    # own between three compiled pieces.
    assert seen == [(["submod_1", "submod_3"], 5)]
