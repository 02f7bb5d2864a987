"""cp_modules: context-parallel attention (PCP prefill, DCP decode) for PyTorch."""

from cp_modules.config import ParallelConfig

__all__ = ["ParallelConfig"]
__version__ = "0.1.0"
