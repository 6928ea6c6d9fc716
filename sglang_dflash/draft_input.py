"""The draft input the scheduler carries from one DFLASH step to the next.

SGLang's ``DFlashDraftInputV2`` reserves each request's KV for the next step in
``prepare_for_decode``, the scheduler's work before every decode step. Its per-request loop writes
three host tensors element by element: about 0.7 ms of host time a step at 64 requests, which a
plain decode step does not spend. Where the GPU step is short (width 1 under load) the scheduler
loop is host-bound, and those writes show in the step.

:class:`DraftInput` takes the same steps with the lengths gathered in Python lists and written in
one copy each, into buffers kept across draft inputs (:class:`LengthBuffers`). It stands in only
where SGLang's method is the one it was written against (0.5.20-0.5.23, compared by source);
elsewhere the plugin carries SGLang's own class.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

from .compat import source_digest
from .config import bulk_prepare

# sha256 (first 16 hex digits) of SGLang's DFlashDraftInputV2.prepare_for_decode, dedented, in
# the releases whose steps DraftInput.prepare_for_decode repeats (0.5.20 to 0.5.23 alike).
PREPARE_FOR_DECODE_SOURCES = ("67aafcdaff2c6848",)


class LengthSet:
    """One set of the five length buffers ``prepare_for_decode`` fills: committed lengths (host),
    current and next KV lengths (pinned host, then device), and the event after their last use on
    the GPU (the copies and the allocation kernels)."""

    def __init__(self, cap: int, device, pin: bool, timed: bool):
        self.cap = cap
        self.committed_cpu = torch.empty((cap,), dtype=torch.int64, device="cpu")
        self.cur_cpu = torch.empty((cap,), dtype=torch.int32, device="cpu", pin_memory=pin)
        self.nxt_cpu = torch.empty((cap,), dtype=torch.int32, device="cpu", pin_memory=pin)
        self.cur_gpu = torch.empty((cap,), dtype=torch.int32, device=device)
        self.nxt_gpu = torch.empty((cap,), dtype=torch.int32, device=device)
        self.used = torch.cuda.Event() if timed else None

    def record_use(self) -> None:
        """Called on the stream of the set's copies and allocation kernels, after them."""
        if self.used is not None:
            self.used.record()


class LengthBuffers:
    """The length buffers of ``prepare_for_decode``, kept across draft inputs.

    SGLang's draft input allocates them on first use, and the scheduler's draft input is a new one
    every step: five allocations a step, two of pinned memory, which plain decoding never makes.
    Here ``DEPTH`` sets are handed out in turn. A set's host lengths are read by the step it was
    filled for and by that step's result, one scheduler turn later; its pinned and device buffers
    until its event completes. A set whose turn comes before that is replaced, never waited for.
    """

    DEPTH = 4

    def __init__(self, device):
        from sglang.srt.utils.common import is_pin_memory_available  # as SGLang pins these (0.5.20 on)

        self.device = device
        self.pin = is_pin_memory_available(device)
        self.timed = torch.device(device).type == "cuda"
        self.sets: list[Optional[LengthSet]] = [None] * self.DEPTH
        self.turn = 0
        self.taken = self.made = 0  # sets handed out; sets allocated (the first DEPTH, larger batches, replacements)
        self.replaced = 0  # sets still in use on the GPU when their turn came

    def take(self, bs: int) -> LengthSet:
        self.turn = (self.turn + 1) % self.DEPTH
        self.taken += 1
        held = self.sets[self.turn]
        busy = held is not None and held.used is not None and not held.used.query()
        if held is None or held.cap < bs or busy:
            self.replaced += busy
            self.made += 1
            held = self.sets[self.turn] = LengthSet(max(bs, 32, 2 * (held.cap if held else 0)), self.device,
                                                    self.pin, self.timed)
        return held


_LENGTH_BUFFERS: dict[str, LengthBuffers] = {}  # device -> its kept sets (one device a process)


def length_buffers(device: str) -> LengthBuffers:
    kept = _LENGTH_BUFFERS.get(device)
    if kept is None:
        kept = _LENGTH_BUFFERS[device] = LengthBuffers(device)
    return kept


def length_sets_report() -> dict:
    """``/get_server_info``'s ``length_sets``: the sets handed out and allocated since start, and
    those replaced because their GPU work had not completed when their turn came (a ``DEPTH`` too
    small for the overlap schedule shows here)."""
    kept = _LENGTH_BUFFERS.values()
    return {key: sum(getattr(b, key) for b in kept) for key in ("taken", "made", "replaced")}


class DraftInput(DFlashDraftInputV2):
    """``DFlashDraftInputV2`` whose :meth:`prepare_for_decode` fills its host lengths in bulk,
    into length buffers kept across draft inputs (:class:`LengthBuffers`)."""

    def _ensure_prepare_length_buffers(self, bs: int, device) -> None:
        lengths = self._lengths = length_buffers(str(device)).take(bs)
        self._prepare_batch_seq_lens_cpu_buf = lengths.committed_cpu
        self._prepare_cur_kv_lens_cpu_buf, self._prepare_nxt_kv_lens_cpu_buf = lengths.cur_cpu, lengths.nxt_cpu
        self._prepare_cur_kv_lens_gpu_buf, self._prepare_nxt_kv_lens_gpu_buf = lengths.cur_gpu, lengths.nxt_gpu

    def prepare_for_decode(self, batch) -> None:
        """Reserve ``committed + 2B`` KV slots (whole pages) per request for the next step, as
        SGLang does: the worker gathers each block's slots from ``req_to_token``. The host's
        committed lengths lag one step behind; the overlap schedule's resolve corrects them."""
        from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
        from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens
        from sglang.srt.runtime_context import get_spec
        from sglang.srt.speculative.dflash_info_v2 import _get_overlap_plan_stream

        plan_stream, plan_stream_ctx = _get_overlap_plan_stream(batch.device)
        bs = batch.batch_size()
        if bs == 0:
            return
        batch.maybe_evict_swa()
        self._ensure_prepare_length_buffers(bs, batch.device)
        block_size = int(get_spec().speculative_num_draft_tokens)
        if block_size <= 0:
            raise ValueError(f"DFLASH invalid speculative_num_draft_tokens={block_size}.")
        reqs = batch.reqs
        cur_lens, nxt_lens, num_needed_tokens = page_aligned_decode_alloc_lens(
            reqs, reserve=2 * block_size, page_size=batch.token_to_kv_pool_allocator.page_size)
        committed = [int(req.kv.kv_committed_len) for req in reqs]
        top_ks = [int(req.sampling_params.top_k) for req in reqs]
        committed_cpu = self._prepare_batch_seq_lens_cpu_buf[:bs]
        cur_cpu = self._prepare_cur_kv_lens_cpu_buf[:bs]
        nxt_cpu = self._prepare_nxt_kv_lens_cpu_buf[:bs]
        committed_cpu.copy_(torch.tensor(committed, dtype=committed_cpu.dtype))
        cur_cpu.copy_(torch.tensor(cur_lens, dtype=cur_cpu.dtype))
        nxt_cpu.copy_(torch.tensor(nxt_lens, dtype=nxt_cpu.dtype))
        self.max_top_k = max(max(top_ks), 1)
        self.uniform_top_k_value = top_ks[0] if top_ks.count(top_ks[0]) == bs else None

        caller_stream = None
        if plan_stream is not None:
            caller_stream = torch.get_device_module(batch.device).current_stream()
        with plan_stream_ctx:
            if caller_stream is not None:  # filter/merge may have just rebuilt the batch's tensors
                plan_stream.wait_stream(caller_stream)
            cur_gpu = self._prepare_cur_kv_lens_gpu_buf[:bs]
            nxt_gpu = self._prepare_nxt_kv_lens_gpu_buf[:bs]
            cur_gpu.copy_(cur_cpu, non_blocking=True)
            nxt_gpu.copy_(nxt_cpu, non_blocking=True)
            alloc_for_spec_decode(
                batch.tree_cache, batch.req_to_token_pool, reqs=reqs, req_pool_indices=batch.req_pool_indices,
                cur_kv_lens=cur_gpu, cur_kv_lens_cpu=cur_cpu, nxt_kv_lens=nxt_gpu, nxt_kv_lens_cpu=nxt_cpu,
                num_needed_tokens=num_needed_tokens, batch=batch,
            )
            self._lengths.record_use()
        if caller_stream is not None:  # the forward must not see a half-prepared allocation
            caller_stream.wait_stream(plan_stream)
        for req in reqs:
            req.decode_batch_idx += 1
        batch.seq_lens_cpu = committed_cpu
        batch.seq_lens_sum = sum(committed)
        self.nxt_kv_lens_cpu = nxt_cpu
        self.nxt_kv_lens_sum = sum(nxt_lens)


@lru_cache(maxsize=None)
def draft_input_class() -> type:
    """:class:`DraftInput` where SGLang's ``prepare_for_decode`` is one it repeats, else SGLang's class."""
    if not bulk_prepare():
        return DFlashDraftInputV2
    try:
        digest = source_digest(DFlashDraftInputV2.prepare_for_decode)
    except (OSError, TypeError):  # no source to compare
        return DFlashDraftInputV2
    return DraftInput if digest in PREPARE_FOR_DECODE_SOURCES else DFlashDraftInputV2


def bulk_prepare_serves() -> bool:
    return draft_input_class() is DraftInput


def make_draft_input(bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor):
    """The next step's draft input: the bonus token and committed length of each request (the
    EAGLE-shaped fields SGLang's class keeps stay empty)."""
    topk_p, topk_index, hidden_states = eagle_fields(int(new_seq_lens.numel()), bonus_tokens.device)
    return draft_input_class()(
        topk_p=topk_p, topk_index=topk_index, hidden_states=hidden_states,
        bonus_tokens=bonus_tokens.to(dtype=torch.int64),
        new_seq_lens=new_seq_lens.to(dtype=torch.int64),
    )


@lru_cache(maxsize=512)
def eagle_fields(bs: int, device: torch.device) -> tuple:
    """The draft input's EAGLE-shaped fields, ``[bs, 0]``: no storage, so one set a batch size
    serves every step (SGLang's filter and merge build new tensors from them)."""
    return (torch.empty((bs, 0), device=device, dtype=torch.float32),
            torch.empty((bs, 0), device=device, dtype=torch.int64),
            torch.empty((bs, 0), device=device, dtype=torch.float16))
