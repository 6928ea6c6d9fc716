"""Triton kernels of the decode step."""

from .block_ops import accept_block, prepare_block

__all__ = ["accept_block", "prepare_block"]
