"""The draft side of a decode step, as the worker holds it: the block a draft pass hands to the
verify (:class:`DraftBlock`), the per-step tensors it is built in (:class:`StepBuffers`), the
draft's own request table when it attends to a window (:class:`DraftWindow`; :class:`DraftRing`
keeps only the window's K/V), and the greedy
head that turns the draft's hidden states into tokens with the target's lm_head
(:class:`GreedyDraftHead`), over the rows of the tokens served most often (:class:`DraftVocab`)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.distributed import get_tp_group, tensor_model_parallel_all_gather
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.runtime_context import get_parallel

from .ops.fp8 import FP8, Fp8RowwiseLinear
from .ops.ragged import RaggedLanes
from .sampling import to_device_async

logger = logging.getLogger("sglang_dflash")


@dataclass
class DraftBlock:
    candidates: torch.Tensor  # [bs, w]: last committed token, then w-1 drafts (w = B unless narrowed)
    positions: torch.Tensor  # [bs*w]
    cache_loc: torch.Tensor  # [bs, w] KV slots of the verified positions
    seq_lens_bound: torch.Tensor  # host, [bs]: committed + B, what attention planning may assume
    lanes: Optional[RaggedLanes] = None  # a ragged verify's packed lanes (SGLANG_DFLASH_RAGGED)
    decoded_lens: Optional[torch.Tensor] = None  # width 1 as a DECODE: committed + 1, as the forward read it


class StepBuffers:
    """The per-step tensors, allocated once instead of eight ``torch.empty`` calls per step.

    Two sets alternate: with the overlap schedule the host may still copy step N's results
    while step N+1 is launched; step N+2 starts only after step N's results are processed.
    """

    VERIFIED = ("candidates", "out_tokens")  # [bs, width]; the rest follow the block or the request

    def __init__(self, block_size: int, device):
        self.block_size, self.device = block_size, device
        self.sets: list[Optional[dict]] = [None, None]
        self.views: list[dict] = [{}, {}]  # each set's views by (bs, width): slicing ten tensors a step is host time
        self.turn = 0
        self.units: Optional[tuple] = None  # read-only (accept, commit) lengths (0, 1) of a width-1 step

    def take(self, bs: int, seq_dtype: torch.dtype, width: Optional[int] = None) -> dict:
        """Views for ``bs`` requests. The block's own tensors are ``[bs, B]``; what the verify and
        the accept step see (``candidates``, ``out_tokens``) is ``[bs, width]``, contiguous, so a
        step that verifies only ``width`` positions passes its kernels dense rows. The same dict
        for the same set, ``bs`` and ``width``: read it, never assign into it."""
        self.turn ^= 1
        bufs = self.sets[self.turn]
        if bufs is None or bufs["cap"] < bs or bufs["new_seq_lens"].dtype != seq_dtype:
            bufs = self.sets[self.turn] = self._allocate(max(bs, 2 * (bufs or {"cap": 8})["cap"]), seq_dtype)
            self.views[self.turn] = {}
        width = width or self.block_size
        views = self.views[self.turn].get((bs, width))
        if views is not None:
            return views
        if not 1 <= width <= self.block_size:
            raise ValueError(f"verify width {width} outside 1..{self.block_size}")
        views = {k: v[:bs] for k, v in bufs.items() if k != "cap"}
        for k in self.VERIFIED:
            views[k] = bufs[k].view(-1)[: bs * width].view(bs, width)
        self.views[self.turn][bs, width] = views
        return views

    def unit_lens(self, bs: int) -> tuple:
        """``(zeros, ones)``, int32 ``[bs]``: a width-1 step's accept and commit lengths. Shared by
        every such step: nothing writes them (SGLang copies the commit lengths to the host)."""
        if self.units is None or self.units[0].numel() < bs:
            cap = max(bs, 2 * (0 if self.units is None else self.units[0].numel()), 8)
            self.units = (torch.zeros(cap, dtype=torch.int32, device=self.device),
                          torch.ones(cap, dtype=torch.int32, device=self.device))
        return self.units[0][:bs], self.units[1][:bs]

    def _allocate(self, cap: int, seq_dtype: torch.dtype) -> dict:
        B, dev = self.block_size, self.device
        block = lambda: torch.empty((cap, B), dtype=torch.int64, device=dev)  # noqa: E731
        return {
            "cap": cap, "block_ids": block(), "positions": block(), "cache_loc": block(), "candidates": block(),
            "out_tokens": block(), "bonus": torch.empty(cap, dtype=torch.int64, device=dev),
            "accept_len": torch.empty(cap, dtype=torch.int32, device=dev),
            "commit_len": torch.empty(cap, dtype=torch.int32, device=dev),
            "new_seq_lens": torch.empty(cap, dtype=seq_dtype, device=dev),
        }


class DraftWindow:
    """``--speculative-draft-window-size``: the draft's request table holds, per request, the
    slots of the last ``size`` committed positions followed by the block's, so the draft's
    attention (and its CUDA graphs) never reach further back. K/V is still written for every
    position: a radix-cache hit may later need any of them.
    """

    def __init__(self, size: int, block_size: int, shared_pool, device):
        self.size = size
        self.pool = ReqToTokenPool(size=shared_pool.size, max_context_len=size + block_size, device=device,
                                   enable_memory_saver=False)
        self.cols = torch.arange(size + block_size, device=device)

    def fill(self, req_pool_indices, seq_lens, req_to_token) -> torch.Tensor:
        """Rewrite this batch's rows; returns each request's attended context length."""
        ctx_lens = torch.clamp(seq_lens, max=self.size)
        cols = ((seq_lens - ctx_lens)[:, None] + self.cols).clamp_(max=req_to_token.shape[1] - 1)
        self.pool.req_to_token[req_pool_indices] = req_to_token[req_pool_indices[:, None], cols]
        return ctx_lens


class DraftRing(DraftWindow):
    """``SGLANG_DFLASH_DRAFT_RING=1`` under ``--speculative-draft-window-size W``: draft K/V in a
    ring of ``R = W + B`` slots per request row, so draft memory is bounded by the window, not the
    context (docs/design/draft-window-memory.md, option B with a cold window on radix hits).

    Position ``p`` of row ``r`` lives at slot ``r * R + p % R``; row 0 is SGLang's dummy row, where
    padded graph rows land. The window ``[s - W, s)`` and the block ``[s, s + B)`` never share a
    slot. Nothing is kept for a cached prefix: a request that starts on a row (a new owner, or
    SGLang's row generation moved on) attends from its extend on (``lo``), growing back to W.
    """

    def __init__(self, size: int, block_size: int, shared_pool, device):
        super().__init__(size, block_size, shared_pool, device)
        self.ring = size + block_size
        self.rows = shared_pool.size + 1  # SGLang's request rows, dummy row 0 included
        self.tokens = ring_tokens(size, block_size, shared_pool.size)  # the draft's whole KV pool, fixed at start
        self.lo = torch.zeros(self.rows, dtype=torch.int64, device=device)  # first position the row holds
        self.owners: dict[int, tuple] = {}  # row -> (rid, generation) that wrote it last

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The ring slot of each position; ``rows`` per position, or per request (each request's
        positions contiguous and equally many, as in a block)."""
        if rows.numel() != positions.numel():
            rows = rows.reshape(-1, 1).expand(-1, positions.numel() // max(rows.numel(), 1)).reshape(-1)
        return (rows.reshape(positions.shape).to(torch.int64) * self.ring + positions.to(torch.int64) % self.ring)

    def fill(self, req_pool_indices, seq_lens, req_to_token=None) -> torch.Tensor:
        """Rewrite this batch's rows with ring slots; returns each request's attended context length:
        the last W positions, or those since the row's owner started on it."""
        lo = self.lo[req_pool_indices]
        ctx_lens = torch.clamp(torch.minimum(seq_lens.to(torch.int64) - lo, torch.full_like(lo, self.size)), min=0)
        positions = (seq_lens.to(torch.int64) - ctx_lens)[:, None] + self.cols
        table = req_pool_indices.to(torch.int64)[:, None] * self.ring + positions % self.ring
        self.pool.req_to_token[req_pool_indices] = table.to(self.pool.req_to_token.dtype)
        return ctx_lens.to(seq_lens.dtype)

    def start_extend(self, rows: list[int], owners: list[tuple], prefix_lens: list[int]) -> None:
        """Before a prefill's writes: a row with a new owner holds nothing before its prefix."""
        fresh = [(r, p) for r, o, p in zip(rows, owners, prefix_lens) if self.owners.get(r) != o]
        for r, o in zip(rows, owners):
            self.owners[r] = o
        if fresh:  # pinned and async: a prefill must not wait for the step in flight
            index = to_device_async(torch.tensor([r for r, _ in fresh], dtype=torch.int64), self.lo.device)
            value = to_device_async(torch.tensor([p for _, p in fresh], dtype=torch.int64), self.lo.device)
            self.lo.index_copy_(0, index, value)

    def kept(self, extend_lens: list[int]) -> list[int]:
        """Offsets into a prefill's tokens worth writing: each request's last W (older ones are
        overwritten before any window reads them, and one scatter must not hit a slot twice)."""
        out, start = [], 0
        for n in extend_lens:
            out.extend(range(start + max(0, n - self.size), start + n))
            start += n
        return out

    def pool_config(self, config):
        """SGLang's memory pool config for the draft runner, sized to the ring."""
        return dataclasses.replace(config, max_total_num_tokens=self.tokens)


def ring_tokens(window: int, block_size: int, max_running_requests: int) -> int:
    """The most tokens a :class:`DraftRing` holds: a ring per request row and SGLang's dummy row.
    Rows are decided after the target's pool, never more than ``max_running_requests``."""
    return (max_running_requests + 1) * (window + block_size)


def draft_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, tp_size: int,
                             element_size: int) -> int:
    """Draft K/V bytes a token takes on one rank: K and V in every draft layer, the KV heads split
    over tensor-parallel ranks (at least one each)."""
    return num_layers * max(1, num_kv_heads // tp_size) * head_dim * 2 * element_size


def ring_budget(available_bytes: int, target_cell: int, draft_cell: int, ring_bytes: int) -> dict:
    """The target's KV tokens with the draft's K/V in a fixed ring (its bytes set aside first,
    then a token costs the target's own cell) beside a row per target slot (a token costs both)."""
    with_ring = max(available_bytes - ring_bytes, 0) // target_cell if target_cell else 0
    per_slot = available_bytes // (target_cell + draft_cell) if target_cell + draft_cell else 0
    return {"ring_mib": round(ring_bytes / 2**20, 1), "target_bytes_per_token": target_cell,
            "draft_bytes_per_token": draft_cell, "target_tokens": with_ring, "target_tokens_without_ring": per_slot}


def draft_weights_fp8(draft_model) -> bool:
    """The draft's linears were quantised to fp8 (SGLang's online quantisation of a 16-bit checkpoint)."""
    return any(p.dtype == FP8 for p in draft_model.parameters())


class DraftVocab:
    """The lm_head rows the draft's greedy head reads: the ``size`` tokens of this rank's vocabulary
    shard seen most often, prompts and verified tokens counted, kept in id order so that ties break
    as a full argmax does (FR-Spec, arXiv 2502.14856). The draft only proposes: a token outside the
    set is never proposed but is still committed whenever the target picks it. For Qwen3's 152k
    tokens the head then reads 32k rows a step, 0.27 GB instead of 1.2 GB.

    Until anything is counted the set is the lowest ids: byte-level BPE numbers its merges in the
    order they were learnt, most frequent first. The set is rebuilt in place (CUDA graphs read
    ``ids`` and ``weight``) after 256 tokens, then after twice as many each time up to
    ``REFRESH_CAP``; from there on counts halve at each rebuild, so the set follows the traffic.
    """

    REFRESH_FIRST, REFRESH_CAP = 256, 65536

    def __init__(self, weight: torch.Tensor, size: int, vocab_start: int = 0, sharded: bool = False):
        rows = weight.shape[0]
        self.full, self.size, self.vocab_start, self.sharded = weight, size, vocab_start, sharded
        dev = weight.device
        # Below one count: among tokens seen equally often, the lower id wins.
        self.counts = torch.linspace(1e-3, 0.0, rows, dtype=torch.float32, device=dev)
        self.ids = torch.arange(size, dtype=torch.int64, device=dev)  # this shard's rows, ascending
        self.weight = weight[:size].clone()
        self.ones = torch.ones(0, dtype=torch.float32, device=dev)
        self.pending, self.due, self.rebuilds = 0, self.REFRESH_FIRST, 0

    def observe(self, tokens: torch.Tensor, checked: bool = False) -> None:
        """Count ``tokens`` (global ids, any shape). ``checked``: ids may lie outside the vocabulary
        (a prompt's multimodal placeholders); the target's own tokens never do."""
        flat = tokens.reshape(-1)
        if self.vocab_start:
            flat = flat - self.vocab_start
        if self.sharded or checked:  # another rank's token, or none: no count here
            rows = self.counts.shape[0]
            weight = ((flat >= 0) & (flat < rows)).float()
            flat = flat.clamp(0, rows - 1)
        else:  # the decode step's case: one kernel
            if self.ones.numel() < flat.numel():
                self.ones = torch.ones(2 * flat.numel(), dtype=torch.float32, device=self.counts.device)
            weight = self.ones[: flat.numel()]
        self.counts.index_add_(0, flat, weight)
        self.pending += flat.numel()

    def maybe_rebuild(self) -> bool:
        if self.pending < self.due:
            return False
        self.rebuild()
        return True

    def rebuild(self) -> None:
        top = torch.topk(self.counts, self.size, sorted=False).indices.sort().values
        self.ids.copy_(top)
        torch.index_select(self.full, 0, top, out=self.weight)
        if self.due >= self.REFRESH_CAP:
            self.counts.mul_(0.5)
        self.pending, self.due = 0, min(2 * self.due, self.REFRESH_CAP)
        self.rebuilds += 1


class GreedyDraftHead:
    """argmax of the target lm_head over block slots 1..B-1, folded into the draft CUDA graph.

    Writes into a static buffer so graph replays leave the tokens in place. With TP each rank
    reduces its vocab shard, then ranks compare maxima; the lowest rank wins ties, as argmax does.
    With ``vocab_rows`` it reads only that many rows of the lm_head (:class:`DraftVocab`, split
    evenly across TP ranks).
    """

    def __init__(self, lm_head, block_size: int, max_bs: int, fp8: bool = False, vocab_rows: Optional[int] = None):
        self.weight = lm_head.weight
        shard = getattr(lm_head, "shard_indices", None)
        self.vocab_start = int(shard.org_vocab_start_index) if shard is not None else 0
        self.vocab_rows = int(shard.num_org_elements) if shard is not None else self.weight.shape[0]
        self.block_size = block_size
        self.tp_size = get_tp_group().world_size
        self.out = torch.zeros(max_bs * (block_size - 1), dtype=torch.int64, device=self.weight.device)
        rows = self.weight[: self.vocab_rows]  # padded rows excluded
        self.vocab: Optional[DraftVocab] = None
        share = math.ceil(vocab_rows / self.tp_size / 16) * 16 if vocab_rows else 0  # a multiple of 16 a rank
        if share and share < self.vocab_rows and torch.is_floating_point(self.weight):
            self.vocab = DraftVocab(rows, share, self.vocab_start, sharded=self.tp_size > 1)
            rows = self.vocab.weight
        self.rows = rows
        # With an fp8 draft (--speculative-draft-model-quantization fp8) its head reads fp8 too.
        self.fp8: Optional[Fp8RowwiseLinear] = None
        if fp8:
            why_not = Fp8RowwiseLinear.eligible(rows)
            if why_not is None:
                self.fp8 = Fp8RowwiseLinear(rows)
            elif get_parallel().tp_rank == 0:
                logger.info("DFLASH draft head stays in %s: %s", self.weight.dtype, why_not)

    @property
    def rows_read(self) -> Optional[int]:
        """lm_head rows the head reads over all ranks, when it reads only some."""
        return None if self.vocab is None else self.vocab.size * self.tp_size

    def observe(self, tokens: torch.Tensor, checked: bool = False) -> None:
        """Tokens the target read or verified: what the head's rows follow."""
        if self.vocab is not None:
            self.vocab.observe(tokens, checked)

    def maybe_rebuild(self) -> None:
        """Between steps, never inside a graph: the rows the next draft reads."""
        if self.vocab is not None and self.vocab.maybe_rebuild() and self.fp8 is not None:
            self.fp8.refill(self.vocab.weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        hs = hidden.view(-1, self.block_size, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
        if self.fp8 is not None:
            logits = self.fp8(hs)
        else:
            logits = hs.to(self.rows.dtype) @ self.rows.T
        best, idx = logits.max(dim=-1)
        if self.vocab is not None:
            idx = self.vocab.ids[idx]
        idx = idx + self.vocab_start
        if self.tp_size > 1:
            best = tensor_model_parallel_all_gather(best[None], dim=0)
            idx = tensor_model_parallel_all_gather(idx[None], dim=0)
            idx = idx.gather(0, best.argmax(dim=0, keepdim=True))[0]
        return idx

    def capture_hook(self, runner, out, forward_batch, num_tokens) -> None:
        """Inside SGLang's draft graph: leave the tokens where replays will find them."""
        self.draft_into_out(out.hidden_states)

    def draft_into_out(self, hidden: torch.Tensor) -> None:
        """The drafted tokens, written into ``out`` (inside a graph, where its replays read them)."""
        tokens = self(hidden)
        self.out[: tokens.shape[0]].copy_(tokens)
