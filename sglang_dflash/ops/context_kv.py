"""Draft context K/V for every draft layer in one GEMM and one Triton launch.

Each step, the committed target features become draft K/V in every draft layer. Per layer that
is a projection, a per-head RMSNorm of K and a rotary embedding of K: a dozen small launches and
their Python overhead per layer. Here all layers' K and V rows are one stacked weight (one GEMM),
and one kernel normalises and rotates every layer's K and lays K and V out per layer, contiguous,
as the KV pool's writers expect.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# One variant for every token count and positions view (Triton would specialise on 1 and on
# multiples of 16): prefill lengths vary, and a compile mid-serving is a latency spike.
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["positions_ptr"])
def _norm_rope_split_kernel(
    kv_ptr, positions_ptr, norm_w_ptr, cos_sin_ptr, k_out_ptr, v_out_ptr,
    num_tokens, kv_row_stride, cos_sin_stride, eps,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEADS_P2: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    t = tl.program_id(0)
    layer = tl.program_id(1)
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    live = (h < HEADS) & (d < HALF)
    # Row layout of the GEMM output: per layer [K heads..., V heads...].
    src = kv_ptr + t * kv_row_stride + layer * 2 * HEADS * HEAD_DIM + h * HEAD_DIM + d
    k1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    k2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    v1 = tl.load(src + HEADS * HEAD_DIM, mask=live)
    v2 = tl.load(src + HEADS * HEAD_DIM + HALF, mask=live)

    inv_rms = tl.rsqrt((tl.sum(k1 * k1, axis=1) + tl.sum(k2 * k2, axis=1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(norm_w_ptr + layer * HEAD_DIM + d, mask=d < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(norm_w_ptr + layer * HEAD_DIM + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    k1 = k1 * inv_rms * w1
    k2 = k2 * inv_rms * w2

    # Neox-style rotation; the cache row of a position is [cos x HALF, sin x HALF].
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    r1 = k1 * cos - k2 * sin
    r2 = k2 * cos + k1 * sin

    dst = (layer * num_tokens + t) * HEADS * HEAD_DIM + h * HEAD_DIM + d
    tl.store(k_out_ptr + dst, r1.to(k_out_ptr.dtype.element_ty), mask=live)
    tl.store(k_out_ptr + dst + HALF, r2.to(k_out_ptr.dtype.element_ty), mask=live)
    tl.store(v_out_ptr + dst, v1, mask=live)
    tl.store(v_out_ptr + dst + HALF, v2, mask=live)


def norm_rope_split(
    kv: torch.Tensor,
    positions: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer K (RMSNorm per head, then neox RoPE at ``positions``) and V from stacked rows.

    ``kv``: ``[N, num_layers * 2 * num_kv_heads * head_dim]``, per layer K then V.
    ``k_norm_weight``: ``[num_layers, head_dim]``. ``cos_sin_cache``: ``[max_pos, head_dim]``.
    Returns K and V as ``[num_layers, N, num_kv_heads, head_dim]``, each layer contiguous.
    """
    n = kv.shape[0]
    k_out = torch.empty((num_layers, n, num_kv_heads, head_dim), dtype=kv.dtype, device=kv.device)
    v_out = torch.empty_like(k_out)
    if n == 0:
        return k_out, v_out
    half = head_dim // 2
    _norm_rope_split_kernel[(n, num_layers)](
        kv, positions, k_norm_weight, cos_sin_cache, k_out, v_out,
        n, kv.stride(0), cos_sin_cache.stride(0), eps,
        HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        HEADS_P2=triton.next_power_of_2(num_kv_heads), HALF_P2=triton.next_power_of_2(half),
    )
    return k_out, v_out
