"""The plugin's DFLASH speculative worker for SGLang's spec-v2 scheduler (overlap or not).

One decode step for a batch of requests, each with ``seq_len`` committed tokens in the target KV
and one pending token (the previous step's bonus):

1. :meth:`DFlashWorker.draft_step`: block ``[bonus, mask x (B-1)]`` at positions
   ``seq_len + 0..B-1`` through the draft in one non-causal pass; greedy drafts from the
   target's lm_head.
2. :meth:`DFlashWorker.verify_step`: the target runs the B candidates causally (TARGET_VERIFY),
   returning logits and the tapped hidden states for every candidate.
3. :meth:`DFlashWorker.accept_step`: each position's logits take the request's parameters as
   plain decoding would at that token (penalties after the block's tokens before it, logit
   bias, custom processors; ``sampling.py``); then the longest prefix where draft == target
   choice, plus the target's bonus token (greedy argmax, or a target sample for temperature > 0).
   Logprobs of the committed tokens come from the same logits.
4. :meth:`DFlashWorker.commit_context`: draft K/V for the ``accept + 1`` committed positions,
   from the verify's hidden states. Rejected rows are never written.

Hybrid targets (gated delta net / mamba layers): the verify leaves the recurrent state of every
block step aside; :meth:`DFlashWorker.commit_recurrent_state` keeps the last committed step's and,
with the radix cache's ``extra_buffer`` strategy, snapshots the step at a crossed track boundary.
A narrower verify writes its steps into the same block-sized scratch, and is committed through its
own width's backend. Width 1 is a DECODE there too, which advances the state in place: nothing to
commit, and a crossed track boundary is copied from the live state (:meth:`DFlashWorker.track_decoded_state`).

Verify width (adaptive by default; ``SGLANG_DFLASH_WIDTHS``): a step may verify only the first w of the
B candidates (w = 1: the bonus alone, no draft pass), on a target attention backend and verify
graphs built for w (:meth:`DFlashWorker.target_at_width`). On triton and FA3, width 1 is a plain
DECODE forward with DECODE graphs (:meth:`DFlashWorker.decode_step`). The width policy
(``adaptive.py``) learns acceptance and step time from :meth:`DFlashWorker.on_verify_complete_cpu`.

``--speculative-draft-window-size W``: the draft attends to the last W committed positions only,
through a request table of its own (:class:`~sglang_dflash.draft.DraftWindow`); the target still sees
everything. The draft side's parts (block, buffers, window, greedy head) live in ``draft.py``; where
and when the draft context is written (prefill, commit, the verify graphs' hook) in ``context.py``.

KV slots: the scheduler reserves ``committed + 2B`` slots per request ahead of each step
(``DFlashDraftInputV2.prepare_for_decode``, in bulk where ``draft_input.py`` repeats it); target and
draft KV share that index space, and the next step overwrites any rejected tail, so nothing is
freed or leaked per step.

The scheduler-facing data classes (``DFlashDraftInputV2``, ``DFlashVerifyInput``) are SGLang's (the
draft input at most a subclass): the scheduler, FutureMap and attention backends branch on their types.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Optional

import torch

from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, mambaish_config
from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_exec, get_parallel
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask, prepare_mamba_track_for_verify

from . import compat
from .adaptive import ASLEEP, learn_step, make_width_policy, step_widths
from .config import (DRAFT_GRAPHS_ENV, DRAFT_VOCAB_ENV, HYBRID_DECODE_ENV, RAGGED_ENV, WIDTHS_ENV, DFlashConfigError,
                     TargetInfo, context_in_verify_graph, draft_attention_default, draft_fallback, draft_vocab_rows,
                     half_verify_logits, hybrid_decode, own_draft_graphs, ragged_verify, read_draft_shape,
                     verify_widths, widths_by_default, width_policy_kind)
from .context import ContextInVerifyGraph, DraftContext
from .draft import DraftBlock, DraftRing, DraftWindow, GreedyDraftHead, StepBuffers, draft_weights_fp8
from .block_attention_route import ROUTE as BLOCK_ROUTE
from .block_attention_route import as_the_scheduler_sees, route_block_attention
from .draft_graph import DraftGraphUnserved, DraftPassGraphs, draft_forward_batch
from .draft_input import bulk_prepare_serves, draft_input_class, length_sets_report, make_draft_input
from .fallback import make_fallback
from .gdn_state import SnapshotState, install_verify_redirect, keeps_state_in_snapshots
from .host_pauses import StepStalls, admission_phase, call_shape, host_phase, policy_time, process_pauses
from .ops import accept_block, load_accept_block, prepare_block
from .ops.ragged import RaggedLanes
from .sampling import (HalfVerifyLogits, OutputCounts, PlainDecodingKernels, argmax_only, plain_decoding_kernels,
                       row_chunks)
from .step_clock import StepClock

logger = logging.getLogger("sglang_dflash")

MASK_TOKEN = "<|MASK|>"
WIDTHS_LOG_EVERY = 2000  # decode steps between two log lines of the verify widths used (adaptive width)
RID = attrgetter("rid")  # a request's id, read by a C loop over the batch every decode step


@dataclass
class Accepted:
    accept_len: torch.Tensor  # [bs] drafts accepted
    commit_len: torch.Tensor  # [bs] accept_len + 1 (the bonus)
    bonus: torch.Tensor  # [bs] next step's pending token
    out_tokens: torch.Tensor  # [bs, w]: committed tokens first
    new_seq_lens: torch.Tensor  # [bs]


def mamba_track_steps(seq_lens: torch.Tensor, commit_len: torch.Tensor, interval: int) -> torch.Tensor:
    """Per request, the verify step whose recurrent state is the checkpoint at a track boundary
    crossed by this step's commit, else -1.

    Step i leaves the state after ``seq_len + i + 1`` tokens, so the boundary ``T`` is step
    ``T - seq_len - 1``. The crossing is judged on the committed length, the one the scheduler
    also uses to mark the checkpoint (comparing against the pre-verify length misses every
    checkpoint: SGLang 0.5.17's built-in, upstream issue 37817).
    """
    new_lens = seq_lens.to(torch.int64) + commit_len.to(torch.int64)
    boundary = new_lens // interval * interval
    crossed = boundary > seq_lens
    return torch.where(crossed, boundary - seq_lens - 1, torch.full_like(boundary, -1))


def decode_may_reach_track(committed_cpu: torch.Tensor, interval: int, block_size: int) -> bool:
    """Whether a width-1 DECODE may bring some request to a track boundary, read on the host.

    The host's committed lengths lag the device's by at most one step of at most ``block_size``
    tokens; SGLang's lazy track plan allows twice that (``mamba_lazy_spec_in_window``), and so do
    we. The decoded length then lies in ``[committed + 1, committed + 2B + 1]``; a boundary is a
    multiple of ``interval``.
    """
    reach = 2 * block_size + 1  # a multiple of interval in (c, c + reach] iff c % interval + reach >= interval
    return any(c % interval + reach >= interval for c in committed_cpu.tolist())  # Python ints: a tenth of torch's host cost


class DFlashWorker(DraftContext, BaseSpecWorker):
    """Spec-v2 worker for ``--speculative-algorithm DFLASH`` (see the module docstring)."""

    # Requests prefilled since the last decode step: the width policy hears of them there. On the
    # class too, as unknown names go to the target worker (``__getattr__``).
    joined = 0
    # Hybrid GDN targets: each request's SSM state kept in the verify's snapshot rows (gdn_state)
    gdn_state: Optional[SnapshotState] = None
    # The draft pass in the plugin's own CUDA graphs (draft_graph.py), or why SGLang's runner replays it
    draft_graphs: Optional[DraftPassGraphs] = None
    draft_graphs_off: Optional[str] = None
    runner_drafts = 0  # draft passes through SGLang's runner (the plugin's own graphs count their replays)

    def __init__(self, server_args, gpu_id, nccl_port, target_worker, ps=None):
        super().__init__()  # ``ps`` (parallel state) comes up to SGLang 0.5.20 only
        self.release = compat.running()
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        target_config = self.model_runner.model_config
        self.hybrid = mambaish_config(target_config) is not None
        self.hybrid_gdn = hybrid_gdn_config(target_config) is not None  # Qwen3.5/3.6, Qwen3-Next
        self.window_size = self.release.spec_setting(server_args, "speculative_draft_window_size")
        draft_backend = draft_attention_default(
            server_args, self.release.target_attention_backend(server_args), get_parallel().tp_size, self.window_size,
            read_draft_shape(self.release.spec_setting(server_args, "speculative_draft_model_path"),
                             self.release.spec_setting(server_args, "speculative_draft_model_revision")),
            decode_graphs=decode_graph_config().backend != Backend.DISABLED)
        bundle = self.release.build_draft_worker(server_args, gpu_id, nccl_port, target_config, ps=ps,
                                                 attention_backend=draft_backend)
        if draft_backend is not None and get_parallel().tp_rank == 0:
            logger.info("DFLASH draft attends on %s, which the plugin's own draft graphs serve "
                        "(--speculative-draft-attention-backend keeps SGLang's choice)", draft_backend)
        self._draft_worker = bundle.draft_worker
        self.draft_model_runner = bundle.draft_model_runner
        self.draft_model = bundle.draft_model
        text = target_config.hf_text_config
        target = TargetInfo(text.hidden_size, text.num_hidden_layers, target_config.vocab_size, target_config.context_len)
        self.block_size = int(self.release.spec_setting(server_args, "speculative_num_draft_tokens"))
        self.speculative_num_draft_tokens = self.block_size
        self.config = self.draft_model.dflash_config.with_block_size(self.block_size).resolve_for_target(target)
        self.mask_token_id = self._resolve_mask_token_id()
        self.draft_head: Optional[GreedyDraftHead] = None  # set with the CUDA graphs
        self.window: Optional[DraftWindow] = None  # set with the memory pools
        self.buffers = StepBuffers(self.block_size, self.device)
        self.sampling_kernels = plain_decoding_kernels(self.release.sampling_backend())
        self.output_counts = OutputCounts(target_config.vocab_size, self.device, self.release.min_new_tokens_stop_ids)
        self.head_in_graph = False
        self.widths = verify_widths(self.block_size)
        self.width_policy = None  # None: a fixed block
        self.clock = StepClock()  # times decode steps for the width policy
        if len(self.widths) > 1:
            why_not = self._adaptive_width_unserved(server_args)
            if why_not is not None:
                self._fix_the_block(why_not)
            else:
                self.width_policy = make_width_policy(width_policy_kind(), self.block_size, self.widths,
                                                      draft_fallback(self.widths))
                self.width_policy.read_timing = self.clock.seconds  # steps are timed by CUDA events
        # Per request: a request whose drafts keep failing accepts none for a while (fallback.DraftHealth).
        self.fallback = make_fallback(draft_fallback(self.widths))
        self.widths_logged_at = 0
        # Each request's own width in one verify (SGLang's compact ragged graphs; set up with the backends).
        self.ragged = ragged_verify()
        if self.ragged and self.fallback is None:
            raise DFlashConfigError(RAGGED_ENV, "needs the per-request fallback (SGLANG_DFLASH_WIDTHS holding 1)")
        self.width_pairs: dict = {}  # width -> (target attention backend, graph runner); B's is the target's own
        self.width_one_decodes = False  # width 1 as a plain DECODE forward (compat.DECODE_AT_WIDTH_ONE)
        self.width_one_step: Optional[str] = None  # on hybrid targets: how width 1 runs, and why
        # (width, bs, (start, end) events, (rids, per-request widths) or None) of the steps whose
        # accept lengths are due
        self.steps_in_flight: deque = deque()
        # Decode steps, and the drafts and verifies among them that ran outside CUDA graphs (each one
        # slows a host-bound server down).
        self.decode_steps, self.eager_drafts = 0, 0
        self.prefills, self.prefills_in_graphs = 0, 0  # target prefills, and those SGLang replayed from its graphs
        self.eager_verifies: Counter = Counter()  # width -> verifies that ran outside CUDA graphs
        self.decode_track: Counter = Counter()  # hybrid width-1 DECODEs: track slots "prepared" or "skipped"
        self.verify_track: Counter = Counter()  # hybrid verify commits: track boundaries "scattered" or "skipped"
        self.context_in_graph: Optional[ContextInVerifyGraph] = None
        if context_in_verify_graph():
            # Registered before the scheduler captures the target's graphs (it does so first).
            self.draft_model.prepare_context_kv(self.device)
            self.context_in_graph = ContextInVerifyGraph(self.write_context_kv)
            self.model_runner.capture_tail_hooks.append(self.context_in_graph.capture_hook)
        self.half_logits = self._half_verify_logits()
        self.pauses = process_pauses()  # from now on, for /get_server_info
        self.stalls = StepStalls()
        if get_parallel().tp_rank == 0:
            logger.info(
                "DFLASH is served by sglang-dflash (SGLang %s, %s): block_size=%d, mask_token_id=%d, "
                "draft layers=%d (%s), target_layer_ids=%s, draft attention backend=%s, KV reservation %s",
                self.release.version, self.release.family, self.block_size, self.mask_token_id, self.config.num_hidden_layers,
                ",".join(sorted(set(self.config.layer_types))), list(self.config.target_layer_ids),
                bundle.resolved_attention_backend, "in bulk" if bulk_prepare_serves() else "SGLang's own",
            )

    def _half_verify_logits(self) -> Optional[HalfVerifyLogits]:
        """Verify logits in the model's dtype (:class:`HalfVerifyLogits`), installed before the
        scheduler captures the target's graphs; None where SGLang's float32 path must stay."""
        if not half_verify_logits():
            return None
        model = self.model_runner.model
        processor, lm_head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
        why_not = "no logits processor" if processor is None else HalfVerifyLogits.unserved(processor, lm_head)
        if why_not is not None:
            if get_parallel().tp_rank == 0:
                logger.info("DFLASH verify logits cast to float32 in every verify (%s)", why_not)
            return None
        half = HalfVerifyLogits(processor)
        half.install()
        return half

    def _adaptive_width_unserved(self, server_args) -> Optional[str]:
        """Why a step cannot choose its width here, or None: each rank must be free to choose alone,
        and a hybrid target must commit its recurrent state the way a gated delta net does."""
        if get_parallel().tp_size > 1 or self.release.dp_attention(server_args):
            return "needs --tp-size 1 without DP attention: each rank would time its steps and choose its own width"
        if self.hybrid:
            return self._hybrid_widths_unserved(server_args)
        return None

    def _hybrid_widths_unserved(self, server_args) -> Optional[str]:
        """A gated-delta-net verify of w < B tokens writes its per-token states into the B-sized
        scratch with the buffer's own pitch, and the commit copies step ``commit_len - 1 < w``
        (docs/design/hybrid-adaptive-width.md). Other recurrent layers commit another way, and
        SGLang's decode ring folds the state lazily."""
        if not self.hybrid_gdn:
            return "on hybrid targets only with gated-delta-net layers (Qwen3.5, Qwen3.6, Qwen3-Next)"
        if getattr(self.release.resolving(server_args), "enable_linear_replayssm", False):
            return "not with --enable-linear-replayssm (its decode ring folds the recurrent state lazily)"
        return None

    def _fix_the_block(self, why: str) -> None:
        """Widths asked for by name stop the server; by default the block is fixed instead, and
        with it the per-request fallback, which needs width 1, goes too."""
        if not widths_by_default():
            raise DFlashConfigError(WIDTHS_ENV, why)
        if get_parallel().tp_rank == 0:
            logger.info("DFLASH verify width fixed at %d (%s=auto %s)", self.block_size, WIDTHS_ENV, why)
        self.widths, self.width_policy = (self.block_size,), None
        self.fallback = make_fallback(draft_fallback(self.widths))

    def _resolve_mask_token_id(self) -> int:
        if self.config.mask_token_id is not None:
            return self.config.mask_token_id
        tokenizer = getattr(self._target_worker, "tokenizer", None)
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        token_id = vocab.get(getattr(tokenizer, "mask_token", None) or MASK_TOKEN, vocab.get(MASK_TOKEN))
        if token_id is None or token_id >= self.model_runner.model_config.vocab_size:
            raise DFlashConfigError(
                "mask_token_id", f"absent from dflash_config and {MASK_TOKEN!r} is not in the target vocabulary"
            )
        return int(token_id)

    # ---- what the scheduler expects of a spec worker -------------------------------------

    @property
    def draft_worker(self):
        return self._draft_worker

    @property
    def spec_v2_attn_backends(self) -> tuple:
        """Every backend a decode step runs on, as the scheduler asks them once, after the graphs
        are captured, whether it must copy the committed lengths to the host before each step. A
        FlashInfer backend whose DFLASH replays go unplanned needs none (a width-1 DECODE would)."""
        backends = [self.model_runner.attn_backend, self.draft_model_runner.attn_backend]
        backends += [b for b, _ in self.width_pairs.values() if all(b is not seen for seen in backends)]
        if self.width_one_decodes:
            return tuple(backends)
        return tuple(as_the_scheduler_sees(b) for b in backends)

    def host_lengths_copied(self) -> list[str]:
        """The backends for which the scheduler copies the committed lengths to the host before each
        decode step (SGLang's ``decide_needs_cpu_seq_lens``: a missing flag counts as yes). Empty:
        no copy, so the step never waits on the one in flight for it."""
        try:
            backends = self.spec_v2_attn_backends
        except AttributeError:  # before the backends are built
            return []
        return [type(getattr(b, "backend", b)).__name__ for b in backends
                if b is not None and getattr(b, "needs_cpu_seq_lens", True)]

    def __getattr__(self, name):
        # The scheduler uses the spec worker as its model worker; the rest is the target's.
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        memory_pool_config = self.claim_draft_window(memory_pool_config, req_to_token_pool)
        self._draft_worker.alloc_memory_pool(
            memory_pool_config=memory_pool_config,
            req_to_token_pool=self.window.pool if self.window else req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        )

    def init_attention_backends(self):
        if self.hybrid and not hasattr(self.model_runner.attn_backend, "update_mamba_state_after_mtp_verify"):
            raise DFlashConfigError(
                "--model-path", f"hybrid target whose attention backend "
                f"({type(self.model_runner.attn_backend).__name__}) cannot commit a verified recurrent state"
            )
        if self.hybrid and self.width_policy is not None and flashinfer_linear_verify(self.model_runner.attn_backend):
            self._fix_the_block("not with FlashInfer's gated-delta-net verify: untested below the block's width")
        if self.ragged:  # before the target captures its verify graphs
            self.release.enable_ragged_verify(self.model_runner.attn_backend)
        if self.hybrid_gdn and keeps_state_in_snapshots():  # before the target captures its verify graphs
            self._keep_state_in_snapshots()
        self._draft_worker.init_attention_backends()
        # Before either captures its graphs; the narrower widths' backends are routed as built.
        routed = [route_block_attention(mr.attn_backend) for mr in (self.model_runner, self.draft_model_runner)]
        if any(routed) and get_parallel().tp_rank == 0:
            logger.info("DFLASH block attention: the %s on the plugin's block kernel",
                        " and ".join(n for n, r in zip(("target's verify", "draft"), routed) if r))

    def _keep_state_in_snapshots(self) -> None:
        """Keep each request's GDN state in the verify's snapshot rows (:mod:`sglang_dflash.gdn_state`),
        or say in one line why SGLang's commit copy stays."""
        backend = self.model_runner.attn_backend
        why = ("FlashInfer's gated-delta-net verify" if flashinfer_linear_verify(backend) else
               "the ragged verify" if self.ragged else self.release.gdn_snapshot_unserved(backend, self.server_args))
        if why is None:
            from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher

            temporal, snapshots = self.release.gdn_snapshot_parts(backend)
            self.gdn_state = SnapshotState(temporal, snapshots, max_bs=max(snapshots.shape[1], 1024))
            install_verify_redirect(self.gdn_state, GDNKernelDispatcher)
        if get_parallel().tp_rank == 0:
            logger.info("DFLASH gated-delta-net state between verifies: %s",
                        "in the verify's snapshot rows" if why is None else f"SGLang's commit copy ({why})")

    def init_cuda_graphs(self):
        graphs = decode_graph_config()
        capture = graphs.backend != Backend.DISABLED
        lm_head = self.model_runner.model.lm_head
        self.draft_head = GreedyDraftHead(
            lm_head, self.block_size, max(graphs.bs) if capture else 1, fp8=draft_weights_fp8(self.draft_model),
            vocab_rows=draft_vocab_rows(self.model_runner.model_config.vocab_size),
        )
        if self.draft_head.rows_read is not None and get_parallel().tp_rank == 0:
            logger.info("DFLASH draft head reads the %d of %d lm_head rows served most often (%s=full for all)",
                        self.draft_head.rows_read, self.model_runner.model_config.vocab_size, DRAFT_VOCAB_ENV)
        # A quantised lm_head needs its own kernels: leave the head out of the graph then.
        self.head_in_graph = capture and torch.is_floating_point(lm_head.weight)
        if self.head_in_graph:
            self.draft_model_runner.capture_tail_hooks.append(self.draft_head.capture_hook)
        self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=capture)
        self.draft_graphs, self.draft_graphs_off = self._capture_draft_graphs(capture, graphs.bs if capture else ())
        if get_parallel().tp_rank == 0:
            logger.info("DFLASH draft pass: %s", "the plugin's own CUDA graphs" if self.draft_graphs is not None
                        else f"SGLang's graph runner ({self.draft_graphs_off})")
        fa3 = "FlashAttention" in type(full_attention(self.model_runner.attn_backend)).__name__
        if self.width_policy is not None and not self.ragged and not capture and fa3:
            # FA3's eager verify assumes the width its backend was built with.
            self._fix_the_block("needs decode CUDA graphs with the fa3 backend")
        if self.width_policy is not None and not self.ragged:  # ragged: the target's one runner serves every width
            self._build_width_pairs(capture)
        # Every width's accept kernel before serving: a width first chosen minutes in must not compile then.
        load_accept_block(self.widths, self.device)

    def _capture_draft_graphs(self, capture: bool, sizes) -> tuple[Optional[DraftPassGraphs], Optional[str]]:
        """The draft pass in the plugin's own graphs (:mod:`sglang_dflash.draft_graph`), or None and why not."""
        if not own_draft_graphs():
            return None, f"{DRAFT_GRAPHS_ENV}=0"
        why = ("no decode CUDA graphs" if not capture else
               "the greedy head runs outside the graph" if not self.head_in_graph else
               "the draft attends to a window" if self.window is not None else
               "tensor parallel" if self.draft_head.tp_size > 1 else None)  # DP attention is refused at launch
        if why is not None:
            return None, why
        runner = self.draft_model_runner
        try:
            graphs = DraftPassGraphs(
                embed=self.model_runner.model.get_input_embeddings(), draft_model=self.draft_model,
                attn_backend=runner.attn_backend, head=self.draft_head, block_size=self.block_size, sizes=sizes,
                device=self.device, pad_len=getattr(runner.decode_cuda_graph_runner, "seq_len_fill_value", 1))
            graphs.capture(bind_plan=lambda forward_batch: self.release.bind_draft_plan(runner, forward_batch))
        except DraftGraphUnserved as err:
            return None, str(err)
        except RuntimeError as err:  # a capture CUDA refused: the runner's graphs still serve
            logger.warning("DFLASH draft graphs not captured: %s", err)
            return None, f"capture failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        return graphs, None

    def _build_width_pairs(self, capture: bool) -> None:
        """A target backend and verify graphs per narrower width. Without graphs FA3 cannot verify
        a narrower block at all: its eager verify assumes the width it was built with."""
        mr = self.model_runner
        self.width_pairs = {self.block_size: (mr.attn_backend, mr.decode_cuda_graph_runner)}
        self.width_one_decodes = 1 in self.widths and self.release.decodes_width_one(full_attention(mr.attn_backend))
        if self.width_one_decodes and self.hybrid:
            why = self._hybrid_decode_unserved(mr.attn_backend)
            self.width_one_decodes = why is None
            self.width_one_step = "a DECODE" if why is None else f"a 1-token verify ({why})"
            if get_parallel().tp_rank == 0:
                logger.info("DFLASH width 1 on this hybrid target: %s", self.width_one_step)
        self.width_pairs.update(
            self.release.build_width_runners(mr, self.widths[1:], capture, decode_width_one=self.width_one_decodes,
                                             on_backend=route_block_attention))
        logger.info("DFLASH verify widths %s (%s policy)", list(self.widths), type(self.width_policy).__name__)

    def _hybrid_decode_unserved(self, attn_backend) -> Optional[str]:
        """Why a hybrid target's width-1 step stays a 1-token verify, or None for a plain DECODE."""
        if not hybrid_decode():
            return f"{HYBRID_DECODE_ENV}=0"
        return self.release.hybrid_decode_unserved(attn_backend)

    def server_info(self, running: Optional[set] = None) -> dict:
        """``/get_server_info``'s ``dflash`` entry: the block, the process's pauses (full GCs,
        allocator retries), the worker calls that stalled, the decode steps and those whose draft
        or verify ran outside CUDA graphs, the verifies whose logits stayed in half precision, the
        draft input's length sets (where its bulk prepare serves), and, with adaptive width, the
        widths chosen so far (decode steps per width). ``running``: the ids of the scheduler's
        running requests, where known (the fallback counts those alone)."""
        info = {"block_size": self.block_size, "widths": list(self.widths),
                "host_pauses": self.pauses.report(getattr(self, "device", None)),
                "decode_steps": self.decode_steps, "eager_drafts": self.eager_drafts, "runner_drafts": self.runner_drafts,
                "draft_graphs": ({"replays": self.draft_graphs.replays, "sizes": list(self.draft_graphs.sizes)}
                                 if self.draft_graphs is not None else self.draft_graphs_off),
                "prefills": self.prefills, "prefills_in_graphs": self.prefills_in_graphs,
                "stalls": self.stalls.report(), "bulk_prepare": bulk_prepare_serves(),
                "block_attention": BLOCK_ROUTE.report(), "host_lengths": self.host_lengths_copied(),
                "eager_verifies": {str(w): n for w, n in sorted(self.eager_verifies.items(), reverse=True)}}
        info["draft_kv"] = self.draft_kv_report()
        if info["bulk_prepare"]:  # the draft input's length buffers, kept across steps
            info["length_sets"] = length_sets_report()
        if self.hybrid:
            info["decode_track"], info["verify_track"] = dict(self.decode_track), dict(self.verify_track)
            info["width_one_step"] = self.width_one_step
            info["gdn_state"] = "commit" if self.gdn_state is None else "snapshot"  # where the SSM state waits
        # lm_heads of TARGET_VERIFY forwards written in the model's dtype (CUDA-graph captures count once)
        info["half_verify_logits"] = None if self.half_logits is None else self.half_logits.verifies
        if self.draft_head is not None and self.draft_head.rows_read is not None:
            info["draft_vocab"] = {"rows": self.draft_head.rows_read, "rebuilds": self.draft_head.vocab.rebuilds}
        if self.width_policy is not None:
            info["width_policy"] = type(self.width_policy).__name__
            info["widths_used"] = {str(w): n for w, n in self.width_policy.widths_used().items()}
            for key in ("step_ms", "choices", "held", "switches", "acceptance_rates"):
                if hasattr(self.width_policy, key):
                    info[key] = getattr(self.width_policy, key)()
        if self.fallback is not None:
            info["fallback"] = {"policy": type(self.fallback).__name__, "requests": self.fallback.fallback_requests,
                                "in_fallback": self.fallback.in_fallback(running)}
        return info

    # ---- one scheduler step ------------------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
                                 ) -> GenerationBatchResult:
        # pp_proxy_tensors: passed from SGLang 0.5.19 on; DFLASH runs without pipeline parallelism.
        # Named before the step: a verify leaves the batch in TARGET_VERIFY mode, which counts as extend.
        mode, bs, tokens = call_shape(batch, batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        self.stalls.begin()
        result = None
        try:
            result = self._step(batch, mode, on_publish, grammar_barrier)
            return result
        finally:
            width = getattr(result, "speculative_num_draft_tokens", None) if mode == "decode" else None
            self.stalls.end(mode, bs, tokens, width)

    def _step(self, batch, mode: str, on_publish, grammar_barrier) -> GenerationBatchResult:
        if mode == "extend":
            self.clock.forget()  # the next decode step's time would include this prefill
            self.pauses.mark_serving()  # full collections from here on hold requests up
            return self.prefill_step(batch, on_publish)
        if batch.spec_info is None:
            batch.spec_info = draft_input_class().create_idle_input(device=self.device)
        if mode == "idle":
            self.clock.forget()
            return self._idle_result(on_publish)

        started = time.perf_counter()  # the step's own set-up and wrap-up are timed too (phases "set-up", "wrap-up")
        stream = torch.cuda.current_stream()  # once a step: building it was most of time_step's 33 us traced
        batch.seq_lens.record_stream(stream)  # may come from the FutureMap stream
        bs = len(batch.seq_lens)
        width, request_widths = self.choose_widths(batch, bs)
        self.draft_head.maybe_rebuild()
        bufs = self.buffers.take(bs, batch.seq_lens.dtype, width)
        # Read before the verify, whose prepare_for_verify puts its own input in batch.spec_info
        # (the draft input's host lengths with it): after it, no host lengths, so every commit scattered.
        committed_cpu = self.host_committed_lens(batch) if self.hybrid else None
        self.stalls.add_phase("set-up", time.perf_counter() - started)
        block = self.draft_step(batch, bufs, width)
        grammar_tree = GrammarTree.from_linear_chain(block.candidates) if batch.has_grammar else None
        penalty_rows = self.output_counts.batch_rows(batch.reqs)
        lane_widths = None
        if self.ragged:
            lane_widths = self.ragged_lane_widths(batch, width, request_widths, penalty_rows)
            if request_widths is not None:  # what each request was verified at, and so may keep
                request_widths = (request_widths[0], lane_widths)
        logits_output, can_run_graph, context_written = self.verify_step(batch, block, lane_widths)
        plain = argmax_only(batch, penalty_rows)
        logits_output.next_token_logits = HalfVerifyLogits.for_accept(logits_output.next_token_logits, plain)
        self.decode_steps += 1
        if not can_run_graph:
            self.eager_verifies[width] += 1
        if grammar_tree is not None:
            mask = build_grammar_vocab_mask(
                reqs=batch.reqs, tree=grammar_tree, sampling_info=batch.sampling_info,
                device=logits_output.next_token_logits.device, barrier=grammar_barrier,
            )
            if mask is not None:
                mask.apply(logits_output.next_token_logits)
        accepted = self.accept_step(batch, block, logits_output.next_token_logits, bufs, penalty_rows, plain)
        self.draft_head.observe(accepted.out_tokens)  # every verified position: the target's own tokens
        if penalty_rows is not None:
            self.output_counts.commit(penalty_rows, block.candidates, accepted.commit_len)
        if batch.return_logprob:
            self.release.fill_logprobs(batch, logits_output, accepted.out_tokens, width)
        if self.hybrid and self.decodes_at(width):
            self.track_decoded_state(batch)
        elif self.hybrid:
            self.commit_recurrent_state(batch, accepted, width, committed_cpu)
        wrap_up = time.perf_counter()
        if on_publish is not None:
            on_publish(accepted.new_seq_lens)
        if not context_written:
            context_started = time.perf_counter()
            self.commit_context(logits_output.hidden_states, block, accepted.commit_len, batch.req_pool_indices)
            wrap_up += time.perf_counter() - context_started  # its own phase, "context"
        logits_output.hidden_states = None  # never copied to the host
        if self.width_policy is not None:
            self.time_step(width, bs, request_widths, stream)
        result = GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=accepted.out_tokens.reshape(-1),
            accept_lens=accepted.commit_len,
            can_run_cuda_graph=can_run_graph,
            next_draft_input=make_draft_input(bonus_tokens=accepted.bonus, new_seq_lens=accepted.new_seq_lens),
            speculative_num_draft_tokens=width,  # the row stride of next_token_ids
            new_seq_lens=accepted.new_seq_lens,
        )
        self.stalls.add_phase("wrap-up", time.perf_counter() - wrap_up)  # the policy's time_step included
        return result

    @policy_time
    def choose_widths(self, batch, bs: int) -> tuple[int, Optional[list]]:
        """The batch's verify width and, with the per-request fallback, ``(rids, widths)``: the
        width each request is verified at (:func:`~sglang_dflash.adaptive.step_widths`); ``ASLEEP``
        for a step of a bucket that sleeps at full width."""
        if self.width_policy is None:
            return self.block_size, None
        if self.joined:
            self.width_policy.admitted(self.joined, bs)
            self.joined = 0
        if not self.ragged:  # step_widths asks too; here before the batch's ids, which a sleeping step skips
            held = self.width_policy.sleeping(bs)
            if held is not None:
                return held, ASLEEP
        rids = list(map(RID, batch.reqs)) if self.fallback is not None else ()
        width, widths = step_widths(self.width_policy, self.fallback, rids, bs, self.block_size, self.ragged,
                                    timed=self.clock.times_next)
        return width, (widths if widths is None or widths is ASLEEP else (rids, widths))

    @policy_time
    def time_step(self, width: int, bs: int, request_widths: Optional[tuple] = None, stream=None) -> None:
        """Stamps the step's end (:class:`~sglang_dflash.step_clock.StepClock`) and keeps it in
        flight until its accept lengths come. ``stream``: the step's stream, when the caller has it.
        A sleeping bucket's step (``ASLEEP``) is not timed: only its acceptance is learned."""
        if request_widths is ASLEEP:
            self.clock.forget()  # the next timed step starts from its own start, not before the sleep
            self.steps_in_flight.append((width, bs, None, ASLEEP))
            return
        self.steps_in_flight.append((width, bs, self.clock.stamp(stream), request_widths))

    @policy_time
    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        """The scheduler's word, in step order, that a step's accept lengths reached the host: the
        width policy learns that step's acceptance and, once its end is reached, its time (read
        when the policy next decides: :meth:`StepClock.seconds`), without a sync of its own."""
        if self.width_policy is None or not self.steps_in_flight:
            return
        width, bs, timing, request_widths = self.steps_in_flight.popleft()
        if request_widths is None or request_widths is ASLEEP:
            rids, widths = (), request_widths
        else:
            rids, widths = request_widths
        learn_step(self.width_policy, self.fallback, width, bs, rids, widths, num_correct_drafts_per_req, timing)
        steps = self.width_policy.steps
        if steps - self.widths_logged_at >= WIDTHS_LOG_EVERY:
            self.widths_logged_at = steps
            fell = "" if self.fallback is None else f"; {self.fallback.fallback_requests} requests fell back"
            logger.info("DFLASH verify widths used in %d decode steps: %s%s", steps,
                        ", ".join(f"{w}: {n}" for w, n in self.width_policy.widths_used().items()), fell)

    def prefill_step(self, batch, on_publish) -> GenerationBatchResult:
        """Target prefill with the tapped hidden states; writes draft context for every prompt token."""
        self.output_counts.start(batch.reqs)
        result = self.target_prefill(batch)
        if self.gdn_state is not None:  # the extend wrote these rows' states into their slots
            self.gdn_state.released(batch.req_pool_indices)
        self.prefills += 1
        self.prefills_in_graphs += bool(getattr(result, "can_run_cuda_graph", False))
        self.joined += len(batch.reqs)
        if getattr(batch, "input_ids", None) is not None:
            self.draft_head.observe(batch.input_ids, checked=True)
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch.seq_lens)
        hidden = result.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the target returned no tapped hidden states; does it support DFLASH capture?")
        self.write_prefill_context(batch, hidden)  # now: the radix cache may take these tokens right after
        result.logits_output.hidden_states = None
        result.next_draft_input = make_draft_input(bonus_tokens=result.next_token_ids, new_seq_lens=batch.seq_lens)
        return result

    @admission_phase("target")
    def target_prefill(self, batch):
        return self._target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)

    @host_phase("draft")
    def draft_step(self, batch, bufs: dict, width: Optional[int] = None) -> DraftBlock:
        """One parallel draft pass over ``[bonus, mask...]``; returns the first ``width`` (default
        B) verify candidates. Width 1 is a plain decode step: the bonus alone, no draft pass."""
        bs, B = len(batch.seq_lens), self.block_size
        width = width or B
        seq_lens_cpu = self._host_seq_lens_bound(batch)
        candidates = bufs["candidates"]
        if width == 1:  # one position: written straight into the dense rows the step reads (no copies)
            positions, cache_loc = bufs["positions"].view(-1)[:bs], bufs["cache_loc"].view(-1)[:bs].view(bs, 1)
            self._prepare_block(batch, candidates, positions.view(bs, 1), cache_loc)
            return DraftBlock(candidates, positions, cache_loc, seq_lens_cpu)
        graphs = self.draft_graphs if self.draft_graphs is not None and self.draft_graphs.serves(bs) else None
        if graphs is not None:  # the block set-up writes the graph's own inputs
            block_ids, positions, cache_loc = graphs.inputs(bs)
        else:
            block_ids, positions, cache_loc = bufs["block_ids"], bufs["positions"], bufs["cache_loc"]
        self._prepare_block(batch, block_ids, positions, cache_loc)
        candidates[:, :1].copy_(block_ids[:, :1])
        if graphs is not None:
            drafts = graphs.replay(batch.req_pool_indices, batch.seq_lens)
        else:
            drafts = self.run_draft(batch, block_ids, positions, cache_loc, seq_lens_cpu)
            self.runner_drafts += 1
        candidates[:, 1:].copy_(drafts.view(bs, B - 1)[:, : width - 1])
        if width < B:
            return DraftBlock(candidates, positions[:, :width].reshape(-1), cache_loc[:, :width].contiguous(),
                              seq_lens_cpu)
        return DraftBlock(candidates, positions.view(-1), cache_loc, seq_lens_cpu)

    def _prepare_block(self, batch, block_ids, positions, cache_loc) -> None:
        """``[bonus, mask...]``, their positions and KV slots, as wide as ``block_ids``."""
        prepare_block(
            batch.spec_info.bonus_tokens, batch.seq_lens, batch.req_pool_indices,
            self.model_runner.req_to_token_pool.req_to_token, self.mask_token_id, block_ids, positions, cache_loc,
        )

    def run_draft(self, batch, block_ids, positions, cache_loc, seq_lens_cpu) -> torch.Tensor:
        """The draft network over the whole block; its greedy tokens for the B-1 mask positions."""
        bs, B = len(batch.seq_lens), self.block_size
        embeds = self.model_runner.model.get_input_embeddings()(block_ids).view(bs * B, -1)
        draft_seq_lens, draft_seq_lens_cpu = batch.seq_lens, seq_lens_cpu
        if isinstance(self.window, DraftRing):  # the block's own K/V goes to its ring slots too
            cache_loc = self.window.slots(batch.req_pool_indices, positions.view(-1))
        if self.window is not None:
            draft_seq_lens = self.window.fill(
                batch.req_pool_indices, batch.seq_lens, self.model_runner.req_to_token_pool.req_to_token
            )
            draft_seq_lens_cpu = torch.clamp(seq_lens_cpu - B, max=self.window.size) + B
        forward_batch = draft_forward_batch(block_ids, positions, cache_loc, batch.req_pool_indices, draft_seq_lens,
                                            draft_seq_lens_cpu, input_embeds=embeds)
        self.release.bind_draft_plan(self.draft_model_runner, forward_batch)
        with torch.inference_mode():
            out = self.draft_model_runner.forward(forward_batch)
        if not out.can_run_graph:
            self.eager_drafts += 1
        if out.can_run_graph and self.head_in_graph:
            return self.draft_head.out[: bs * (B - 1)]
        return self.draft_head(out.logits_output.hidden_states)

    def _host_seq_lens_bound(self, batch) -> torch.Tensor:
        """Host-side upper bound of each request's attended length (committed + one block)."""
        if batch.seq_lens_cpu is not None:
            return (batch.seq_lens_cpu + self.block_size).to(torch.int32)
        reserved = self.release.reserved_seq_lens_cpu(batch.spec_info)
        if reserved is not None:
            return reserved.to(torch.int32)
        return (batch.seq_lens.cpu() + self.block_size).to(torch.int32)

    @host_phase("verify")
    def verify_step(self, batch, block: DraftBlock, lane_widths: Optional[list] = None):
        """The target over the block's candidates (causal, one pass); returns logits and hidden
        states, whether it ran from CUDA graphs, and whether those graphs already wrote the draft
        context (:class:`ContextInVerifyGraph`). A narrower block runs on that width's own
        attention backend and graphs; a ragged verify (``lane_widths``) on the target's own."""
        if lane_widths is not None:
            return self._verify_ragged(batch, block, lane_widths)
        width = block.candidates.shape[1]
        if width == self.block_size:
            return self._verify(batch, block)
        with self.target_at_width(width):
            if self.decodes_at(width):
                return self.decode_step(batch, block)
            return self._verify(batch, block)

    def decodes_at(self, width: int) -> bool:
        """Whether a step of ``width`` runs as a plain DECODE (width 1 where the backends allow)."""
        return width == 1 and self.width_one_decodes

    @contextlib.contextmanager
    def target_at_width(self, width: int):
        """The target's attention backend and verify graphs for ``width`` while the block runs
        (both are read when the verify is planned), then the block's own again."""
        mr = self.model_runner
        saved = mr.attn_backend, mr.decode_cuda_graph_runner
        mr.attn_backend, mr.decode_cuda_graph_runner = self.width_pairs[width]
        try:
            yield
        finally:
            mr.attn_backend, mr.decode_cuda_graph_runner = saved

    def _verify(self, batch, block: DraftBlock, layout=None):
        ragged = {} if layout is None else {"ragged_verify_layout": layout}
        verify_input = DFlashVerifyInput(
            draft_token=block.candidates.view(-1), positions=block.positions,
            draft_token_num=self.block_size if layout is not None else block.candidates.shape[1],
            capture_hidden_mode=CaptureHiddenMode.FULL, **ragged,
        )
        batch.out_cache_loc = block.cache_loc.view(-1)
        if self.hybrid and not self.release.has("verify_prepares_mamba_track"):
            prepare_mamba_track_for_verify(batch)  # the track slots as the scheduler holds them now (0.5.17)
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = block.seq_lens_bound, int(block.seq_lens_bound.sum())
        forward_batch, _ = verify_input.prepare_for_verify(batch, self._target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = saved
        if self.gdn_state is not None:
            self.gdn_state.before_verify(batch.req_pool_indices, self.gdn_slots(batch))
        out = self._target_worker.forward_batch_generation(
            batch=None, forward_batch=forward_batch, is_verify=True, skip_attn_backend_init=True
        )
        written = self.graphs_wrote_context(self.model_runner.decode_cuda_graph_runner, out.can_run_cuda_graph)
        return out.logits_output, out.can_run_cuda_graph, written

    def ragged_lane_widths(self, batch, width: int, request_widths: Optional[tuple],
                           penalty_rows: Optional[torch.Tensor]) -> list:
        """Each request's verified candidates in a ragged verify: its own width where the batch
        asks for nothing per position (greedy, no penalties, bias, processors, grammar or
        logprobs), else the batch's (compact graphs need a layout on every verify, uniform too)."""
        plain = request_widths is not None and argmax_only(batch, penalty_rows)
        return list(request_widths[1]) if plain else [width] * len(batch.seq_lens)

    def _verify_ragged(self, batch, block: DraftBlock, lane_widths: list):
        """One verify whose lanes are each request's first w_i candidates, packed and padded to a
        captured token tier (pad lanes: id, position and slot 0). Logits and hidden states come
        back one row per lane: for a uniform block the first ``bs * w`` rows are the dense block."""
        bs, width = block.candidates.shape
        graphs = self.model_runner.decode_cuda_graph_runner
        layout = self.release.ragged_layout(lane_widths, self.device, getattr(graphs, "capture_num_tokens", None))
        lanes = RaggedLanes.from_widths(lane_widths, self.device, padded=layout.graph_num_tokens)
        packed_block = DraftBlock(
            lanes.pack(block.candidates), lanes.pack(block.positions.view(bs, width)),
            lanes.pack(block.cache_loc.view(bs, width)), block.seq_lens_bound,
        )
        logits_output, can_run_graph, written = self._verify(batch, packed_block, layout)
        uniform = lanes.total == bs * width
        if uniform:
            logits_output.next_token_logits = logits_output.next_token_logits[: lanes.total]
            if logits_output.hidden_states is not None:
                logits_output.hidden_states = logits_output.hidden_states[: lanes.total]
        else:
            block.lanes = lanes
            if not written and logits_output.hidden_states is not None:  # dense rows for commit_context
                hidden = lanes.unpack(logits_output.hidden_states[: lanes.total], width)
                logits_output.hidden_states = hidden.view(bs * width, -1)
        return logits_output, can_run_graph, written

    def decode_step(self, batch, block: DraftBlock):
        """Width 1 as a plain decode step: the bonus token through the target's decode kernels and
        DECODE graphs, returning what the 1-token verify would (logits and tapped hidden states
        of one row per request). Decode lengths count the token decoded, so its position is the
        committed length, as in the verify. The model runner plans the forward, in the width-1
        graphs or eagerly, as for a plain decode step: planned here too, the graph replay would
        copy its inputs a second time."""
        saved = batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info
        if self.hybrid:  # no tracking inside the forward; the track slots only where a boundary is near
            self.prepare_decode_track(batch)
        if self.gdn_state is not None:  # the DECODE reads and advances the slots
            self.gdn_state.to_slots(batch.req_pool_indices, self.gdn_slots(batch))
        batch.input_ids, batch.forward_mode, batch.spec_info = block.candidates[:, 0], ForwardMode.DECODE, None
        batch.out_cache_loc = block.cache_loc.view(-1)
        batch.seq_lens = block.decoded_lens = batch.seq_lens + 1  # also the step's new lengths (accept_decoded)
        batch.seq_lens_cpu, batch.seq_lens_sum = block.seq_lens_bound, int(block.seq_lens_bound.sum())  # bounds
        mr = self.model_runner
        forward_batch = ForwardBatch.init_new(batch, mr, capture_hidden_mode=CaptureHiddenMode.FULL,
                                              return_hidden_states_before_norm=False)
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info = saved  # committed, for the accept
        out = self._target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
        wrote = self.graphs_wrote_context(mr.decode_cuda_graph_runner, out.can_run_cuda_graph)
        return out.logits_output, out.can_run_cuda_graph, wrote

    def prepare_decode_track(self, batch) -> None:
        """Before a hybrid width-1 DECODE: the track slots as the scheduler holds them now, where
        some request may reach a track boundary (:meth:`may_reach_track`), else none at all,
        so that :meth:`track_decoded_state` launches nothing: on most steps neither the slots'
        rebuild nor the copy runs, a width-1 step being host-bound. Either way the extend-time
        track fields are cleared."""
        if self.may_reach_track(batch, self.host_committed_lens(batch)):
            prepare_mamba_track_for_verify(batch)
            self.decode_track["prepared"] += 1
        else:
            self.decode_track["skipped"] += 1
            batch.mamba_track_indices = None
            batch.mamba_track_seqlens = batch.mamba_prefill_track_mask_cpu = batch.mamba_track_seqlens_cpu = None
        batch.mamba_track_mask = None

    def host_committed_lens(self, batch) -> Optional[torch.Tensor]:
        """The committed lengths on the host: the batch's, or where the overlap schedule dropped them
        those the draft input reserved from (read before a verify replaces it); None if neither."""
        if batch.seq_lens_cpu is not None:
            return batch.seq_lens_cpu
        return self.release.committed_lens_cpu(batch.spec_info, len(batch.seq_lens))

    def may_reach_track(self, batch, committed_cpu: Optional[torch.Tensor]) -> bool:
        """Whether this step may bring some request to a track boundary (:func:`decode_may_reach_track`)
        from the host lengths ``committed_cpu`` (:meth:`host_committed_lens`). A lazy track plan, or no
        host lengths: yes."""
        if getattr(batch, "mamba_lazy_spec_track_positions_cpu", None) is not None or committed_cpu is None:
            return True
        return decode_may_reach_track(committed_cpu, self.release.mamba_track_interval(batch), self.block_size)

    def graphs_wrote_context(self, runner, ran_graph: bool) -> bool:
        """Whether the target forward that just ran wrote the draft context (:class:`ContextInVerifyGraph`)."""
        return self.context_in_graph is not None and self.context_in_graph.wrote(runner, ran_graph)

    @host_phase("accept")
    def accept_step(self, batch, block: DraftBlock, logits: torch.Tensor, bufs: dict,
                    penalty_rows: Optional[torch.Tensor] = None, plain: bool = False) -> Accepted:
        """Greedy: target argmax. Otherwise a target sample per position (exact with a greedy draft).
        A request whose ragged lane is narrower than the block (in fallback) accepts no candidate
        past it; every other request was verified at the block's width and keeps what it accepts.
        ``plain``: the batch needs nothing of the logits but their argmax (:func:`argmax_only`)."""
        bs, B = block.candidates.shape
        if B == 1 and plain and block.lanes is None:
            return self.accept_decoded(batch, block, logits, bufs)
        candidates = block.candidates
        info = batch.sampling_info
        if block.lanes is not None:  # a ragged verify: one row per lane, greedy and plain (ragged_lane_widths)
            target_tokens = block.lanes.unpack(logits.argmax(dim=-1), B).to(torch.int64)
            candidates = block.lanes.mask_unverified(candidates)
        else:
            if info is not None:
                self.apply_request_params(logits.view(bs, B, -1), block.candidates, info, penalty_rows)
            if info is None or info.is_all_greedy:
                target_tokens = logits.argmax(dim=-1)
            else:
                target_tokens = sample_per_position(logits, info, block.positions, B, self.sampling_kernels)
            target_tokens = target_tokens.view(bs, B).to(torch.int64)
        acc = Accepted(**{k: bufs[k] for k in ("accept_len", "commit_len", "bonus", "out_tokens", "new_seq_lens")})
        accept_block(
            candidates, target_tokens, batch.seq_lens,
            acc.accept_len, acc.commit_len, acc.bonus, acc.out_tokens, acc.new_seq_lens,
        )
        return acc

    def accept_decoded(self, batch, block: DraftBlock, logits: torch.Tensor, bufs: dict) -> Accepted:
        """Width 1, greedy and plain: the one candidate is the pending token, so the step commits
        the target's argmax alone. One launch (two where the step was a 1-token verify) in place
        of the accept kernel's argmax and Triton launch: a width-1 step is host-bound."""
        out = bufs["out_tokens"]  # [bs, 1]
        torch.argmax(logits, dim=-1, keepdim=True, out=out)
        new_seq_lens = block.decoded_lens
        if new_seq_lens is None:
            new_seq_lens = torch.add(batch.seq_lens, 1, out=bufs["new_seq_lens"])
        none_accepted, one_committed = self.buffers.unit_lens(out.shape[0])
        return Accepted(none_accepted, one_committed, out.view(-1), out, new_seq_lens)

    def apply_request_params(self, logits: torch.Tensor, candidates: torch.Tensor, info,
                             penalty_rows: Optional[torch.Tensor]) -> None:
        """``logits [bs, B, V]`` in plain decoding's order: penalties (per position, from the
        plugin's own counts; SGLang's penalizers never advance under DFLASH), logit bias, then
        custom logit processors. The grammar mask is applied before; it commutes with these."""
        if penalty_rows is not None:
            self.output_counts.penalize(logits, candidates, penalty_rows)
        if info.logit_bias is not None:
            logits.add_(info.logit_bias[:, None, :])
        if info.has_custom_logit_processor:
            from sglang.srt.layers.sampler import apply_custom_logit_processor

            flat = logits.view(-1, logits.shape[-1])
            apply_custom_logit_processor(flat, info, num_tokens_in_batch=logits.shape[1])

    @host_phase("state")
    def commit_recurrent_state(self, batch, accepted: Accepted, width: int,
                               committed_cpu: Optional[torch.Tensor] = None) -> None:
        """Hybrid targets: the verify kept each step's linear-attention state aside; keep the last
        committed step's, and copy a crossed track boundary's into the radix cache's track slot.
        Through the backend of the width that ran the verify: the state slots are read from its
        metadata, and another width's backend still holds those of the last batch it ran.
        Where no request can reach a track boundary (:meth:`may_reach_track` from ``committed_cpu``,
        the host lengths read before the verify; a commit ends within two blocks of them, as a
        DECODE does), neither the steps to track nor their scatter run: most steps at low
        concurrency, a boundary coming every 256 tokens by default. No lengths: the scatter runs."""
        track, steps_to_track = batch.mamba_track_indices, None
        if track is not None and not self.may_reach_track(batch, committed_cpu):
            track = None
            self.verify_track["skipped"] += 1
        elif track is not None:
            steps_to_track = mamba_track_steps(batch.seq_lens, accepted.commit_len,
                                               self.release.mamba_track_interval(batch))
            self.verify_track["scattered"] += 1
        backend = self.width_pairs[width][0] if width in self.width_pairs else self.model_runner.attn_backend
        if self.gdn_state is not None:  # the SSM state stays where the verify wrote it
            last = accepted.commit_len.to(torch.int64) - 1
            linear = backend.linear_attn_backend
            if track is not None:
                track = self.release.physical_slots(linear, track)
            self.release.commit_conv_states(linear, last, track, steps_to_track)
            self.gdn_state.after_verify(batch.req_pool_indices, accepted.commit_len)
            if track is not None:
                self.gdn_state.track(batch.req_pool_indices, steps_to_track, track)
            return
        backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=accepted.commit_len.to(torch.int64) - 1,
            mamba_track_indices=track,
            mamba_steps_to_track=steps_to_track,
            model=self.model_runner.model,
            req_pool_indices=batch.req_pool_indices,
        )

    def gdn_slots(self, batch) -> torch.Tensor:
        """The batch's recurrent-state slots, as the kernels address them."""
        return self.release.mamba_slots(self.model_runner.attn_backend.linear_attn_backend, batch.req_pool_indices)

    @host_phase("state")
    def track_decoded_state(self, batch) -> None:
        """Hybrid targets after a width-1 DECODE: the forward advanced each recurrent state in place,
        so nothing is committed; where the token reached a track boundary, the live state is copied
        into the radix cache's track slot (a verify's commit copies its scratch step there)."""
        if batch.mamba_track_indices is None:
            return
        # mamba_track_steps(...) == 0 at commit length 1, in half the launches: a width-1 step is host-bound
        reached = (batch.seq_lens + 1) % self.release.mamba_track_interval(batch) == 0
        track = batch.mamba_track_indices
        self.release.track_decoded_state(self.width_pairs[1][0], reached & (track >= 0), track)

    def _idle_result(self, on_publish) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(empty)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=empty,
            accept_lens=torch.empty((0,), dtype=torch.int32, device=self.device),
            next_draft_input=make_draft_input(bonus_tokens=empty, new_seq_lens=empty),
            can_run_cuda_graph=False,
            speculative_num_draft_tokens=self.block_size,
            new_seq_lens=empty,
        )


def decode_graph_config():
    """SGLang's published decode CUDA-graph config: its backend (``disabled`` or one that captures)
    and batch sizes."""
    return get_exec().graph.cuda_graph_config.decode


def full_attention(attn_backend):
    """The full-attention backend of a hybrid target's wrapper, or the backend itself."""
    return getattr(attn_backend, "full_attn_backend", attn_backend)


def flashinfer_linear_verify(attn_backend) -> bool:
    """Whether a hybrid target's linear layers verify on FlashInfer's kernel (else SGLang's Triton)."""
    dispatcher = getattr(getattr(attn_backend, "linear_attn_backend", None), "kernel_dispatcher", None)
    return bool(getattr(dispatcher, "verify_kernel_is_flashinfer", False))


def sample_per_position(logits: torch.Tensor, info, positions: torch.Tensor, block_size: int,
                        kernels: Optional[PlainDecodingKernels] = None) -> torch.Tensor:
    """One target sample per verify position, drawn as SGLang's sampler draws it for plain
    decoding: temperature, then top-k/top-p/min-p, and with a per-request seed
    (``--enable-deterministic-inference``) the same hash of (seed, position), so a seeded request
    gets plain decoding's very tokens. Unseeded, through plain decoding's ``kernels`` where it has
    them (:func:`~sglang_dflash.sampling.plain_decoding_kernels`). A few thousand rows at a time
    (:func:`~sglang_dflash.sampling.row_chunks`): a seeded row's token depends on its own seed and position only."""
    expand = lambda t: t.view(-1).repeat_interleave(block_size)  # noqa: E731
    temperatures = expand(info.temperatures)[:, None]
    seed = None if info.sampling_seed is None else expand(info.sampling_seed)
    filtered = info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling
    if filtered:
        top_ks, top_ps, min_ps = expand(info.top_ks), expand(info.top_ps), expand(info.min_ps)
    parts = []
    for part in row_chunks(*logits.shape):
        probs = torch.softmax(logits[part].float() / temperatures[part], dim=-1)
        part_seed = None if seed is None else seed[part]
        if not filtered:
            tokens = sampling_from_probs_torch(probs, sampling_seed=part_seed, positions=positions[part])
        elif part_seed is None and kernels is not None:
            tokens = kernels.sample(probs, top_ks[part], top_ps[part], min_ps[part], info.need_min_p_sampling)
        else:
            tokens = top_k_top_p_min_p_sampling_from_probs_torch(
                probs, top_ks[part], top_ps[part], min_ps[part], info.need_min_p_sampling, part_seed, positions[part],
            )
        parts.append(tokens.to(torch.int64))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
