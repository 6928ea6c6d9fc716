"""Triton kernels for the per-step bookkeeping around the draft and verify passes.

Each replaces a handful of small torch launches (fill, scatter, cumprod, gather) with one
launch per step, so the decode loop stays short on the host. ``reference.accept_block`` is the
specification of :func:`accept_block`; the GPU tests compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The inputs are often views into SGLang's buffers, whose alignment varies from step to step:
# one compiled variant serves all, so no step pays a Triton compile mid-serving.
@triton.jit(do_not_specialize_on_alignment=["bonus_ptr", "prefix_lens_ptr", "req_pool_idx_ptr"])
def _prepare_block_kernel(
    bonus_ptr, prefix_lens_ptr, req_pool_idx_ptr, req_to_token_ptr, req_to_token_stride,
    block_ids_ptr, positions_ptr, cache_loc_ptr, mask_token_id,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr,
):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P2)
    live = offs < BLOCK
    start = tl.load(prefix_lens_ptr + r).to(tl.int64)
    slot = tl.load(req_pool_idx_ptr + r).to(tl.int64)
    bonus = tl.load(bonus_ptr + r)
    ids = tl.where(offs == 0, bonus, mask_token_id)
    loc = tl.load(req_to_token_ptr + slot * req_to_token_stride + start + offs, mask=live)
    tl.store(block_ids_ptr + r * BLOCK + offs, ids, mask=live)
    tl.store(positions_ptr + r * BLOCK + offs, start + offs, mask=live)
    tl.store(cache_loc_ptr + r * BLOCK + offs, loc, mask=live)


def prepare_block(
    bonus: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    mask_token_id: int,
    block_ids: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
) -> None:
    """Fill ``[bs, B]`` block ids ``[bonus, mask...]``, positions ``prefix+i`` and their KV slots.

    The KV slots come from the request's (over-allocated) row of ``req_to_token``.
    """
    bs, B = block_ids.shape
    if bs == 0:
        return
    _prepare_block_kernel[(bs,)](
        bonus, prefix_lens, req_pool_indices, req_to_token, req_to_token.stride(0),
        block_ids, positions, cache_loc, mask_token_id,
        BLOCK=B, BLOCK_P2=triton.next_power_of_2(B),
    )


@triton.jit(do_not_specialize_on_alignment=["cand_ptr", "target_ptr", "prefix_lens_ptr"])
def _accept_block_kernel(
    cand_ptr, target_ptr, prefix_lens_ptr,
    accept_len_ptr, commit_len_ptr, bonus_ptr, out_tokens_ptr, new_seq_lens_ptr,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr,
):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P2)
    # Draft i+1 is checked against the target's choice after candidate i.
    nxt = offs + 1
    draft = tl.load(cand_ptr + r * BLOCK + nxt, mask=nxt < BLOCK, other=-1)
    want = tl.load(target_ptr + r * BLOCK + offs, mask=offs < BLOCK, other=-2)
    miss = (draft != want) | (nxt >= BLOCK)
    # First mismatch index = number of accepted drafts (always < BLOCK thanks to the pad).
    accept = tl.min(tl.where(miss, offs, BLOCK_P2), axis=0)
    bonus = tl.load(target_ptr + r * BLOCK + accept)
    # Accepted drafts equal the target's choices, so the committed tokens are the target's; the
    # tail holds its choices too: valid ids, since logprobs are gathered at every position.
    tl.store(out_tokens_ptr + r * BLOCK + offs, want, mask=offs < BLOCK)
    tl.store(accept_len_ptr + r, accept)
    tl.store(commit_len_ptr + r, accept + 1)
    tl.store(bonus_ptr + r, bonus)
    tl.store(new_seq_lens_ptr + r, tl.load(prefix_lens_ptr + r) + accept + 1)


def accept_block(
    candidates: torch.Tensor,
    target_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    accept_len: torch.Tensor,
    commit_len: torch.Tensor,
    bonus: torch.Tensor,
    out_tokens: torch.Tensor,
    new_seq_lens: torch.Tensor,
) -> None:
    """Greedy DFlash acceptance, one program per request; see ``reference.accept_block``.

    ``out_tokens[r, :commit_len[r]]`` are the tokens the request commits this step.
    """
    bs, B = candidates.shape
    if bs == 0:
        return
    _accept_block_kernel[(bs,)](
        candidates, target_tokens, prefix_lens, accept_len, commit_len, bonus, out_tokens, new_seq_lens,
        BLOCK=B, BLOCK_P2=triton.next_power_of_2(B),
    )


def load_accept_block(widths, device, seq_dtype: torch.dtype = torch.int64) -> None:
    """Build and load :func:`accept_block` for every verify width now, at start-up. Its width is a
    compile-time constant and it runs outside CUDA graphs, so a width first chosen mid-serving
    would stall the engine on Triton's compiler and load the kernel's module only then, outside
    torch's allocator, on a GPU the KV pool has filled (SGLang warns of both after serving starts).
    The buffers take the dtypes of the decode step's (:class:`~sglang_dflash.draft.StepBuffers`)."""
    for width in widths:
        candidates = torch.zeros((1, width), dtype=torch.int64, device=device)
        prefix_lens = torch.zeros(1, dtype=seq_dtype, device=device)
        lengths = [torch.empty(1, dtype=torch.int32, device=device) for _ in range(2)]
        accept_block(candidates, candidates, prefix_lens, *lengths, torch.empty(1, dtype=torch.int64, device=device),
                     torch.empty_like(candidates), torch.empty_like(prefix_lens))
