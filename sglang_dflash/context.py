"""The draft's context: the target's tapped hidden states, projected by the draft's ``fc`` and
``hidden_norm``, kept as K/V in every draft layer, which the draft's block attends to.

Written at each prefill (:meth:`DraftContext.write_prefill_context`) and for each step's committed
tokens (:meth:`DraftContext.commit_context`, or inside the target's verify graphs:
:class:`ContextInVerifyGraph`). Where it lives (:meth:`DraftContext.claim_draft_window`):
- by default at the target's own KV slots, one draft row per target slot, so a radix-cache hit finds
  its prefix's draft K/V in place;
- with ``--speculative-draft-window-size W`` the same, read through a request table of the last W
  positions (:class:`~sglang_dflash.draft.DraftWindow`);
- with ``SGLANG_DFLASH_DRAFT_RING=1`` as well, in a ring of W + B slots per request row
  (:class:`~sglang_dflash.draft.DraftRing`): draft memory fixed by the window, a radix hit cold.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Optional

import torch

from sglang.srt.runtime_context import get_parallel

from .config import DRAFT_RING_ENV, RAGGED_ENV, draft_ring, ragged_verify, read_draft_shape
from .draft import DraftBlock, DraftRing, DraftWindow, draft_kv_bytes_per_token, ring_budget, ring_tokens
from .host_pauses import admission_phase, host_phase
from .sampling import to_device_async

logger = logging.getLogger("sglang_dflash")
# What the target's KV pool was sized on under the ring, in this process (``dflash.draft_kv.budget``).
RING_BUDGET: dict = {}


def ring_unserved(server_args, release, ragged: bool) -> Optional[str]:
    """Why draft K/V cannot live in a ring on this server, or None: whatever reads the draft pool by
    the target's slot (the hierarchical cache's backup, PD transfer) or pages it would miss it.
    Asked before any pool exists too, by the target's KV budget (:func:`size_target_cell_for_ring`)."""
    args = release.resolving(server_args)
    if ragged:
        return f"not with {RAGGED_ENV}"
    if getattr(args, "enable_hierarchical_cache", False):
        return "the hierarchical cache backs draft K/V up by the target's slots"
    if (getattr(args, "page_size", None) or 1) != 1:
        return "page_size above 1"
    if release.pd_role(args) is not None:
        return "PD disaggregation moves draft K/V by the target's slots"
    return None


def size_target_cell_for_ring(init, configurator, kvc, release) -> None:
    """Under the ring the draft's K/V no longer grows with the target's tokens (step 3 of
    docs/design/draft-window-memory.md). SGLang's ``DefaultPoolConfigurator`` prices a token at the
    target's K/V plus the draft's; here, once ``init`` has run, the target's cell is priced alone
    (SGLang's draft-layer count hidden from a second ``init``) and the ring's bytes, for the rows the
    server may hold, are set aside whole (:func:`set_aside_ring`). Anything unreadable leaves
    SGLang's sizing as it is, which over-reserves for the ring and is safe."""
    if kvc.is_draft_worker or not kvc.spec_algorithm.is_dflash_family():
        return
    args = kvc.server_args
    window = release.spec_setting(args, "speculative_draft_window_size")
    block = release.spec_setting(args, "speculative_num_draft_tokens")
    rows = release.schedule_setting(args, "max_running_requests")
    config_class = getattr(sys.modules.get(type(configurator).__module__), "MemoryPoolConfig", None)
    with_draft = getattr(configurator, "_cell_size", None)
    aux = getattr(kvc, "spec_aux_config", None)
    if (None in (window, block, rows, with_draft, aux) or not dataclasses.is_dataclass(config_class)
            or ring_unserved(args, release, ragged_verify()) is not None):
        return
    cfg = read_draft_shape(args.speculative_draft_model_path)
    if cfg is None:
        return
    try:
        element = torch._utils._element_size(kvc.kv_cache_dtype)
    except (AttributeError, RuntimeError, TypeError):  # a packed dtype: SGLang's own figure alone
        element = 0
    own = draft_kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                   int(getattr(args, "tp_size", 1) or 1), element)
    layers, aux.dflash_draft_num_layers = aux.dflash_draft_num_layers, None
    try:
        init(configurator, kvc)
    finally:
        aux.dflash_draft_num_layers = layers
    target_cell = configurator._cell_size
    draft_cell = max(with_draft - target_cell, own)  # SGLang's figure where larger: it was sized on it
    if draft_cell <= 0 or target_cell <= 0:  # nothing to set aside by: SGLang's sizing stands
        configurator._cell_size = with_draft
        return
    configurator.dflash_ring = (target_cell, draft_cell, ring_tokens(int(window), int(block), int(rows)) * draft_cell)


def set_aside_ring(configurator, available_bytes: int) -> int:
    """The bytes left for the target's KV pool once the ring's are set aside (all of them without a
    ring), noting what the pool was sized on for the report and the log."""
    ring = getattr(configurator, "dflash_ring", None)
    if ring is None:
        return available_bytes
    target_cell, draft_cell, ring_bytes = ring
    budget = ring_budget(available_bytes, target_cell, draft_cell, ring_bytes)
    if budget != RING_BUDGET and get_parallel().tp_rank == 0:
        logger.info("DFLASH draft ring: %.1f MiB set aside; the target's KV pool at %d bytes a token instead of %d: "
                    "%d tokens instead of %d", budget["ring_mib"], target_cell, target_cell + draft_cell,
                    budget["target_tokens"], budget["target_tokens_without_ring"])
        if budget["target_tokens"] < budget["target_tokens_without_ring"]:
            logger.warning("DFLASH draft ring: it takes more than a draft row per target token would at this "
                           "budget; fewer --max-running-requests or no %s gives the target more tokens",
                           DRAFT_RING_ENV)
    RING_BUDGET.clear()
    RING_BUDGET.update(budget)
    return max(available_bytes - ring_bytes, 0)


class ContextInVerifyGraph:
    """Draft context K/V written inside the target's verify CUDA graphs (a capture-tail hook):
    one replay each step instead of a dozen eager launches and their Python.

    Every row of the block is written, accepted or not (the accept comes after the verify). A
    rejected row is never read: the next block starts at the first rejected position, and the
    draft writes its own K/V over the block's slots before it attends to them. The width-1
    runner's DECODE graphs (:meth:`DFlashWorker.decode_step`) hold the write too: their one row
    per request is the bonus, always committed. Padded rows write slot 0, SGLang's dummy slot.
    """

    def __init__(self, write_context_kv):
        self.write_context_kv = write_context_kv
        self.runners: set[int] = set()  # graph runners whose graphs (verify, or width-1 decode) hold the write
        self.ring: Optional[DraftRing] = None  # draft K/V in a ring: slots from the rows and positions

    def capture_hook(self, runner, out, forward_batch, num_tokens) -> None:
        mode = forward_batch.forward_mode
        if runner.model_runner.is_draft_worker or not (mode.is_target_verify() or mode.is_decode()):
            return  # the target's DECODE graphs under DFLASH are the width-1 runner's alone
        hidden = getattr(out, "hidden_states", None)
        if hidden is None:
            return
        loc = forward_batch.out_cache_loc
        if self.ring is not None:  # padded rows are row 0, SGLang's dummy row, in the ring as in the pool
            loc = self.ring.slots(forward_batch.req_pool_indices, forward_batch.positions)
        self.write_context_kv(hidden, forward_batch.positions, loc)
        self.runners.add(id(runner))

    def wrote(self, runner, ran_graph: bool) -> bool:
        """Whether the verify that just ran wrote the context: a graph replay of a runner whose
        graphs hold the write."""
        return ran_graph and id(runner) in self.runners


class DraftContext:
    """The worker's side of the draft context (a mixin of :class:`~sglang_dflash.worker.DFlashWorker`,
    whose pools, models and release it uses)."""

    def claim_draft_window(self, memory_pool_config, req_to_token_pool):
        """The draft's request table and, in a ring, its pool size: the config the draft runner's
        pools are built from."""
        if self.window_size is not None:
            why_not = self._draft_ring_unserved(memory_pool_config) if draft_ring() else "off"
            if why_not is None:
                self.window = DraftRing(int(self.window_size), self.block_size, req_to_token_pool, self.device)
                memory_pool_config = self.window.pool_config(memory_pool_config)
                if self.context_in_graph is not None:
                    self.context_in_graph.ring = self.window
                if get_parallel().tp_rank == 0:
                    logger.info("DFLASH draft K/V in a ring of %d slots a request (window %d + block %d): "
                                "%d tokens in all", self.window.ring, self.window.size, self.block_size,
                                self.window.tokens)
            else:
                if why_not != "off" and get_parallel().tp_rank == 0:
                    logger.warning("DFLASH %s=1 not served (%s): draft K/V is kept for every position",
                                   DRAFT_RING_ENV, why_not)
                self.window = DraftWindow(int(self.window_size), self.block_size, req_to_token_pool, self.device)
        return memory_pool_config

    def _draft_ring_unserved(self, memory_pool_config) -> Optional[str]:
        """Why draft K/V cannot live in a ring here, or None (:func:`ring_unserved`)."""
        if memory_pool_config is None or not dataclasses.is_dataclass(memory_pool_config):
            return "this release hands the draft no pool config to size"
        return ring_unserved(self.server_args, self.release, self.ragged)

    def draft_kv_report(self) -> dict:
        """How the draft's K/V is kept: a row per target slot, or a ring per request (its size fixed
        at start, whatever the context)."""
        pool = getattr(self.draft_model_runner, "token_to_kv_pool", None)
        report = {"layout": "ring" if isinstance(self.window, DraftRing) else "every position",
                  "tokens": getattr(pool, "size", None), "window": self.window.size if self.window else None}
        if isinstance(self.window, DraftRing):
            report["ring_slots_per_request"] = self.window.ring
            if RING_BUDGET:  # the target's pool sized without a draft row per token
                report["budget"] = dict(RING_BUDGET)
        return report

    @admission_phase("draft context")
    def write_prefill_context(self, batch, hidden) -> None:
        """Draft K/V for a prefill's new tokens, at their target slots or in the ring."""
        positions = extend_positions(batch.prefix_lens, batch.extend_lens, self.device)
        if isinstance(self.window, DraftRing):
            self.write_ring_prefill(batch, hidden, positions)
        else:
            self.write_context_kv(hidden, positions, batch.out_cache_loc)

    def write_ring_prefill(self, batch, hidden, positions) -> None:
        """The prefill's draft context in the ring: each request's last W tokens, after its row is
        claimed (a row with a new owner holds nothing before the request's prefix)."""
        ring, pool = self.window, self.model_runner.req_to_token_pool
        rows = [self.release.request_row(req) for req in batch.reqs]
        owners = [(req.rid, self.release.row_generation(pool, row)) for req, row in zip(batch.reqs, rows)]
        ring.start_extend(rows, owners, list(batch.prefix_lens))
        kept = ring.kept(list(batch.extend_lens))
        if not kept:
            return
        keep = to_device_async(torch.tensor(kept, dtype=torch.int64), self.device)
        # each request's row once for each token kept of it: its last min(n, W), as ring.kept orders them
        kept_rows = to_device_async(torch.tensor([r for r, n in zip(rows, batch.extend_lens)
                                                  for _ in range(min(int(n), ring.size))], dtype=torch.int64), self.device)
        kept_positions = positions[keep]
        self.write_context_kv(hidden[keep], kept_positions, ring.slots(kept_rows, kept_positions))

    @host_phase("context")
    def commit_context(self, hidden: torch.Tensor, block: DraftBlock, commit_len: torch.Tensor,
                       req_pool_indices: Optional[torch.Tensor] = None) -> None:
        """Draft K/V for the committed prefix of each block (rows past commit_len are skipped)."""
        if hidden is None:
            raise RuntimeError("target verify returned no tapped hidden states")
        loc = block.cache_loc
        if isinstance(self.window, DraftRing):
            loc = self.window.slots(req_pool_indices, block.positions).view_as(block.cache_loc)
        self.write_context_kv(hidden, block.positions, loc, commit_len)

    @torch.inference_mode()
    def write_context_kv(self, hidden, positions, cache_loc, commit_len=None) -> None:
        """Project target features once, then write every draft layer's K (normed, rotated) and V."""
        if hidden.numel() == 0:
            return
        ctx = self.draft_model.project_target_hidden(hidden)
        pool = self.draft_model_runner.token_to_kv_pool
        for attn, k, v in self.draft_model.context_kv(positions, ctx):
            if commit_len is None:
                pool.set_kv_buffer(attn, cache_loc, k, v, attn.k_scale, attn.v_scale)
            else:
                pool.set_kv_buffer_prefix_valid(attn, cache_loc, commit_len, k, v, attn.k_scale, attn.v_scale)


def extend_positions(prefix_lens: list[int], extend_lens: list[int], device) -> torch.Tensor:
    """Positions of a prefill's new tokens, request after request. Built on the host from the
    scheduler's lists and sent from pinned memory: the host does not wait for the prefill."""
    ext, pre = torch.tensor(extend_lens, dtype=torch.int64), torch.tensor(prefix_lens, dtype=torch.int64)
    shift = torch.repeat_interleave(torch.cumsum(ext, 0) - ext - pre, ext)
    return to_device_async(torch.arange(int(ext.sum())) - shift, device)
