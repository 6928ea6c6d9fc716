"""One launch that copies each request's recurrent state between two pools, every layer at once.

A hybrid target keeps a request's gated-delta-net state in a slot of SGLang's mamba pool, and a
verify keeps one per verify token in its snapshot buffer. :mod:`sglang_dflash.gdn_state` moves a
state between the two only where something reads it from the other place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize_on_alignment=["dst_index_ptr", "src_index_ptr"])
def _copy_states_kernel(
    dst_ptr, dst_index_ptr, dst_layer_stride, dst_row_stride,
    src_ptr, src_index_ptr, src_layer_stride, src_row_stride,
    numel, BLOCK: tl.constexpr,
):
    i, layer, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dst_row = tl.load(dst_index_ptr + i).to(tl.int64)
    src_row = tl.load(src_index_ptr + i).to(tl.int64)
    if (dst_row >= 0) & (src_row >= 0):
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        live = offs < numel
        values = tl.load(src_ptr + layer * src_layer_stride + src_row * src_row_stride + offs, mask=live)
        tl.store(dst_ptr + layer * dst_layer_stride + dst_row * dst_row_stride + offs, values, mask=live)


def copy_states(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> None:
    """``dst[l, dst_index[i]] = src[l, src_index[i]]`` for every layer ``l`` and entry ``i``; an entry
    with either index below 0 copies nothing. ``dst`` and ``src`` are ``[layers, rows, *state]``
    with the same state shape and dtype, each row's state contiguous (the rows and layers may be
    strided, as SGLang's pools are)."""
    if dst.shape[0] != src.shape[0] or dst.shape[2:] != src.shape[2:] or dst.dtype != src.dtype:
        raise ValueError(f"copy_states: pools {tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype} "
                         "differ in layers, state shape or dtype")
    if dst_index.shape != src_index.shape:
        raise ValueError(f"copy_states: {dst_index.shape[0]} destinations for {src_index.shape[0]} sources")
    if not (dst[0, 0].is_contiguous() and src[0, 0].is_contiguous()):
        raise ValueError("copy_states: each row's state must be contiguous")
    n, numel = dst_index.shape[0], dst[0, 0].numel()
    if n == 0 or numel == 0:
        return
    grid = (n, dst.shape[0], triton.cdiv(numel, BLOCK))
    _copy_states_kernel[grid](dst, dst_index, dst.stride(0), dst.stride(1),
                              src, src_index, src.stride(0), src.stride(1), numel, BLOCK=BLOCK)
