"""The context-parallel attention ops, GQA/MHA and MLA: ``cp::gqa_attention``
(:mod:`cp_modules.ops.gqa_attention`) and ``cp::mla_attention``
(:mod:`cp_modules.ops.mla_attention`), one import for the layers."""

from cp_modules.ops.gqa_attention import _apply_sinks, _gathered_targets, gqa_attention
from cp_modules.ops.mla_attention import mla_attention

__all__ = ["_apply_sinks", "_gathered_targets", "gqa_attention", "mla_attention"]
