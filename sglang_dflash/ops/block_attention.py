"""Attention of a block of W queries per request over the request's cached prefix and the block.

Both DFLASH passes have this shape: the target's verify (causal inside the block) and the draft
(non-causal). SGLang's Triton extend kernel serves them as it serves a prefill: one program per
(request, query head, 128 queries), so a block of 16 fills an eighth of its tile, and each KV head
is read once per query head of its group. Here one program takes a KV head's whole GQA group for
the whole block (W x group rows, 64 for a block of 16 on 32/8 heads), reads each KV row once, and
the prefix is split across programs by each request's real length (a fixed number of splits, so
the grid is the same in and out of CUDA graphs), then the splits are merged by their LSE.
float32 products are split in three TF32 products (``tf32x3``): within 1e-6 of float64 on the 8B
shape, where one TF32 product (SGLang's extend kernel) is 3e-3 off, and 14x faster than IEEE dots.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime import OutOfResources


@triton.jit
def _attend_tile(q, k, v, live, m_i, l_i, acc, sm_scale, F32: tl.constexpr):
    """One online-softmax update of ``acc`` with the keys ``k`` [D, N] and values ``v`` [N, D];
    ``live`` [R, N] masks the scores. Every row has at least one live key in every tile."""
    if F32:
        s = tl.dot(q, k, input_precision="tf32x3")
    else:
        s = tl.dot(q, k)
    s = tl.where(live, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32:
        pv = tl.dot(p, v, input_precision="tf32x3")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _load_kv(k_ptr, v_ptr, rows, live, stride_kt, stride_vt, k_head, v_head, d):
    """Keys ``[D, N]`` (laid out for ``q @ k``) and values ``[N, D]`` of the token rows ``rows``
    ``[N]``, masked by ``live``; ``k_head``/``v_head``: the KV head's offset within a row."""
    k = tl.load(k_ptr + rows[None, :] * stride_kt + k_head + d[:, None], mask=live[None, :], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + v_head + d[None, :], mask=live[:, None], other=0.0)
    return k, v


# Batch sizes, prefix lengths and views change every step: one compiled variant serves them all.
@triton.jit(do_not_specialize=["stride_qt", "stride_kt", "stride_vt", "stride_ot", "index_stride"],
            do_not_specialize_on_alignment=["q_ptr", "k_ptr", "v_ptr", "o_ptr", "rows_ptr", "lens_ptr", "index_ptr"])
def _block_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, lens_ptr, index_ptr, index_stride,
    o_ptr, part_o_ptr, part_lse_ptr, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    W: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLITS: tl.constexpr, CAUSAL: tl.constexpr,
    F32: tl.constexpr, TABLE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Row r is query r // GROUP of the block, for query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, ROWS)
    qi = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    live_row = rows < W * GROUP
    d = tl.arange(0, HEAD_DIM)
    token = b * W + qi
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=live_row[:, None], other=0.0)

    # The slots of request b's keys: index[kv_start + i] for key i, from the request table (its row,
    # the prefix length apart) or from the backend's flat indices (kv_indptr in rows).
    if TABLE:
        kv_start = tl.load(rows_ptr + b).to(tl.int64) * index_stride
        prefix = tl.load(lens_ptr + b).to(tl.int32)
    else:
        kv_start = tl.load(rows_ptr + b).to(tl.int64)
        prefix = (tl.load(rows_ptr + b + 1) - kv_start).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(prefix, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        live_n = start + n < hi
        slot = tl.load(index_ptr + kv_start + start + n, mask=live_n, other=0).to(tl.int64)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, slot, live_n, stride_kct, stride_vct,
                        kv_head * stride_kch, kv_head * stride_vch, d)
        m_i, l_i, acc = _attend_tile(q, k, v, live_n[None, :], m_i, l_i, acc, sm_scale, F32)

    if split == SPLITS - 1:  # the block's own keys: the forward's K/V, or in the cache after the prefix
        j = tl.arange(0, BLOCK_W)
        live_j = j < W
        if TABLE:
            slot = tl.load(index_ptr + kv_start + prefix + j, mask=live_j, other=0).to(tl.int64)
            k, v = _load_kv(k_cache_ptr, v_cache_ptr, slot, live_j, stride_kct, stride_vct,
                            kv_head * stride_kch, kv_head * stride_vch, d)
        else:
            k, v = _load_kv(k_ptr, v_ptr, b * W + j, live_j, stride_kt, stride_vt,
                            kv_head * stride_kh, kv_head * stride_vh, d)
        live = live_j[None, :]
        if CAUSAL:
            live = live & (j[None, :] <= qi[:, None])
        m_i, l_i, acc = _attend_tile(q, k, v, live, m_i, l_i, acc, sm_scale, F32)

    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live_row[:, None])
    else:
        # Partials [token, head, split, ...]; an empty split has l = 0: LSE -inf, weight 0.
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        part = (token * (GROUP * tl.num_programs(1)) + head) * SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=live_row[:, None])
        tl.store(part_lse_ptr + part, lse, mask=live_row)


@triton.jit(do_not_specialize=["stride_ot"], do_not_specialize_on_alignment=["o_ptr"])
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, o_ptr, stride_ot, stride_oh,
                         SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    part = (token * tl.num_programs(1) + head) * SPLITS + s
    lse = tl.load(part_lse_ptr + part, mask=s < SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # the last split always holds the block: the max is finite
    out = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    out = tl.sum(out * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + token * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch_size: int, kv_heads: int, device: torch.device) -> int:
    """Prefix splits so that the programs fill the GPU about once: 1 once the batch's (request,
    KV head) pairs do, at most 16. Read from shapes only, so a CUDA graph keeps its choice."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 8
    want = max(1, sms // max(1, batch_size * kv_heads))
    return min(16, 1 << (want.bit_length() - 1))


def query_rows(block: int, group: int) -> int:
    """Rows of one program's query tile: a block's queries for a KV head's whole GQA group."""
    return max(16, triton.next_power_of_2(block * group))


# Above this many query-tile elements (rows x head size) a program runs 8 warps, so that each thread holds
# half the float32 accumulator: on an H100 the 128 x 256 tiles of Qwen3.5-27B and Qwen3.6-35B-A3B (block
# 16) took 0.34-0.64x their time at 4 warps in every case that ran over 80 us, where the GPU rather than
# the launch sets the time (lab/verify_attention_bench.py, results/hybrid/README.md). 64 x 256 and
# smaller keep the 4 warps that were timed end to end.
WIDE_TILE = 64 * 256


def warps_for(rows: int, head_dim: int) -> int:
    """Warps a program of the block kernel runs for a query tile of ``rows`` x ``head_dim``."""
    return 8 if rows * head_dim > WIDE_TILE else 4


class TileTooLarge(RuntimeError):
    """The GPU cannot run one program of the kernel for this query tile (shared memory or threads)."""


# (query-tile rows, head size, dtype) a GPU refused at launch. Triton refuses before anything is
# enqueued, inside a CUDA-graph capture too, so the caller can serve the call another way. Float32
# tiles of 64 x 256 and up need 256 KB of shared memory a program, over the 227 KB of an H100 or H200.
_REFUSED: set = set()


def fits(block: int, group: int, head_dim: int, dtype: torch.dtype, tile_limit: Optional[int] = None) -> bool:
    """False once a launch of this tile has been refused (:class:`TileTooLarge`), or where the tile
    (rows x head size) is over ``tile_limit``."""
    rows = query_rows(block, group)
    return (rows, head_dim, dtype) not in _REFUSED and (tile_limit is None or rows * head_dim <= tile_limit)


HEAD_DIMS = (64, 128, 256)


def serves(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether :func:`block_attention` takes this head size and dtype."""
    return head_dim in HEAD_DIMS and dtype in (torch.bfloat16, torch.float16, torch.float32)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    block: int,
    sm_scale: float,
    causal: bool,
    splits: Optional[int] = None,
    warps: Optional[int] = None,
) -> torch.Tensor:
    """``o`` = attention of each request's ``block`` queries over its prefix and the block.

    ``q``/``o``: ``[bs * block, Hq, D]``; ``k``/``v``: the block's own ``[bs * block, Hkv, D]``;
    request b's prefix is ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, rows of ``k_cache``/
    ``v_cache`` (``[slots, Hkv, D]``). ``causal``: query i sees the block's keys up to i; else all.
    """
    return _launch(q, k, v, o, k_cache, v_cache, kv_indptr, kv_indptr, kv_indices, 0, block, sm_scale, causal,
                   splits, table=False, warps=warps)


def block_attention_by_table(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    block: int,
    sm_scale: float,
    causal: bool,
    splits: Optional[int] = None,
) -> torch.Tensor:
    """:func:`block_attention` with every key in the cache, the block's written there already:
    request b's key i sits in slot ``req_to_token[req_pool_indices[b], i]``, the block's at
    ``prefix_lens[b]`` onwards."""
    return _launch(q, q, q, o, k_cache, v_cache, req_pool_indices, prefix_lens, req_to_token, req_to_token.stride(0),
                   block, sm_scale, causal, splits, table=True)


def _launch(q, k, v, o, k_cache, v_cache, rows, lens, index, index_stride, block, sm_scale, causal, splits, table,
            warps=None):
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    bs = tokens // block
    if bs == 0:
        return o
    group = q_heads // kv_heads
    tile_rows = query_rows(block, group)
    if warps is None:
        warps = warps_for(tile_rows, head_dim)
    if splits is None:
        splits = default_splits(bs, kv_heads, q.device)
    f32 = q.dtype == torch.float32
    block_n = 32 if f32 or head_dim > 128 else 64
    if splits > 1:
        part_o = torch.empty((tokens, q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((tokens, q_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = o  # unused
    try:
        _block_attention_kernel[(bs, kv_heads, splits)](
            q, k, v, k_cache, v_cache, rows, lens, index, index_stride, o, part_o, part_lse, sm_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), o.stride(0), o.stride(1),
            W=block, GROUP=group, ROWS=tile_rows, HEAD_DIM=head_dim,
            BLOCK_N=block_n, BLOCK_W=max(16, triton.next_power_of_2(block)), SPLITS=splits, CAUSAL=causal,
            F32=f32, TABLE=table, num_warps=warps, num_stages=2,
        )
    except OutOfResources as err:
        _REFUSED.add((tile_rows, head_dim, q.dtype))
        raise TileTooLarge(f"{tile_rows} x {head_dim} {q.dtype} query tile: {err}") from err
    if splits > 1:
        _merge_splits_kernel[(tokens, q_heads)](part_o, part_lse, o, o.stride(0), o.stride(1),
                                                SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
                                                HEAD_DIM=head_dim)
    return o
