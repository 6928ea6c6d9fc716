"""The draft pass in CUDA graphs the plugin captures and replays itself.

SGLang's runner replays the draft's graphs too, but each replay costs about half a millisecond of
host time or more whatever the batch (a ForwardBatch built and checked, its inputs copied into the
runner's buffers, the padding reset, the output sliced and wrapped): on a small pair, where the host
sets the step's length, the draft phase took as long as plain decoding's whole worker call
(results/adaptive/README.md). Here the block set-up writes the block's ids, positions and KV slots
straight into the graph's inputs, two copies add the requests' rows and lengths, and one ``replay``
runs the embedding, the draft layers and the greedy head (0.17 ms for the whole draft phase against
the runner's 0.64 at c32, SmolLM2 on an H100).

That holds only where every attention call of the pass is the plugin's block kernel over the
request table (``block_attention_route.serve_pass_by_table``), which reads nothing the attention
backend plans before a replay. :meth:`DraftPassGraphs.capture` checks it on the warm-up pass and
gives up (SGLang's runner keeps serving) where any call went elsewhere. A draft only proposes:
whatever it drafts, the target's verify decides what is committed, so a wrong draft costs
acceptance, never tokens.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from .block_attention_route import ROUTE


class DraftGraphUnserved(RuntimeError):
    """Why the plugin's own draft graphs cannot serve this server (SGLang's runner does instead)."""


class PadRows:
    """Which leading rows of the graphs' inputs hold a real request's values. Rows past a replay's
    batch must be padding: the pass writes K/V at every row's slots, and a stale row would write
    over a live request's draft K/V. Rows are reset only when a batch is smaller than one before."""

    def __init__(self):
        self.live = 0  # rows [0, live) may hold real values

    def to_reset(self, bs: int) -> Optional[tuple[int, int]]:
        """The rows to pad before a replay of ``bs`` requests, or None; then ``bs`` rows are live."""
        stale = (bs, self.live) if self.live > bs else None
        self.live = bs
        return stale


def draft_forward_batch(block_ids: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor, rows: torch.Tensor,
                        lens: torch.Tensor, lens_cpu: torch.Tensor, input_embeds: Optional[torch.Tensor] = None
                        ) -> ForwardBatch:
    """The draft pass as a TARGET_VERIFY forward: the block's ids ``[bs, B]``, its positions and KV slots
    (``bs * B`` in either shape), each request's row and attended context length (``lens``, and on the
    host ``lens_cpu``)."""
    bs, B = block_ids.shape
    ids, positions = block_ids.reshape(-1), positions.reshape(-1)
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=ids, req_pool_indices=rows, seq_lens=lens,
        out_cache_loc=cache_loc.reshape(-1), seq_lens_sum=int(lens_cpu.sum()), seq_lens_cpu=lens_cpu,
        positions=positions, input_embeds=input_embeds, spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=DFlashVerifyInput(draft_token=ids, positions=positions, draft_token_num=B,
                                    capture_hidden_mode=CaptureHiddenMode.NULL),
        capture_hidden_mode=CaptureHiddenMode.NULL,
    )


def graph_size(sizes: tuple, bs: int) -> Optional[int]:
    """The smallest captured batch size holding ``bs`` requests (``sizes`` ascending), or None."""
    for size in sizes:
        if size >= bs:
            return size
    return None


class DraftPassGraphs:
    """One CUDA graph per batch size of the draft's own capture list, all on shared inputs:
    ``block_ids``, ``positions`` and ``cache_loc`` ``[max_bs, B]``, the request rows and their
    committed lengths ``[max_bs]``. The drafted tokens land in the greedy head's ``out``."""

    def __init__(self, *, embed: Callable, draft_model, attn_backend, head, block_size: int, sizes,
                 device, pad_len: int = 1):
        self.embed, self.draft_model, self.attn_backend, self.head = embed, draft_model, attn_backend, head
        self.block_size = block_size
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))
        if not self.sizes:
            raise DraftGraphUnserved("no batch sizes to capture")
        self.pad_len = pad_len
        top, B = self.sizes[-1], block_size
        if head.out.numel() < top * (B - 1):
            raise DraftGraphUnserved(f"the greedy head holds {head.out.numel()} tokens, not {top * (B - 1)}")
        self.block_ids = torch.zeros((top, B), dtype=torch.int64, device=device)
        self.positions = torch.zeros((top, B), dtype=torch.int64, device=device)
        self.cache_loc = torch.zeros((top, B), dtype=torch.int64, device=device)
        self.rows = torch.zeros((top,), dtype=torch.int64, device=device)
        self.lens = torch.full((top,), pad_len, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pad = PadRows()
        self.replays = 0
        self.layers = sum(1 for m in draft_model.modules() if type(m).__name__ == "RadixAttention")

    # ---- capture ------------------------------------------------------------------------------

    def forward_batch(self, size: int) -> ForwardBatch:
        """The pass over the first ``size`` rows of the shared inputs."""
        return draft_forward_batch(self.block_ids[:size], self.positions[:size], self.cache_loc[:size], self.rows[:size],
                                   self.lens[:size], torch.full((size,), self.pad_len, dtype=torch.int64))

    def _pass(self, forward_batch: ForwardBatch, size: int) -> None:
        B = self.block_size
        embeds = self.embed(self.block_ids[:size].view(-1)).view(size * B, -1)
        out = self.draft_model(forward_batch.input_ids, forward_batch.positions, forward_batch, input_embeds=embeds)
        self.head.draft_into_out(out.hidden_states)

    def capture(self, bind_plan: Optional[Callable] = None) -> None:
        """Capture every size, the largest first, in one memory pool. Raises
        :class:`DraftGraphUnserved` where a warm-up pass was not all the block kernel's by the table."""
        pool = torch.cuda.graph_pool_handle()
        prev = set_forward_context(ForwardContext(attn_backend=self.attn_backend))
        try:
            with torch.inference_mode():
                for size in reversed(self.sizes):
                    forward_batch = self.forward_batch(size)
                    if bind_plan is not None:
                        bind_plan(forward_batch)
                    served = ROUTE.served_whole
                    self._pass(forward_batch, size)
                    if ROUTE.served_whole - served != self.layers:
                        raise DraftGraphUnserved(
                            f"{ROUTE.served_whole - served} of the pass's {self.layers} attention calls were the "
                            "block kernel's over the request table")
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._pass(forward_batch, size)
                    self.graphs[size] = graph
            torch.cuda.synchronize()
        finally:
            set_forward_context(prev)

    # ---- each step ----------------------------------------------------------------------------

    def serves(self, bs: int) -> bool:
        return 0 < bs <= self.sizes[-1]

    def inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``block_ids``, ``positions`` and ``cache_loc`` ``[bs, B]`` for the block set-up to fill."""
        return self.block_ids[:bs], self.positions[:bs], self.cache_loc[:bs]

    def replay(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The pass over the block the set-up wrote for these requests; their drafts ``[bs * (B-1)]``."""
        bs = len(seq_lens)
        stale = self.pad.to_reset(bs)
        if stale is not None:
            lo, hi = stale
            for buf in (self.block_ids, self.positions, self.cache_loc, self.rows):
                buf[lo:hi].zero_()
            self.lens[lo:hi].fill_(self.pad_len)
        self.rows[:bs].copy_(req_pool_indices)
        self.lens[:bs].copy_(seq_lens)
        self.graphs[graph_size(self.sizes, bs)].replay()
        self.replays += 1
        return self.head.out[: bs * (self.block_size - 1)]
