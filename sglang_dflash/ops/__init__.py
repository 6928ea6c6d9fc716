"""Triton kernels of the decode step."""

from .block_ops import accept_block, prepare_block
from .context_kv import norm_rope_split

__all__ = ["accept_block", "norm_rope_split", "prepare_block"]
