"""Masked (sliding-window / logit soft-cap) PCP prefill: segment packing, FlexAttention and FlashAttention-2 paths."""
