"""The thin, version-gated hooks that make ``--speculative-algorithm DFLASH`` run this plugin.

SGLang calls :func:`register` (entry point group ``sglang.srt.plugins``) early in every process:
the launcher, the engine and each scheduler subprocess. ``DFLASH`` is a reserved algorithm name,
so instead of registering a new one we keep the enum member, and with it every in-tree
``is_dflash()`` branch (aux-hidden capture on the target, KV cell sizing, graph plumbing), and
swap what it builds. The hooks (targets by release in :meth:`compat.SGLangRelease.hook_targets`):

* ``SpeculativeAlgorithm.create_worker``: DFLASH builds :class:`sglang_dflash.worker.DFlashWorker`,
  and ``ModelRegistry.models["DFlashDraftModel"]`` becomes the plugin's draft network (the
  registry holds classes in a dict that hooks cannot reach).
* ``speculative_hook._handle_dflash``: the draft and the flags are checked (``config.py``) before
  SGLang's own DFLASH argument policy runs.
* ``speculative_hook._resolve_speculative_algorithm_alias``: it runs first and reads the draft's
  config through transformers, so a bad draft is named here in one line, not in a traceback.
* ``Req.update_finish_state`` (0.5.17 only): SGLang checks ``max_new_tokens`` before stop tokens
  and strings, so a stop inside a multi-token verify step that also reaches the budget was lost.
* ``Scheduler.get_internal_state``: ``/get_server_info`` carries the worker's own figures under
  ``dflash`` (the verify widths it used).
* ``TokenizerManager._validate_one_request``: a request no forward can run (an empty prompt, token
  ids outside the vocabulary, more top logprobs than tokens) is refused with a 400 instead of
  ending the scheduler (``request_checks.py``).
* ``server_args.prepare_server_args``: the DFlash model cards' flag names the release renamed are
  taken under the release's names, with a log line (``card_flags.py``); kept where the built-in
  serves DFLASH too.
* ``DefaultPoolConfigurator.__init__`` and ``.calculate_pool_sizes`` (with ``SGLANG_DFLASH_DRAFT_RING=1``):
  the draft's K/V lives in a fixed ring, so the target's KV pool is priced at its own cell per token
  and the ring's bytes are set aside whole (``context.py``).
* ``dflash_utils.validate_dflash_request`` (0.5.17 only): SGLang refuses ``return_logprob`` under
  DFLASH; the plugin's worker serves it, so SGLang's other checks run on a request seen without it.
* With ``SGLANG_DFLASH_LEDGER=1``: ``TpModelWorker.forward_batch_generation`` on a plain server and
  the built-in's ``DFlashWorkerV2.forward_batch_generation`` under ``SGLANG_DFLASH_IMPL=builtin``
  time the scheduler's worker calls by mode, as the plugin's worker always does (the other halves of
  a profile: ``/get_server_info`` ``scheduler_ledger``).

A draft architecture only the built-in implements, DP attention where the built-in serves it,
``SGLANG_DFLASH_IMPL=builtin``, an SGLang release outside the supported range, or one that lacks
any symbol the plugin needs: DFLASH stays with the built-in, and the log says why.
"""

from __future__ import annotations

import logging
from typing import Optional

from . import compat
from .config import FP32_NORM_ENV, IMPL_ENV, fp32_norms, selected_implementation  # noqa: F401 (re-exported)
from .config import scheduler_ledger

logger = logging.getLogger("sglang_dflash")

RMSNORM_CUDA = "sglang.srt.layers.layernorm.RMSNorm.forward_cuda"
GEMMA_RMSNORM_CUDA = "sglang.srt.layers.layernorm.GemmaRMSNorm.forward_cuda"  # Qwen3.5 / Qwen3-Next
# Its JIT kernel has no float32 build either, and a failed build is retried on every forward.
QKNORM_CHECK = "sglang.srt.models.utils.can_use_fused_inplace_qknorm"
HANDLE_DFLASH_ARGS = compat.HOOK_TARGETS["handle_dflash_args"]
UPDATE_FINISH_STATE = compat.HOOK_TARGETS["stop_before_length"]
CARD_FLAGS = compat.HOOK_TARGETS["card_flags"]

# Set in the scheduler process that builds the plugin's worker: request-level hooks act only there,
# so EAGLE, MTP and NGRAM servers (and the built-in DFLASH) behave exactly as without the plugin.
_serving = False
# SGLANG_DFLASH_LEDGER=1 on a plain or a built-in DFLASH server: its scheduler's worker calls by mode.
_ledger = None


def builtin_reason(impl: str, release: compat.SGLangRelease) -> Optional[str]:
    """Why this process leaves DFLASH to SGLang's built-in, or None. All or nothing: SGLang only
    logs a hook it cannot apply, so a half-installed plugin would fail silently."""
    if impl == "builtin":
        return f"{IMPL_ENV}=builtin"
    if not release.supported:
        return (f"SGLang {release.version} is not a release sglang-dflash supports "
                f"({compat.SUPPORTED[0]} to {compat.SUPPORTED[-1]})")
    root = compat.installed_source_root()
    missing = compat.missing_symbols(release, root) if root else ["the sglang package"]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"SGLang {release.version} lacks {missing[0]}{more}"
    return None


def register() -> None:
    """Entry point: installs the hooks (the registry applies them once all plugins have run)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    impl = selected_implementation()
    if fp32_norms():
        HookRegistry.register(RMSNORM_CUDA, fp32_rmsnorm_hook, HookType.AROUND)
        HookRegistry.register(GEMMA_RMSNORM_CUDA, fp32_rmsnorm_hook, HookType.AROUND)
        HookRegistry.register(QKNORM_CHECK, fp32_qknorm_hook, HookType.AROUND)
    release = _release()
    reason = builtin_reason(impl, release)
    if reason is not None:
        def log_builtin(original, server_args):
            return log_builtin_hook(reason, original, server_args)

        HookRegistry.register(HANDLE_DFLASH_ARGS, log_builtin, HookType.AROUND)
        if release.supported:  # the cards' commands start with the built-in too
            HookRegistry.register(CARD_FLAGS, card_flags_hook, HookType.AROUND)
        if release.supported and impl == "builtin" and scheduler_ledger():  # its side of a profile
            HookRegistry.register(compat.HOOK_TARGETS["builtin_step"], builtin_step_hook, HookType.AROUND)
            HookRegistry.register(compat.HOOK_TARGETS["server_info"], server_info_hook, HookType.AROUND)
        return
    hooks = {
        "create_worker": create_worker_hook,
        "handle_dflash_args": handle_dflash_args_hook,
        "resolve_algorithm": draft_path_hook,
        "stop_before_length": stop_before_length_hook,
        "allow_logprobs": allow_logprobs_hook,
        "server_info": server_info_hook,
        "refuse_unrunnable_prompt": refuse_unrunnable_prompt_hook,
        "card_flags": card_flags_hook,
        "plain_step": plain_step_hook,
        "ring_target_cell": ring_target_cell_hook,
        "ring_set_aside": ring_set_aside_hook,
    }
    for name, target in release.hook_targets().items():
        HookRegistry.register(target, hooks[name], HookType.AROUND)


def card_flags_hook(original, argv, *args, **kwargs):
    """The launcher's command line, with the model cards' flags under this release's names. Runs
    in the launcher before SGLang parses anything; ``sgl.Engine(...)`` keyword arguments never
    pass here and keep SGLang's names."""
    from .card_flags import mentions_card_flag, rewrite

    if isinstance(argv, (list, tuple)) and mentions_card_flag(argv):
        release = _release()
        argv, notes = rewrite(argv, release.cli_options().__contains__, release.version, release.cli_refuses)
        for note in notes:
            # A warning: SGLang sets up logging only after parsing, and a start that then fails
            # should still show it.
            logger.warning(note)
    return original(argv, *args, **kwargs)


def fp32_rmsnorm_hook(original, self, x, *args, **kwargs):
    """Float32 activations take SGLang's own torch implementation; other dtypes the kernel."""
    import torch

    if x.dtype == torch.float32:
        return self.forward_native(x, *args, **kwargs)
    return original(self, x, *args, **kwargs)


def fp32_qknorm_hook(original, head_dim, dtype):
    """Float32 q/k norms take the torch path; SGLang's cache does not remember a failed JIT build."""
    import torch

    return False if dtype == torch.float32 else original(head_dim, dtype)


def stop_before_length_hook(original, req, new_accepted_len: int = 1):
    """Finish a multi-token step as plain decoding would have, token by token.

    SGLang checks the budget before stops, so a stop token or string accepted inside the step
    that also reaches the budget was ignored. Plain decoding checks stops on every token before
    the budget-th one, and reports the budget on that token: run the stop checks on the
    accepted tokens that precede it first.
    """
    if not _serving:
        return original(req, new_accepted_len)
    budget = req.sampling_params.max_new_tokens
    produced = len(req.output_ids)
    if new_accepted_len <= 1 or budget is None or produced < budget or req.finished() or req.to_finish:
        return original(req, new_accepted_len)
    before_budget = new_accepted_len - (produced - (budget - 1))
    if before_budget > 0:
        output_ids = req.output_ids
        req.output_ids = output_ids[: budget - 1]  # below the budget: only the stop checks run
        try:
            original(req, before_budget)
        finally:
            req.output_ids = output_ids
        if req.finished():
            return None
    return original(req, new_accepted_len)


def create_worker_hook(original, self, server_args):
    global _serving
    if not self.is_dflash() or _builtin_for_this_server(server_args) is not None:
        return original(self, server_args)
    from sglang.srt.models.registry import ModelRegistry

    from .model import DFlashDraftModel
    from .worker import DFlashWorker

    ModelRegistry.models[compat.PLUGIN_DRAFT] = DFlashDraftModel
    _serving = True
    return DFlashWorker


def _builtin_for_this_server(server_args) -> Optional[str]:
    from .config import builtin_serves

    return builtin_serves(server_args, _release())


def _release() -> compat.SGLangRelease:
    return compat.running()


def log_builtin_hook(reason, original, server_args):
    # A warning unless asked for: a server meant for the plugin must say it is not running it.
    log = logger.info if reason == f"{IMPL_ENV}=builtin" else logger.warning
    log("DFLASH is served by SGLang's built-in implementation: %s.", reason)
    return original(server_args)


def draft_path_hook(original, algorithm, draft_path, *args, **kwargs):
    """The draft's folder and config.json, checked before SGLang reads them through transformers."""
    from .config import DFlashConfigError, check_draft_folder

    if (algorithm or "").upper() == "DFLASH" and draft_path:
        try:
            check_draft_folder(draft_path)
        except DFlashConfigError as e:
            raise SystemExit(f"sglang-dflash: {e}") from None
    return original(algorithm, draft_path, *args, **kwargs)


def handle_dflash_args_hook(original, server_args):
    """Validate the draft checkpoint and the flags, then let SGLang apply its DFLASH defaults."""
    from .config import (
        ONE_TOKEN_PREFILL_GRAPH_ENV,
        DFlashConfigError,
        admissions_as_plain_decoding,
        fix_block_named_by_flag,
        one_token_prefill_graph,
        validate_server_args,
    )

    release = _release()
    reason = _builtin_for_this_server(server_args)
    if reason is not None:
        return log_builtin_hook(reason, original, server_args)
    try:
        cfg, target = validate_server_args(server_args, release)
    except DFlashConfigError as e:
        # One line and a non-zero exit, before any process or GPU memory is set up.
        raise SystemExit(f"sglang-dflash: {e}") from None
    view = release.resolving(server_args)
    fix_block_named_by_flag(view)
    if view.speculative_num_draft_tokens is None and view.speculative_dflash_block_size is None:
        release.declare(server_args, speculative_num_draft_tokens=cfg.block_size)
    admissions = admissions_as_plain_decoding(view)
    if admissions:
        release.declare(server_args, **admissions)
    original(server_args)
    graphs = None
    if one_token_prefill_graph() and target.attention_only:
        graphs = release.with_one_token_prefill_graph(server_args)
    if graphs is not None:
        release.declare(server_args, cuda_graph_config=graphs)
        logger.info("DFLASH: prefill CUDA graphs also capture 1 token, so a prefill that hits the radix "
                    "cache on the whole prompt replays a graph (%s=0 keeps SGLang's buckets).",
                    ONE_TOKEN_PREFILL_GRAPH_ENV)
    if admissions:
        logger.info("DFLASH: new requests join a running batch as under plain decoding "
                    "(--min-free-slots-delay %s; set it to hold them for several free slots).",
                    admissions["min_free_slots_delay"])
    logger.info(
        "DFLASH is served by sglang-dflash on SGLang %s (block_size=%s, draft=%s, target_layer_ids=%s).",
        release.version, release.resolving(server_args).speculative_num_draft_tokens,
        view.speculative_draft_model_path, list(cfg.target_layer_ids),
    )


class _WithoutLogprobs:
    """A request as SGLang's DFLASH check would see it without return_logprob."""

    return_logprob = False

    def __init__(self, req):
        self._req = req

    def __getattr__(self, name):
        return getattr(self._req, name)


def allow_logprobs_hook(original, req, *args, **kwargs):
    """0.5.17: logprob requests reach the plugin's worker, which fills them; SGLang's other DFLASH
    request checks still apply. Other servers (and the built-in DFLASH) keep SGLang's check."""
    return original(_WithoutLogprobs(req) if _serving else req, *args, **kwargs)


def plain_step_hook(original, worker, batch=None, *args, **kwargs):
    """``TpModelWorker.forward_batch_generation`` on a server without speculative decoding, timed
    by mode as the plugin's worker times its own calls (``host_pauses.StepStalls``): a profile sets
    plain decoding's decode steps, admissions and gaps beside the plugin's. Elsewhere (the plugin's
    target calls, EAGLE, the built-in) it only passes the call on."""
    spec = getattr(batch, "spec_algorithm", None)
    if _serving or batch is None or (spec is not None and not spec.is_none()):
        return original(worker, batch, *args, **kwargs)
    return _ledger_call(original, worker, batch, batch.forward_mode.is_extend(), args, kwargs)


def builtin_step_hook(original, worker, batch=None, *args, **kwargs):
    """The built-in DFLASH worker's ``forward_batch_generation`` (``SGLANG_DFLASH_IMPL=builtin``),
    timed by mode as the plugin's own worker is: the built-in's side of a profile."""
    if batch is None:
        return original(worker, batch, *args, **kwargs)
    return _ledger_call(original, worker, batch, batch.forward_mode.is_extend() or batch.is_extend_in_batch,
                        args, kwargs)


def _ledger_call(original, worker, batch, extend: bool, args, kwargs):
    global _ledger
    from .host_pauses import StepStalls, call_shape

    if _ledger is None:
        _ledger = StepStalls()
    mode, bs, tokens = call_shape(batch, extend)
    _ledger.begin()
    result = None
    try:
        result = original(worker, batch, *args, **kwargs)
        return result
    finally:  # a decode step's width: the verified tokens a request's row holds (1 for plain decoding)
        width = None
        if mode == "decode":
            width = getattr(result, "speculative_num_draft_tokens", None) or 1
        _ledger.end(mode, bs, tokens, width)


def ring_target_cell_hook(original, configurator, kvc, *args, **kwargs):
    original(configurator, kvc, *args, **kwargs)
    if _serving:  # the target's runner, built by the plugin's worker
        from .context import size_target_cell_for_ring

        size_target_cell_for_ring(original, configurator, kvc, _release())


def ring_set_aside_hook(original, configurator, available_bytes, page_size, *args, **kwargs):
    from .context import set_aside_ring

    return original(configurator, set_aside_ring(configurator, available_bytes), page_size, *args, **kwargs)


def server_info_hook(original, scheduler, recv_req):
    """``/get_server_info``: the plugin's worker adds what only it knows under ``dflash``; a plain
    server with ``SGLANG_DFLASH_LEDGER=1`` its worker calls by mode under ``scheduler_ledger``."""
    out = original(scheduler, recv_req)
    if _ledger is not None and not _serving and isinstance(getattr(out, "internal_state", None), dict):
        out.internal_state["scheduler_ledger"] = _ledger.report()
    report = getattr(getattr(scheduler, "draft_worker", None), "server_info", None)
    if _serving and callable(report) and isinstance(getattr(out, "internal_state", None), dict):
        out.internal_state["dflash"] = report(running_request_ids(scheduler))
        state_pool = recurrent_state_slots(scheduler)
        if state_pool is not None:
            out.internal_state["dflash"]["state_pool"] = state_pool
    return out


def running_request_ids(scheduler) -> Optional[set]:
    """The ids of the requests the scheduler is decoding (None where it keeps no running batch)."""
    reqs = getattr(getattr(scheduler, "running_batch", None), "reqs", None)
    return None if reqs is None else {req.rid for req in reqs}


def recurrent_state_slots(scheduler):
    """A hybrid target's recurrent-state pool, ``{"used", "cached", "size"}`` slots (None on other
    targets): /v1/loads counts KV tokens only, and a leaked state slot fails admissions as surely.
    ``cached``: states the radix cache keeps for prefixes and may evict; ``used``: the rest of the
    slots taken, which requests hold (0 on an idle server)."""
    pool = getattr(scheduler, "req_to_token_pool", None)
    allocator = getattr(pool, "mamba_allocator", None)
    size = getattr(allocator, "size", None)
    if allocator is None or not isinstance(size, int):
        return None
    evictable = getattr(getattr(scheduler, "tree_cache", None), "mamba_evictable_size", None)
    cached = int(evictable()) if callable(evictable) else 0
    return {"used": size - int(allocator.available_size()) - cached, "cached": cached, "size": size}


def refuse_unrunnable_prompt_hook(original, tokenizer_manager, obj, input_ids, *args, **kwargs):
    """A prompt that would end the scheduler is refused like one past the context: ValueError, a 400.

    The tokenizer runs in another process than the worker, so ``_serving`` is not known here: the
    server's own arguments say whether the plugin serves it (checked once per tokenizer manager)."""
    original(tokenizer_manager, obj, input_ids, *args, **kwargs)
    if not _plugin_serves(tokenizer_manager):
        return
    from .request_checks import has_session, prompt_problem, top_logprobs_problem

    model_config = getattr(tokenizer_manager, "model_config", None)
    vocab = getattr(model_config, "vocab_size", None)
    if not vocab:
        return
    problem = prompt_problem(input_ids, vocab, has_session(obj)) or top_logprobs_problem(obj, vocab)
    if problem is not None:
        raise ValueError(problem)


def _plugin_serves(tokenizer_manager) -> bool:
    serves = getattr(tokenizer_manager, "_sglang_dflash_serves", None)
    if serves is None:
        args = getattr(tokenizer_manager, "server_args", None)
        algorithm = str(getattr(args, "speculative_algorithm", None) or "").upper()
        serves = algorithm == "DFLASH" and _builtin_for_this_server(args) is None
        tokenizer_manager._sglang_dflash_serves = serves
    return serves
