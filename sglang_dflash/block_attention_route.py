"""The DFLASH passes' attention on SGLang's Triton and FlashInfer backends, through the plugin's
block kernel.

The target's verify and the draft pass both run as TARGET_VERIFY forwards. Both backends attend
them with a prefill kernel, which a block of 16 queries a request leaves mostly idle:

* Triton writes the block's K/V to the cache, then hands the pass to its extend kernel
  (``backend.extend_attention_fwd``, the same call from 0.5.17 to 0.5.23). A routed backend sends
  that call to :func:`ops.block_attention_by_table` over the request table (or, where the block
  was not cached or the table holds ids a unified pool translates, to :func:`ops.block_attention`
  over the backend's kv indices). A graph whose every call went by the table reads none of the
  offsets and indices Triton refills from the host before each replay, so that set-up is skipped.
  Where SGLang's ``forward_extend`` is one read here (:data:`TRITON_FORWARD_EXTEND_SOURCES`), a pass
  that goes by the table is served whole: the same K/V write, then the kernel, without the copies
  of each layer's K/V into contiguous tensors that ``forward_extend`` makes for its own kernel and
  the table never reads (two launches a layer, about 0.2 ms of a step at one request on the 8B shape).
* FlashInfer writes the block's K/V to the cache, then runs its planned paged prefill wrapper
  (``prefill_wrapper_paged.forward``). A routed backend lends that wrapper, for the one call, a
  ``forward`` that runs :func:`ops.block_attention_by_table` over the request table instead.
  Once the kernel serves every such call a backend's CUDA-graph captures make, the wrapper's plan
  before each replay of those graphs is host work nothing reads, and is skipped. With it goes the
  one reason that backend gave the scheduler to copy the committed lengths to the host before each
  step, a wait on the step in flight (:func:`as_the_scheduler_sees`).

Only where the forward is a TARGET_VERIFY one and the call asks for nothing the block kernel
lacks (a custom mask, a window, sinks, a soft cap, scales, pages, partial stages, ragged or
dequantised KV); anything else, prefills included, keeps SGLang's kernel. The choice is made in
Python, so a CUDA graph keeps the kernel it captured.
"""

from __future__ import annotations

import inspect
import logging
from functools import lru_cache
from typing import Optional

import torch

from .compat import source_digest
from .config import (block_attention_every_tile, block_attention_kernel, skip_host_lengths, skip_kv_copies,
                     skip_unused_plans)
from .ops.block_attention import TileTooLarge, block_attention, block_attention_by_table, fits, serves

logger = logging.getLogger("sglang_dflash")

# The extend kernel's leading parameters, in order (its callers pass them by position).
_POSITIONAL = ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
               "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend", "k_scale", "v_scale",
               "sm_scale")
# Those the block kernel does without (a uniform block's offsets), and those it must find at a default.
_UNREAD = {"qo_indptr", "mask_indptr", "skip_prefix_custom_mask", "extend_seq_lens_cpu"}
_AT_DEFAULT = {"logit_cap": (0, None), "sliding_window_size": (-1, None), "sinks": (None,),
               "window_kv_offsets": (None,), "xai_temperature_len": (-1, 0, None), "lse_extend": (None,),
               "skip_prefix": (False,), "skip_extend": (False,), "page_size": (1,), "score_mod": (None,),
               "aux_tensors": (None,), "identity_kv_indices": (False,)}
# sha256 (first 16 hex digits) of SGLang's TritonAttnBackend.forward_extend, dedented, in 0.5.17-0.5.23:
# each, for an unscaled MHA layer over a plain pool of one-token pages, without DCP, sliding window,
# deterministic or DLLM attention, sinks, score mods or soft cap, writes the pass's K/V with
# ``token_to_kv_pool.set_kv_buffer(layer, out_cache_loc, k, v)`` and then runs its extend kernel,
# causal for DECODER layers and not for ENCODER_ONLY ones (:func:`serve_pass_by_table`).
TRITON_FORWARD_EXTEND_SOURCES = ("5e4ab06c1a98c452", "0766f9122f877eba", "e177c998eb645092", "347e6349314c8115",
                                 "f65ae17c8768ccaa", "84015aa1abead45f", "3dfe4c158fa799b1")
# Behind a hybrid wrapper, the largest query tile measured (ops.block_attention: rows x head size):
# block 16 on the 27B's GQA group of 6 and the 35B-A3B's 8, heads of 256, at 8 warps 0.13-0.42x the time
# of SGLang's extend kernel wherever either took over 80 us (lab/verify_attention_bench.py, H100,
# results/hybrid/README.md); the 4B's tile, half that, also ran end to end. Larger tiles are untimed
# and stay with SGLang's kernel.
HYBRID_TILE_LIMIT = 128 * 256
# forward_extend's parameters after (q, k, v, layer, forward_batch), and the values a served pass has.
_PASS_EXTRAS = {"save_kv_cache": True, "sinks": None, "score_mod": None, "aux_tensors": None}


class BlockAttentionRoute:
    """Counts what a routed backend sent where (``/get_server_info``: ``dflash.block_attention``)."""

    def __init__(self):
        self.backends = 0
        self.routed = 0  # extend-kernel calls served by the block kernel (CUDA-graph captures included)
        self.declined = 0  # TARGET_VERIFY calls left to SGLang's kernel
        self.plans_skipped = 0  # replays of routed graphs without SGLang's set-up (FlashInfer's plan, Triton's indices)
        self.served_whole = 0  # of the routed calls, Triton passes served without SGLang's forward_extend
        self.refused: list = []  # query tiles the GPU could not run: SGLang's kernel serves them

    def report(self) -> dict:
        return {"backends": self.backends, "routed_calls": self.routed, "declined_calls": self.declined,
                "plans_skipped": self.plans_skipped, "served_whole": self.served_whole, "refused_tiles": self.refused}

    def refuse(self, err: TileTooLarge) -> None:
        """A launch the GPU refused: counted as declined, logged once a tile."""
        self.declined += 1
        if str(err) not in self.refused:
            self.refused.append(str(err))
            logger.warning("DFLASH block attention: this GPU cannot run a %s; SGLang's kernel serves it", err)


ROUTE = BlockAttentionRoute()


def block_call(args: dict, tile_limit: Optional[int] = None) -> Optional[tuple]:
    """The block kernel's arguments for one extend-kernel call (by name), or None where it must
    decline: anything beyond a uniform block over a one-token-page cache, unscaled, unmasked."""
    for name, value in args.items():
        if name in _POSITIONAL or name in _UNREAD:
            continue
        allowed = _AT_DEFAULT.get(name)  # an argument not known here declines too
        if allowed is None or not any(value is a or (not isinstance(value, torch.Tensor) and value == a)
                                      for a in allowed):
            return None
    q, k_cache, v_cache = args["q_extend"], args["k_buffer"], args["v_buffer"]
    block = args["max_len_extend"]
    if (args["custom_mask"] is not None or not unscaled(args["k_scale"]) or not unscaled(args["v_scale"])
            or not isinstance(block, int) or block < 1 or not kernel_takes(q, k_cache, v_cache, block, tile_limit)):
        return None
    heads, dim = k_cache.shape[-2], k_cache.shape[-1]
    sm_scale = args.get("sm_scale")
    return (q, args["k_extend"].view(-1, heads, dim), args["v_extend"].view(-1, heads, dim), args["o_extend"],
            k_cache, v_cache, args["kv_indptr"], args["kv_indices"], block,
            dim ** -0.5 if sm_scale is None else sm_scale, bool(args["is_causal"]))


def unscaled(scale) -> bool:
    """A K/V scale that scales nothing. A tensor declines: reading its value would sync the host
    (and fail inside a CUDA-graph capture)."""
    return not isinstance(scale, torch.Tensor) and scale in (None, 1.0)


def kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block: int,
                 tile_limit: Optional[int] = None) -> bool:
    """Whether the block kernel takes these queries ``[bs * block, Hq, D]`` over these caches
    ``[slots, Hkv, D]``: one dtype throughout, a head size it serves, whole blocks and GQA groups,
    and a program's query tile (rows x head size) within ``tile_limit`` where one is set."""
    if not (q.dim() == 3 and k_cache.dim() == 3 and serves(q.shape[-1], q.dtype)
            and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.shape[-1] == q.shape[-1] and v_cache.shape[-1] == q.shape[-1]
            and q.shape[0] % block == 0 and q.shape[1] % k_cache.shape[-2] == 0):
        return False
    return fits(block, q.shape[1] // k_cache.shape[-2], q.shape[-1], q.dtype, tile_limit)


def route_block_attention(backend) -> bool:
    """Route ``backend``'s TARGET_VERIFY attention to the block kernel; False where it cannot be
    (neither a Triton nor a FlashInfer backend, pages over one token, ``SGLANG_DFLASH_BLOCK_ATTENTION=0``).
    A hybrid target's wrapper is routed through its full-attention backend, which its attention
    layers call by attribute (``HybridLinearAttnBackend.forward_extend``, 0.5.17-0.5.23): Triton
    only, the one checked lossless on a GPU behind the wrapper."""
    wrapped = getattr(backend, "full_attn_backend", None)
    backend = backend if wrapped is None else wrapped
    if getattr(backend, "_dflash_block_route", False):
        return True
    # behind a wrapper, tiles larger than the one timed keep SGLang's kernel
    tile_limit = HYBRID_TILE_LIMIT if wrapped is not None and not block_attention_every_tile() else None
    if not block_attention_kernel() or getattr(backend, "page_size", 1) != 1:
        return False
    family = {c.__name__ for c in type(backend).__mro__}
    if "TritonAttnBackend" in family and hasattr(backend, "extend_attention_fwd"):
        routed = _route_triton(backend, tile_limit)
    elif (wrapped is None and "FlashInferAttnBackend" in family and hasattr(backend, "_get_wrapper_idx")
          and table_holds_slots(backend)):
        routed = _route_flashinfer(backend)
    else:
        return False
    if routed:
        backend._dflash_block_route = True
        ROUTE.backends += 1
    return routed


def _route_triton(backend, tile_limit: Optional[int]) -> bool:
    extend = backend.extend_attention_fwd
    names = list(inspect.signature(extend).parameters)
    if tuple(names[: len(_POSITIONAL)]) != _POSITIONAL:
        logger.info("DFLASH block attention not routed: SGLang's extend kernel takes %s", names)
        return False
    forward_extend = backend.forward_extend
    block_pass = [None]  # (forward_batch, whether the block's K/V go to the cache) while in a TARGET_VERIFY pass
    reads_indices = [0]  # this backend's TARGET_VERIFY calls captured in a CUDA graph that read SGLang's kv indices
    table = backend.req_to_token if table_holds_slots(backend) and hasattr(backend, "req_to_token") else None
    whole = table is not None and skip_kv_copies()
    if whole and not forward_extend_read(type(backend)):
        whole = False
        logger.info("DFLASH Triton passes go through SGLang's forward_extend: its source is not one the plugin "
                    "has read (%s)", source_digest_or_none(type(backend)))

    def routed_forward_extend(q, k, v, layer, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            if whole:
                o = serve_pass_by_table(backend, table, q, k, v, layer, forward_batch, args, kwargs, tile_limit)
                if o is not None:
                    return o
            saves = kwargs.get("save_kv_cache", args[0] if args else True)
            block_pass[0] = (forward_batch, bool(saves))
        try:
            return forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            block_pass[0] = None

    def routed_extend(*args, **kwargs):
        if block_pass[0] is not None:
            forward_batch, saved = block_pass[0]
            call = dict(zip(names, args))
            call.update(kwargs)
            block_args = block_call(call, tile_limit)
            if block_args is not None:
                try:
                    return serve_block_call(block_args, saved, table, forward_batch, reads_indices)
                except TileTooLarge as err:
                    ROUTE.refuse(err)
            else:
                ROUTE.declined += 1
            reads_indices[0] += capturing()
        return extend(*args, **kwargs)

    backend.forward_extend = routed_forward_extend
    backend.extend_attention_fwd = routed_extend
    if table is not None and skip_unused_plans():
        _skip_unused_triton_replay_setup(backend, reads_indices)
    return True


def serve_block_call(block_args: tuple, saved: bool, table, forward_batch, reads_indices: list) -> torch.Tensor:
    """One extend-kernel call on the block kernel: over the request table where the block's K/V are
    in the cache already, else over SGLang's kv indices (counted in ``reads_indices`` while capturing)."""
    q, _, _, o, k_cache, v_cache, _, _, block, sm_scale, causal = block_args
    if saved and table is not None:  # the block's K/V are in the cache: the table gives every key
        rows, lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        if min(len(rows), len(lens)) >= q.shape[0] // block:
            o = block_attention_by_table(q, o, k_cache, v_cache, table, rows, lens, block, sm_scale, causal)
            ROUTE.routed += 1
            return o
    o = block_attention(*block_args)
    reads_indices[0] += capturing()
    ROUTE.routed += 1
    return o


def source_digest_or_none(cls) -> Optional[str]:
    try:
        return source_digest(cls.forward_extend)
    except (AttributeError, OSError, TypeError):  # no source to read
        return None


@lru_cache(maxsize=None)
def forward_extend_read(cls) -> bool:
    """Whether ``cls.forward_extend`` is one of SGLang's read here (:data:`TRITON_FORWARD_EXTEND_SOURCES`)."""
    return source_digest_or_none(cls) in TRITON_FORWARD_EXTEND_SOURCES


def serve_pass_by_table(backend, table, q, k, v, layer, forward_batch, args: tuple, kwargs: dict,
                        tile_limit: Optional[int] = None) -> Optional[torch.Tensor]:
    """A TARGET_VERIFY ``forward_extend`` call done as SGLang's does it where nothing below declines:
    the pass's K/V written to the cache, then the block kernel over the request table; returns
    the output, or None to leave the call to SGLang. SGLang's kernel would read contiguous copies
    of ``k`` and ``v``; the table reads the cache, so no copy is made."""
    extras = dict(zip(_PASS_EXTRAS, args))
    extras.update(kwargs)
    if set(extras) - set(_PASS_EXTRAS) or extras.pop("save_kv_cache", True) is not True:
        return None
    if any(value is not None for value in extras.values()) or k is None or v is None:
        return None
    kind = getattr(getattr(layer, "attn_type", None), "name", None)
    window, cap = getattr(layer, "sliding_window_size", None), getattr(layer, "logit_cap", 0)
    if (kind not in ("DECODER", "ENCODER_ONLY") or getattr(layer, "is_cross_attention", False)
            or layer.k_scale is not None or layer.v_scale is not None or layer.qk_head_dim != layer.v_head_dim
            or (window is not None and window > -1) or (cap is not None and cap > 0)
            or getattr(layer, "xai_temperature_len", -1) not in (-1, 0, None)):
        return None
    metadata = backend.forward_metadata
    pool = backend.token_to_kv_pool
    if (getattr(backend, "dcp_size", 1) != 1 or getattr(backend, "enable_deterministic", False)
            or getattr(backend, "use_mla", False) or getattr(backend, "dllm_attention", None) is not None
            or getattr(backend, "use_verify_splitkv", False) or getattr(backend, "use_verify_shared_kv", False)
            or getattr(forward_batch, "mha_one_shot", False) or getattr(metadata, "custom_mask", None) is not None
            or getattr(metadata, "swa_out_cache_loc", None) is not None
            or getattr(pool, "requires_physical_write_loc", False)
            or getattr(forward_batch.spec_info, "ragged_verify_layout", None) is not None):
        return None
    rows, lens = forward_batch.req_pool_indices, forward_batch.seq_lens
    q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    bs = len(rows)
    block = q3.shape[0] // bs if bs else 0
    if (block == 0 or q3.shape[0] != bs * block or len(lens) < bs
            or not kernel_takes(q3, k_cache, v_cache, block, tile_limit)):
        return None
    pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
    o = getattr(forward_batch, "_attn_output", None)
    o = torch.empty_like(q) if o is None else o
    try:
        block_attention_by_table(q3, o.view(q3.shape), k_cache, v_cache, table, rows, lens, block, layer.scaling,
                                 kind == "DECODER")
    except TileTooLarge as err:  # SGLang's forward_extend writes the same K/V again and serves the pass
        ROUTE.refuse(err)
        return None
    ROUTE.routed += 1
    ROUTE.served_whole += 1
    return o


def table_holds_slots(backend) -> bool:
    """Whether the request table holds the cache rows themselves: not where a unified pool
    translates its ids (0.5.20+: the backend's ``kv_index_translator``; 0.5.17: its
    ``_translate_kv_loc``)."""
    translator = getattr(backend, "kv_index_translator", None)
    if translator is not None and getattr(translator, "is_translating", True):
        return False
    return getattr(backend, "_translate_kv_loc", None) is None


def _skip_unused_triton_replay_setup(backend, reads_indices: list) -> None:
    """Before each CUDA-graph replay of a TARGET_VERIFY pass, SGLang's Triton backend refills the
    extend kernel's inputs (query and mask offsets, kv indptr and kv indices) with a dozen small
    launches from the host, eagerly (SGLang keeps its metadata glue graph off for DFLASH). A graph
    whose every attention call the block kernel served over the request table reads none of
    them, so that set-up is skipped while no capture of this backend read them. Backends with
    sliding windows, context parallelism or DLLM attention, whose set-up fills more, keep it."""
    replay_setup = getattr(backend, "init_forward_metadata_out_graph", None)
    window = getattr(backend, "sliding_window_size", None)
    if (replay_setup is None or (window is not None and window > 0) or getattr(backend, "dcp_size", 1) != 1
            or getattr(backend, "dllm_attention", None) is not None
            or getattr(backend, "use_sliding_window_kv_pool", False)):
        return

    def unset_replay(forward_batch, in_capture=False, *args, **kwargs):
        spec_info = forward_batch.spec_info
        if (not in_capture and not reads_indices[0] and forward_batch.forward_mode.is_target_verify()
                and getattr(spec_info, "ragged_verify_layout", None) is None
                and getattr(spec_info, "custom_mask", None) is None):
            ROUTE.plans_skipped += 1
            return None
        return replay_setup(forward_batch, in_capture, *args, **kwargs)

    backend.init_forward_metadata_out_graph = unset_replay


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _route_flashinfer(backend) -> bool:
    forward_extend = backend.forward_extend
    declined = [0]  # this backend's TARGET_VERIFY calls left to FlashInfer while a CUDA graph captured them

    def routed_forward_extend(q, k, v, layer, forward_batch, *args, **kwargs):
        metadata = getattr(backend, "forward_metadata", None)
        multi_item = getattr(metadata, "multi_item_params", None)
        if (not forward_batch.forward_mode.is_target_verify() or metadata is None
                or getattr(metadata, "use_ragged", True) or getattr(backend, "prefill_uses_dequant_workspace", False)
                or multi_item is not None and multi_item.is_enabled()):
            if forward_batch.forward_mode.is_target_verify():
                declined[0] += capturing()
                ROUTE.declined += 1
            return forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)
        wrapper = metadata.prefill_wrappers[backend._get_wrapper_idx(layer)]
        planned_forward = wrapper.forward

        def block_forward(q3, kv_cache, causal=True, sm_scale=None, window_left=-1, logits_soft_cap=None,
                          k_scale=None, v_scale=None, **rest):
            o = verify_by_table(backend, forward_batch, q3, kv_cache, causal, sm_scale, window_left,
                                logits_soft_cap, k_scale, v_scale, rest)
            if o is not None:
                return o
            declined[0] += capturing()
            return planned_forward(q3, kv_cache, causal=causal, sm_scale=sm_scale, window_left=window_left,
                                   logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale, **rest)

        own = wrapper.__dict__.get("forward")
        wrapper.forward = block_forward  # for this call only
        try:
            return forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            if own is None:
                del wrapper.forward
            else:
                wrapper.forward = own

    backend.forward_extend = routed_forward_extend
    if skip_unused_plans():
        _skip_unused_replay_plans(backend, declined)
    return True


def verify_by_table(backend, forward_batch, q3, kv_cache, causal, sm_scale, window_left, logits_soft_cap,
                    k_scale, v_scale, rest: dict) -> Optional[torch.Tensor]:
    """One FlashInfer TARGET_VERIFY attention call (the planned wrapper's arguments) on the block
    kernel over the request table, or None (counted) where the kernel declines the call or the GPU
    refuses its tile: FlashInfer's planned forward then serves it."""
    req_pool_indices, prefix_lens = forward_batch.req_pool_indices, forward_batch.seq_lens
    k_cache, v_cache = kv_cache if isinstance(kv_cache, (tuple, list)) else (None, None)
    block = q3.shape[0] // len(req_pool_indices)
    if (rest or window_left not in (-1, None) or logits_soft_cap or not unscaled(k_scale)
            or not unscaled(v_scale) or k_cache is None or block < 1
            or q3.shape[0] != block * len(req_pool_indices) or not kernel_takes(q3, k_cache, v_cache, block)):
        ROUTE.declined += 1
        return None
    scale = q3.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    try:
        o = block_attention_by_table(q3, torch.empty_like(q3), k_cache, v_cache, backend.req_to_token_pool.req_to_token,
                                     req_pool_indices, prefix_lens, block, scale, bool(causal))
    except TileTooLarge as err:
        ROUTE.refuse(err)
        return None
    ROUTE.routed += 1
    return o


def _skip_unused_replay_plans(backend, declined: list) -> None:
    """Before each CUDA-graph replay SGLang plans the FlashInfer wrappers the graph may run: kv
    indices on the GPU, then a host schedule. A TARGET_VERIFY graph captured with every call on the
    block kernel runs no wrapper, and the kernel reads the request table, lengths and pool indices
    from the graph's own inputs, so that work is skipped while no capture of this backend declined
    (an eager call that declines plans for itself, from the GPU's lengths). Backends with more
    than one wrapper (sliding windows, cross attention) or a sliding-window pool, whose replay
    set-up refills more than the plan, keep it."""
    replay_setup = getattr(backend, "init_forward_metadata_out_graph", None)
    if (replay_setup is None or getattr(backend, "dispatch_reason", None) is not None
            or getattr(backend, "use_sliding_window_kv_pool", False)):
        return

    def unplanned_replay_setup(forward_batch, in_capture=False, *args, **kwargs):
        if (not in_capture and not declined[0] and forward_batch.forward_mode.is_target_verify()
                and getattr(forward_batch.spec_info, "ragged_verify_layout", None) is None):
            ROUTE.plans_skipped += 1
            return None
        return replay_setup(forward_batch, in_capture, *args, **kwargs)

    backend.init_forward_metadata_out_graph = unplanned_replay_setup
    backend._dflash_replays_unplanned = lambda: not declined[0]


class WithoutHostLengths:
    """A backend as SGLang's scheduler sees it when deciding whether to copy each step's committed
    lengths to the host: here, not needed. Anything else it asks of the backend itself."""

    needs_cpu_seq_lens = False

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)


def as_the_scheduler_sees(backend):
    """``backend``, or, for a FlashInfer backend whose DFLASH replays all go unplanned, the same
    backend without its need for host lengths. SGLang 0.5.17-0.5.23 ask once, after the graphs are
    captured (``decide_needs_cpu_seq_lens``); FlashInfer says yes for the plans it makes from them,
    and the copy waits on the step in flight each step. A DFLASH decode step's other forwards take
    host bounds from the worker (committed + reserved), which an eager plan does not read: it plans
    from the GPU's lengths. Width 1 verifies a block of one on FlashInfer, no DECODE plan.
    ``SGLANG_DFLASH_SKIP_HOST_LENGTHS=0`` shows every backend as it is."""
    unplanned = getattr(backend, "_dflash_replays_unplanned", None)
    if (unplanned is None or not skip_host_lengths() or not unplanned()
            or not getattr(backend, "needs_cpu_seq_lens", True)):
        return backend
    return WithoutHostLengths(backend)
