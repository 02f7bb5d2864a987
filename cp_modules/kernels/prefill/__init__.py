"""PCP head/tail prefill attention: fused-kernel blocks, one varlen call, key-major backward, gradient assembly."""
