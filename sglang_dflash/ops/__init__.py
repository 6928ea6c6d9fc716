"""Triton kernels of the decode step."""

from .block_attention import block_attention, block_attention_by_table
from .block_ops import accept_block, load_accept_block, prepare_block
from .context_kv import norm_rope_split

__all__ = ["accept_block", "block_attention", "block_attention_by_table", "load_accept_block", "norm_rope_split",
           "prepare_block"]
