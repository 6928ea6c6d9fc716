"""Everything that differs between the SGLang releases the plugin serves, in one place.

SGLang's internals move from release to release (read in full in the project's drift notes).
The plugin touches them only through :class:`SGLangRelease`, whose switches are keyed by the
first release that changed each thing (:data:`CHANGES`), grouped into the families below:

=======  ===============  =====================================================================
family   releases         what the plugin sees change
=======  ===============  =====================================================================
F2       0.5.17           the base: ``Req.update_finish_state`` checks the budget before stops;
                          SGLang refuses ``return_logprob`` for DFLASH itself (a hook lets it
                          through; ``compute_spec_v2_logprobs`` fills it)
F3       0.5.18           stops are checked before the budget; logprob requests reach the worker,
                          which fills them with ``compute_spec_logprobs``
F4       0.5.19-0.5.20    server args resolve through declarations (0.5.20 raises on a raw
                          write); ``nxt_kv_lens_cpu``; the mamba checkpoint grid; the model's
                          EOS ids join the tokens ``min_new_tokens`` holds back; 0.5.20 drops two
                          flag names the DFlash model cards use (``card_flags.py``)
F5       0.5.21-0.5.23    the worker is built without ``ps``; a KV-location plan on every
                          ``ForwardBatch`` and ``--attn-dp-size`` (0.5.22); DP attention in the
                          built-in DFLASH (0.5.23); no ``tc_piecewise`` prefill graphs (0.5.22)
=======  ===============  =====================================================================

:func:`missing_symbols` checks, without importing SGLang, that every module, class, function,
parameter and attribute the plugin relies on exists in a given SGLang source tree; registration
uses it to hand DFLASH to the built-in, all or nothing, when anything is missing.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional

SUPPORTED = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
FAMILIES = {
    "F2": ("0.5.17",),
    "F3": ("0.5.18",),
    "F4": ("0.5.19", "0.5.20"),
    "F5": ("0.5.21", "0.5.22", "0.5.23"),
}
# Each change, and the first release that has it.
CHANGES = {
    "stops_before_budget": "0.5.18",  # Req.update_finish_state checks stops first (our fix, upstream)
    "verify_prepares_mamba_track": "0.5.18",  # DFlashVerifyInput.prepare_for_verify refreshes the track slots
    "logprobs_reach_worker": "0.5.18",  # validate_dflash_request passes return_logprob; compute_spec_logprobs
    "declared_resolution": "0.5.19",  # resolving_view/declare_resolution; worker reads get_spec()
    "nxt_kv_lens": "0.5.19",  # DFlashDraftInputV2.reserved_seq_lens_cpu -> nxt_kv_lens_cpu
    "mamba_track_grid": "0.5.19",  # checkpoints on lcm(page grid, interval)
    "min_new_tokens_model_eos": "0.5.19",  # Req.eos_token_ids are held back by min_new_tokens too
    "worker_without_ps": "0.5.21",  # worker ctor and build_draft_tp_worker lose `ps`
    "kv_loc_plan": "0.5.22",  # every ForwardBatch carries a bound KVLocPlan
    "attn_dp_size": "0.5.22",  # DP attention is --attn-dp-size; enable_dp_attention an alias
    "builtin_dp_attention": "0.5.23",  # the built-in DFLASH serves DP attention (CUDA)
    # The model cards' --mamba-scheduler-strategy and --speculative-dflash-draft-window-size, aliases
    # to 0.5.19, are gone (card_flags.py maps them)
    "card_flag_aliases_removed": "0.5.20",
    "tc_piecewise_removed": "0.5.22",  # --cuda-graph-backend-prefill tc_piecewise (the 4B card's)
}
# Draft architectures SGLang's built-in DFLASH serves and the plugin does not, by first release.
BUILTIN_ONLY_DRAFTS = {
    "DFlashLagunaForCausalLM": "0.5.17",
    "MuseGlimmerAssistantModel": "0.5.18",
    "DFlash2DraftModel": "0.5.19",
    "LiLiCorrDraftModel": "0.5.21",
    "DFlash2BeamDraftModel": "0.5.23",
    "MiniMaxDFlash2DraftModel": "0.5.23",
}
# DFlashDraftModel checkpoints whose config asks for a variant only the built-in implements:
# what it is, the first release that has it, and how the config (top level, dflash_config) says so.
BUILTIN_ONLY_VARIANTS = (
    ("grouped convolution (dflash_config.conv_kernel_size)", "0.5.19",
     lambda top, dflash: bool(dflash.get("conv_kernel_size"))),
    ("the Domino projector (projector_type)", "0.5.20",
     lambda top, dflash: (dflash.get("projector_type") or top.get("projector_type")) == "domino"),
    ("attention sinks or value scaling (dflash_config.attention_sink_bias, attention_value_scale)", "0.5.20",
     lambda top, dflash: bool(dflash.get("attention_sink_bias")) or dflash.get("attention_value_scale") is not None),
    ("Gemma norms (use_gemma_norm)", "0.5.23", lambda top, dflash: bool(top.get("use_gemma_norm"))),
)
PLUGIN_DRAFT = "DFlashDraftModel"
HOOK_TARGETS = {
    "create_worker": "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker",
    "handle_dflash_args": "sglang.srt.arg_groups.speculative_hook._handle_dflash",
    "resolve_algorithm": "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias",
    "stop_before_length": "sglang.srt.managers.schedule_batch.Req.update_finish_state",
    "allow_logprobs": "sglang.srt.speculative.dflash_utils.validate_dflash_request",
    "server_info": "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
    "refuse_unrunnable_prompt": "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
    "card_flags": "sglang.srt.server_args.prepare_server_args",
    "plain_step": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "builtin_step": "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
    "ring_target_cell": "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
    "ring_set_aside": "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
}
SOURCE = "sglang_dflash"  # the name our declarations carry in SGLang's resolution record
# Target attention backends on which a width-1 step runs as a plain DECODE forward. Their decode
# planning takes the lengths from the device (graph replay never reads the host copy; eager decode
# only sizes buffers and a split heuristic from it), so the host's upper bound under the overlap
# schedule serves. FlashInfer plans the decode's KV split from the host lengths, which would
# describe KV the requests do not have yet: it keeps the 1-token verify.
DECODE_AT_WIDTH_ONE = ("TritonAttnBackend", "FlashAttentionBackend")


@lru_cache(maxsize=None)  # SGLangRelease.has asks on every decode step
def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


@dataclass(frozen=True)
class Symbol:
    """``module`` defines ``qualname`` (``Class.member`` for members), taking ``params`` if callable."""

    module: str
    qualname: str
    params: tuple[str, ...] = ()

    def __str__(self) -> str:
        shown = f"({', '.join(self.params)})" if self.params else ""
        return f"{self.module}.{self.qualname}{shown}"


@lru_cache(maxsize=None)
def _launcher_parser():
    """The launcher's argument parser on the installed release (built once: ~30 ms)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


class SGLangRelease:
    """The SGLang release this process runs, and how the plugin talks to it."""

    def __init__(self, version: str):
        self.version = version
        self.key = version_key(version)
        self._track_interval = None  # the scheduler's track grid, fixed once the server runs

    def has(self, change: str) -> bool:
        return self.key >= version_key(CHANGES[change])

    @property
    def supported(self) -> bool:
        return self.version in SUPPORTED

    @property
    def family(self) -> Optional[str]:
        return next((name for name, releases in FAMILIES.items() if self.version in releases), None)

    # ---- server arguments ----------------------------------------------------------------

    def resolving(self, server_args):
        """What argument resolution has decided so far (raw fields before 0.5.19)."""
        if self.has("declared_resolution"):
            from sglang.srt.arg_groups.model_override_base import resolving_view

            return resolving_view(server_args)
        return server_args

    def declare(self, server_args, **fields) -> None:
        """Set resolved arguments: a declaration from 0.5.19 (0.5.20 raises on a raw write)."""
        if self.has("declared_resolution"):
            from sglang.srt.arg_groups.overrides import declare_resolution

            declare_resolution(server_args, SOURCE, **fields)
        else:
            for name, value in fields.items():
                setattr(server_args, name, value)

    def with_one_token_prefill_graph(self, server_args):
        """The resolved CUDA-graph config with a prefill bucket of 1 token added, or None where
        nothing needs adding. SGLang's breakable prefill graphs (0.5.19 on, by default) start at 4
        tokens and refuse a batch that would pad more than 2x, so a prefill of one token, which is
        a radix-cache hit on the whole prompt, ran eagerly: about 20 ms of launches on an 8B target
        before the first token. Kept: a list the user gave (``--cuda-graph-bs-prefill``), any
        other backend, and a list that already pads one token 2x at most (the caller keeps hybrid
        targets' lists too: ``config.TargetInfo.attention_only``)."""
        config = getattr(self.resolving(server_args), "cuda_graph_config", None)
        prefill = getattr(config, "prefill", None)
        if not self.has("declared_resolution") or not getattr(prefill, "bs", None):
            return None
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

        if prefill.backend != Backend.BREAKABLE or min(prefill.bs) <= 2:
            return None
        if (Phase.PREFILL, "bs") in getattr(server_args, "_cuda_graph_config_locked", ()):
            return None
        return with_phase(config, Phase.PREFILL, bs=[1, *prefill.bs])

    def schedule_setting(self, server_args, name: str):
        """A resolved scheduling setting (``max_running_requests``) inside a scheduler process."""
        if self.has("declared_resolution"):
            from sglang.srt.runtime_context import get_schedule

            return getattr(get_schedule(), name)
        return getattr(server_args, name)

    def spec_setting(self, server_args, name: str):
        """A resolved speculative setting inside a scheduler process."""
        if self.has("declared_resolution"):
            from sglang.srt.runtime_context import get_spec

            return getattr(get_spec(), name)
        return getattr(server_args, name)

    def cli_options(self) -> frozenset[str]:
        """Every option string the launcher's parser takes on this release."""
        return frozenset(s for action in _launcher_parser()._actions for s in action.option_strings)

    def cli_refuses(self, flag: str, value: str) -> bool:
        """Whether the launcher's parser on this release rejects ``flag value`` (a choice it lacks,
        or a value its type check turns away); False for a flag it does not take at all."""
        import argparse

        action = next((a for a in _launcher_parser()._actions if flag in a.option_strings), None)
        if action is None:
            return False
        try:
            typed = action.type(value) if callable(action.type) else value
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            return True
        return action.choices is not None and typed not in action.choices

    def pd_role(self, args) -> Optional[str]:
        """``prefill`` or ``decode`` on a PD-disaggregated server, else None. No release has the
        plugin serving it yet: the decode role's first draft input is built by SGLang for its own
        worker (0.5.23: ``build_dflash_disagg_draft_input``), so both roles go to the built-in."""
        # A server-args field like the DP ones (0.5.23 declares it in an argument group, not in
        # server_args.py); where it is missing the server is not disaggregated.
        mode = getattr(args, "disaggregation_mode", None) or "null"
        return None if mode == "null" else mode

    def dp_attention(self, args) -> bool:
        # From 0.5.22 `--dp-size N --enable-dp-attention` is a deprecated spelling of `--attn-dp-size N`.
        by_size = self.has("attn_dp_size") and (getattr(args, "attn_dp_size", None) or 1) > 1
        return by_size or bool(getattr(args, "enable_dp_attention", False))

    # ---- the worker ----------------------------------------------------------------------

    def build_draft_worker(self, server_args, gpu_id, nccl_port, target_model_config, ps=None, attention_backend=None):
        """SGLang's draft worker; ``attention_backend`` (or None: SGLang's resolution) is its attention backend."""
        from sglang.srt.speculative.draft_worker_common import build_draft_tp_worker

        kwargs = dict(server_args=server_args, gpu_id=gpu_id, nccl_port=nccl_port,
                      target_model_config=target_model_config, algo_label="DFLASH",
                      attention_backend_override=attention_backend)
        if not self.has("worker_without_ps"):
            from dataclasses import replace

            kwargs["ps"] = replace(ps, pp_rank=0)
        return build_draft_tp_worker(**kwargs)

    def target_attention_backend(self, server_args) -> Optional[str]:
        """The target's prefill attention backend as SGLang resolved it: the one a draft worker is
        given where the launch names none."""
        if self.has("declared_resolution"):
            from sglang.srt.runtime_context import attention_backends

            return attention_backends()[0]
        return server_args.get_attention_backends()[0]

    @property
    def reserved_lens_field(self) -> str:
        return "nxt_kv_lens_cpu" if self.has("nxt_kv_lens") else "reserved_seq_lens_cpu"

    def reserved_seq_lens_cpu(self, draft_input):
        """Host lengths the scheduler reserved for this step (committed + a block or more)."""
        return getattr(draft_input, self.reserved_lens_field, None)

    def committed_lens_cpu(self, draft_input, bs: int):
        """The committed lengths ``prepare_for_decode`` read on the host for this step (behind the
        device's by at most one step), which it keeps on the draft input after the overlap
        schedule's resolve drops ``seq_lens_cpu`` (backends that ask for no host lengths); or None."""
        buf = getattr(draft_input, "_prepare_batch_seq_lens_cpu_buf", None)
        return None if buf is None or buf.shape[0] < bs else buf[:bs]

    def mamba_track_interval(self, batch) -> int:
        """The grid on which the scheduler marks recurrent-state checkpoints; read once (a
        width-1 step, which asks each time, is host-bound)."""
        if self._track_interval is None:
            self._track_interval = self._read_track_interval(batch)
        return self._track_interval

    def _read_track_interval(self, batch) -> int:
        if self.has("mamba_track_grid"):
            from sglang.srt.runtime_context import mamba_track_grid

            return mamba_track_grid(batch.tree_cache.page_size)
        from sglang.srt.runtime_context import get_exec

        return get_exec().mamba.mamba_track_interval

    def sampling_backend(self) -> Optional[str]:
        """SGLang's ``--sampling-backend`` as its sampler reads it (``flashinfer`` on CUDA by default)."""
        from sglang.srt.runtime_context import get_exec

        return getattr(getattr(get_exec(), "kernel", None), "sampling_backend", None)

    def decodes_width_one(self, attn_backend) -> bool:
        """Whether a width-1 step runs as a plain DECODE forward on this target attention backend."""
        return type(attn_backend).__name__ in DECODE_AT_WIDTH_ONE

    def hybrid_decode_unserved(self, attn_backend) -> Optional[str]:
        """Why a hybrid target's width-1 step cannot run as a plain DECODE here, or None. The DECODE
        advances each request's recurrent state in place, so only a crossed track boundary needs a
        copy, of the live state (:meth:`track_decoded_state`, through SGLang's all-layers track
        kernel, the one its plain decode uses): every linear layer's conv and SSM state must then
        sit in one pool each, with no side state of another kind beside them."""
        linear = getattr(attn_backend, "linear_attn_backend", None)
        pool = getattr(linear, "req_to_token_pool", None)
        cache = getattr(getattr(pool, "mamba_pool", None), "mamba_cache", None)
        if cache is None or not hasattr(cache, "temporal"):
            return "the recurrent-state pool is not laid out as SGLang's mamba pool"
        if len(cache.conv) != 1:
            return f"{len(cache.conv)} conv-state pools (the track kernel copies one)"
        side = getattr(pool, "short_conv_pool", None)
        if side is not None and getattr(side, "conv_state", None) is not None:
            return "a short-conv side state (committed by the verify only)"
        return None

    def gdn_snapshot_unserved(self, attn_backend, server_args) -> Optional[str]:
        """Why the gated-delta-net state cannot stay in the verify's snapshot rows here
        (:mod:`sglang_dflash.gdn_state`), or None. The rows must be the request table's, the
        snapshots one contiguous buffer, and nothing but a verify, a plain decode or an extend
        may read a slot the plugin leaves stale: not the ``no_buffer`` radix cache (it keeps a
        finished request's working slot), not mixed chunks or streaming sessions (an extend of a
        request that verified; a session's next turn resumes its last turn's slot)."""
        linear = getattr(attn_backend, "linear_attn_backend", None)
        pool = getattr(linear, "req_to_token_pool", None)
        if pool is None or not hasattr(pool, "get_speculative_mamba2_params_all_layers"):
            return "the recurrent-state pool is not laid out as SGLang's mamba pool"
        caches = pool.get_speculative_mamba2_params_all_layers()
        snapshots = getattr(caches, "intermediate_ssm", None)
        if snapshots is None:
            return "the verify keeps no state snapshots (--enable-linear-replayssm-spec)"
        if snapshots.dim() != caches.temporal.dim() + 1 or not snapshots.is_contiguous():
            return "the snapshot buffer is not one [layers, rows, steps, *state] tensor"
        if caches.temporal.numel() == 0 or not caches.temporal[0, 0].is_contiguous():
            return "a slot's state is not one contiguous block (the state copy reads it whole)"
        if snapshots.shape[1] != pool.size + 1:
            return f"{snapshots.shape[1]} snapshot rows for {pool.size} request rows"
        side = getattr(pool, "short_conv_pool", None)
        if side is not None and getattr(side, "conv_state", None) is not None:
            return "a short-conv side state (committed by the verify only)"
        args = self.resolving(server_args)
        if not getattr(args, "disable_radix_cache", False) and \
                getattr(args, "mamba_radix_cache_strategy", "no_buffer") in (None, "no_buffer"):
            return "the no_buffer radix cache keeps a finished request's working slot: use extra_buffer"
        if getattr(args, "enable_mixed_chunk", False):
            return "--enable-mixed-chunk (an extend of a request that already verified)"
        if getattr(args, "enable_streaming_session", False):
            return "--enable-streaming-session (a session's next turn resumes its last turn's slot)"
        return None

    def gdn_snapshot_parts(self, attn_backend) -> tuple:
        """SGLang's state pool and its verify snapshots."""
        caches = attn_backend.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        return caches.temporal, caches.intermediate_ssm

    def mamba_slots(self, linear, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """The state slots of these request rows, as the kernels address them."""
        return self.physical_slots(linear, linear.req_to_token_pool.get_mamba_indices(req_pool_indices))

    def physical_slots(self, linear, slots: torch.Tensor) -> torch.Tensor:
        """State slots as the kernels address them (SGLang's ids are virtual under unified memory)."""
        return linear._translate_mamba_indices(slots)

    def commit_conv_states(self, linear, last_steps: torch.Tensor, track: Optional[torch.Tensor],
                           steps_to_track: Optional[torch.Tensor]) -> None:
        """SGLang's verify commit of the convolution windows alone (the SSM state stays in the
        snapshots): its scatter skips a state pool with no elements. ``track``: physical slots."""
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import scatter_mamba_states_after_mtp_verify

        caches = linear.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        conv_only = SimpleNamespace(temporal=caches.temporal.new_empty(0), intermediate_ssm=caches.intermediate_ssm,
                                    conv=caches.conv, intermediate_conv_window=caches.intermediate_conv_window)
        rows = last_steps.shape[0]
        scatter_mamba_states_after_mtp_verify(conv_only, linear.forward_metadata.mamba_cache_indices[:rows],
                                              last_steps, track, steps_to_track)

    def track_decoded_state(self, attn_backend, track_mask, track_indices) -> None:
        """Copy the recurrent state a DECODE left in each request's slot into its track slot, for
        the rows of ``track_mask``: the checkpoint at a track boundary the decoded token reached.
        The slots are those of the forward that just ran on ``attn_backend``."""
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import track_mamba_states_all_layers

        linear = attn_backend.linear_attn_backend
        cache = linear.req_to_token_pool.mamba_pool.mamba_cache
        rows = track_mask.shape[0]
        track_mamba_states_all_layers(  # the slots as the decode kernels read them (virtual to physical)
            cache.conv[0], cache.temporal, linear.forward_metadata.mamba_cache_indices[:rows], track_mask,
            linear._translate_mamba_indices(track_indices), rows,
            check_freed_slots=bool(getattr(linear, "enable_unified_memory", False)),
        )

    def build_width_runners(self, model_runner, widths, capture: bool, decode_width_one: bool = False,
                            on_backend=None) -> dict:
        """For each verify width: a target attention backend of its own and, with decode graphs
        on, a graph runner captured at that width, as SGLang's adaptive EAGLE builds them. Each is
        built while the resolved ``speculative_num_draft_tokens`` reads that width (FA3 and triton
        fix the width when built), then the block is restored: the KV reserve reads it. With
        ``decode_width_one``, width 1 gets plain DECODE graphs (:func:`tapped_decode_runner_class`).
        ``on_backend`` sees each backend before its graphs are captured."""
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        from sglang.srt.runtime_context import get_context, get_spec

        block = get_spec().speculative_num_draft_tokens
        pairs = {}
        for width in widths:
            get_context().override(SOURCE + ".verify_width", speculative_num_draft_tokens=width)
            saved_workspace = model_runner.init_new_workspace
            try:
                backend = model_runner._get_attention_backend(init_new_workspace=True)
                if on_backend is not None:
                    on_backend(backend)
                runner_class = DecodeCudaGraphRunner
                if width == 1 and decode_width_one:
                    runner_class = tapped_decode_runner_class()
                runner = runner_class(model_runner, attn_backend=backend,
                                      speculative_num_draft_tokens=width) if capture else None
            finally:
                model_runner.init_new_workspace = saved_workspace
                get_context().override(SOURCE + ".verify_width", speculative_num_draft_tokens=block)
            pairs[width] = (backend, runner)
        return pairs

    def enable_ragged_verify(self, attn_backend) -> None:
        """Compact ragged verify for DFLASH: the target's TARGET_VERIFY graph runner, built after
        this, captures token-count tiers and replays any mix of per-request widths. SGLang asks one
        module function whether to (``ragged_verify_compact_graphs_enabled``; DSpark alone says yes),
        so that function is wrapped, rather than setting ``SGLANG_RAGGED_VERIFY_MODE``, which would
        change every runner. FlashInfer would fail at capture: fa3 only."""
        from .config import RAGGED_ENV, DFlashConfigError

        if not getattr(attn_backend, "supports_ragged_verify_graph", False):
            raise DFlashConfigError(RAGGED_ENV, f"needs the fa3 attention backend (this target runs "
                                                f"{type(attn_backend).__name__})")
        try:
            import sglang.srt.model_executor.runner.decode_cuda_graph_runner as runner_module
            from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout  # noqa: F401

            asks = runner_module.ragged_verify_compact_graphs_enabled
        except (ImportError, AttributeError):
            raise DFlashConfigError(RAGGED_ENV, f"SGLang {self.version} has no compact ragged verify") from None
        if getattr(asks, "dflash", False):
            return

        def compact_for_dflash(spec_algorithm) -> bool:
            return spec_algorithm.is_dflash() or asks(spec_algorithm)

        compact_for_dflash.dflash = True
        runner_module.ragged_verify_compact_graphs_enabled = compact_for_dflash

    def ragged_layout(self, widths, device, tiers):
        """SGLang's layout of one ragged verify: the per-request widths and the captured token
        tier that holds them (past the largest tier, their own sum: the verify runs eager)."""
        from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

        total = sum(widths)
        tiers = list(tiers or ())
        if not tiers or total > tiers[-1]:
            tiers = [total]
        return RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=list(widths), device=device, grid=tiers)

    def bind_draft_plan(self, draft_model_runner, forward_batch) -> None:
        """The draft's hand-built ForwardBatch is its own iteration: give it its own KV plan."""
        if self.has("kv_loc_plan"):
            draft_model_runner.kv_index_translator.bind_own_plan(forward_batch)

    # ---- request parameters --------------------------------------------------------------

    @staticmethod
    def request_row(req) -> int:
        """A request's row in SGLang's request table (``req.kv`` holds it on 0.5.23)."""
        kv = getattr(req, "kv", None)
        row = getattr(kv, "req_pool_idx", None) if kv is not None else None
        return req.req_pool_idx if row is None else row

    @staticmethod
    def row_generation(req_to_token_pool, row: int) -> Optional[int]:
        """How many times SGLang has handed ``row`` to a request (a chunk continuation keeps it;
        0.5.17 and 0.5.23 alike, a host tensor); None where the pool does not count."""
        generations = getattr(req_to_token_pool, "req_generation", None)
        return None if generations is None else int(generations[row])

    def min_new_tokens_stop_ids(self, req) -> set:
        """The tokens SGLang's min_new_tokens penalizer holds back on this release."""
        ids = set(req.sampling_params.stop_token_ids or ())
        tokenizer = getattr(req, "tokenizer", None)
        if tokenizer is not None:
            ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
            if tokenizer.eos_token_id is not None:
                ids.add(tokenizer.eos_token_id)
        if self.has("min_new_tokens_model_eos"):
            ids |= set(req.eos_token_ids or ())
        return ids

    def fill_logprobs(self, batch, logits_output, tokens, block_size: int) -> None:
        """Logprobs of the block's tokens, row j of request i from verify row i*B + j; SGLang keeps
        the committed ones."""
        if self.has("logprobs_reach_worker"):
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, logits_output, tokens.reshape(-1), chain_stride=block_size)
        else:  # EAGLE's tree form; a chain is the identity gather
            import torch
            from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

            rows = torch.arange(tokens.numel(), device=tokens.device).view(-1, block_size)
            compute_spec_v2_logprobs(batch, logits_output, tokens.reshape(-1), rows, block_size - 1)

    # ---- what the built-in keeps ---------------------------------------------------------

    def builtin_only_drafts(self) -> tuple[str, ...]:
        return tuple(a for a, since in BUILTIN_ONLY_DRAFTS.items() if self.key >= version_key(since))

    def builtin_only_variant(self, config: dict) -> Optional[str]:
        """The built-in-only variant a draft config asks for on this release, if any."""
        dflash = config.get("dflash_config") or {}
        dflash = dflash if isinstance(dflash, dict) else {}
        for what, since, asks in BUILTIN_ONLY_VARIANTS:
            if self.key >= version_key(since) and asks(config, dflash):
                return what
        return None

    # ---- the contract --------------------------------------------------------------------

    def hook_targets(self) -> dict[str, str]:
        """The hooks this release needs, by name."""
        targets = {name: HOOK_TARGETS[name]
                   for name in ("create_worker", "handle_dflash_args", "resolve_algorithm", "server_info",
                                 "refuse_unrunnable_prompt", "card_flags")}
        if not self.has("stops_before_budget"):
            targets["stop_before_length"] = HOOK_TARGETS["stop_before_length"]
        if not self.has("logprobs_reach_worker"):
            targets["allow_logprobs"] = HOOK_TARGETS["allow_logprobs"]
        from .config import draft_ring, scheduler_ledger

        if scheduler_ledger():
            targets["plain_step"] = HOOK_TARGETS["plain_step"]
        if draft_ring():  # the target's KV pool sized without a draft row per token
            targets["ring_target_cell"] = HOOK_TARGETS["ring_target_cell"]
            targets["ring_set_aside"] = HOOK_TARGETS["ring_set_aside"]
        return targets

    def symbols(self) -> list[Symbol]:
        """Every SGLang symbol the plugin touches on this release."""
        syms = [Symbol(*split_target(target)) for target in self.hook_targets().values()]
        spec = "sglang.srt.speculative."
        graph_runner = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
        ps = () if self.has("worker_without_ps") else ("ps",)
        syms += [
            Symbol("sglang.srt.plugins.hook_registry", "HookRegistry.register"),
            Symbol("sglang.srt.plugins.hook_registry", "HookType"),
            Symbol("sglang.srt.models.registry", "ModelRegistry"),
            Symbol("sglang.srt.layers.layernorm", "RMSNorm.forward_cuda"),
            Symbol("sglang.srt.layers.layernorm", "RMSNorm.forward_native"),
            Symbol("sglang.srt.layers.layernorm", "GemmaRMSNorm.forward_cuda"),
            Symbol("sglang.srt.models.utils", "can_use_fused_inplace_qknorm", ("head_dim", "dtype")),
            Symbol("sglang.srt.models.utils", "apply_qk_norm"),
            Symbol("sglang.srt.layers.activation", "SiluAndMul"),
            Symbol("sglang.srt.layers.linear", "MergedColumnParallelLinear"),
            Symbol("sglang.srt.layers.linear", "QKVParallelLinear"),
            Symbol("sglang.srt.layers.linear", "RowParallelLinear"),
            Symbol("sglang.srt.layers.logits_processor", "LogitsProcessorOutput"),
            # verify logits in the model's dtype (sampling.HalfVerifyLogits)
            Symbol("sglang.srt.layers.logits_processor", "LogitsProcessor._get_logits",
                   ("hidden_states", "lm_head", "logits_metadata", "embedding_bias", "use_logits_buffer")),
            Symbol("sglang.srt.layers.logits_processor", "LogitsMetadata.next_token_logits_buffer"),
            Symbol("sglang.srt.layers.quantization.unquant", "UnquantizedLinearMethod"),
            Symbol("sglang.srt.layers.radix_attention", "AttentionType"),
            Symbol("sglang.srt.layers.radix_attention", "RadixAttention.__init__",
                   ("sliding_window_size", "attn_type", "prefix")),
            Symbol("sglang.srt.layers.rotary_embedding", "RotaryEmbedding"),
            # request_checks: the tokenized prompt, checked where SGLang checks its length
            Symbol("sglang.srt.managers.tokenizer_manager", "TokenizerManager._validate_one_request",
                   ("obj", "input_ids")),
            Symbol("sglang.srt.layers.rotary_embedding", "get_rope"),
            Symbol("sglang.srt.model_loader.weight_utils", "default_weight_loader"),
            Symbol("sglang.srt.runtime_context", "get_parallel"),
            Symbol("sglang.srt.runtime_context", "get_exec"),
            Symbol("sglang.srt.configs.hybrid_arch", "mambaish_config"),
            Symbol("sglang.srt.configs.hybrid_arch", "hybrid_gdn_config"),
            Symbol("sglang.srt.distributed", "get_tp_group"),
            Symbol("sglang.srt.distributed", "tensor_model_parallel_all_gather"),
            Symbol("sglang.srt.layers.sampler", "top_k_top_p_min_p_sampling_from_probs_torch",
                   ("need_min_p_sampling", "sampling_seed", "positions")),
            Symbol("sglang.srt.layers.sampler", "sampling_from_probs_torch", ("probs", "sampling_seed", "positions")),
            Symbol("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo.sampling_seed"),
            Symbol("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo.logit_bias"),
            Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.min_new_tokens"),
            Symbol("sglang.srt.layers.sampler", "apply_custom_logit_processor", ("num_tokens_in_batch",)),
            *(Symbol("sglang.srt.managers.utils", "GenerationBatchResult." + f) for f in (
                "logits_output", "next_token_ids", "accept_lens", "can_run_cuda_graph", "next_draft_input",
                "speculative_num_draft_tokens", "new_seq_lens")),
            Symbol("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool.__init__",
                   ("size", "max_context_len", "device", "enable_memory_saver")),
            Symbol("sglang.srt.model_executor.cuda_graph_config", "Backend"),
            # ragged verify (SGLANG_DFLASH_RAGGED): the runner's compact-mode question, the layout
            Symbol(graph_runner, "ragged_verify_compact_graphs_enabled", ("spec_algorithm",)),
            Symbol(spec + "ragged_verify", "RaggedVerifyLayout.from_verify_lens", ("verify_lens_cpu", "device", "grid")),
            Symbol(spec + "dflash_info", "DFlashVerifyInput.ragged_verify_layout"),
            # adaptive width (SGLANG_DFLASH_WIDTHS): a backend and a graph runner per width
            Symbol(graph_runner, "DecodeCudaGraphRunner.__init__",
                   ("model_runner", "attn_backend", "speculative_num_draft_tokens")),
            Symbol("sglang.srt.model_executor.model_runner", "ModelRunner._get_attention_backend",
                   ("init_new_workspace",)),
            Symbol("sglang.srt.runtime_context", "get_context"),
            Symbol("sglang.srt.runtime_context", "get_spec"),
            Symbol("sglang.srt.runtime_context", "RuntimeContext.override", ("source",)),
            # width 1 as a plain DECODE forward: the graph runner's capture switches, the planning
            # a forward batch of our own takes, and the backends that decode it
            *(Symbol(graph_runner, "DecodeCudaGraphRunner." + name) for name in (
                "capture_forward_mode", "capture_hidden_mode")),
            Symbol(graph_runner, "DecodeCudaGraphRunner.get_spec_info", ("num_tokens",)),
            Symbol(graph_runner, "DecodeCudaGraphRunner.can_run_graph", ("forward_batch",)),
            Symbol(graph_runner, "DecodeCudaGraphRunner.load_batch", ("forward_batch",)),
            Symbol("sglang.srt.model_executor.model_runner", "ModelRunner.decode_cuda_graph_runner"),
            Symbol("sglang.srt.model_executor.model_runner", "ModelRunner.attn_backend"),
            Symbol("sglang.srt.model_executor.forward_batch_info", "ForwardBatch.init_new",
                   ("batch", "model_runner", "capture_hidden_mode", "return_hidden_states_before_norm")),
            Symbol("sglang.srt.model_executor.forward_batch_info", "ForwardMode.DECODE"),
            Symbol("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend.init_forward_metadata",
                   ("forward_batch",)),
            Symbol("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),
            Symbol("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionBackend"),
            Symbol(spec + "base_spec_worker", "BaseSpecWorker.on_verify_complete_cpu",
                   ("num_correct_drafts_per_req", "batch_size")),
            Symbol("sglang.srt.model_executor.forward_batch_info", "CaptureHiddenMode"),
            Symbol("sglang.srt.model_executor.forward_batch_info", "ForwardMode"),
            Symbol("sglang.srt.model_executor.forward_batch_info", "ForwardBatch.input_embeds"),
            Symbol("sglang.srt.model_executor.model_runner", "ModelRunner.capture_tail_hooks"),
            Symbol("sglang.srt.managers.tp_worker", "TpModelWorker.forward_batch_generation",
                   ("batch", "forward_batch", "is_verify", "skip_attn_backend_init", "capture_hidden_mode")),
            Symbol(spec + "base_spec_worker", "BaseSpecWorker"),
            Symbol(spec + "dflash_info", "DFlashVerifyInput.prepare_for_verify", ("batch", "target_worker")),
            Symbol(spec + "dflash_info_v2", "DFlashDraftInputV2.create_idle_input", ("device",)),
            Symbol(spec + "dflash_info_v2", "DFlashDraftInputV2.bonus_tokens"),
            Symbol(spec + "dflash_info_v2", "DFlashDraftInputV2." + self.reserved_lens_field),
            Symbol(spec + "draft_worker_common", "build_draft_tp_worker",
                   ("server_args", "gpu_id", "nccl_port", "target_model_config", "algo_label",
                    "attention_backend_override") + ps),
            (Symbol("sglang.srt.runtime_context", "attention_backends") if self.has("declared_resolution")
             else Symbol("sglang.srt.server_args", "ServerArgs.get_attention_backends")),
            Symbol(spec + "spec_info", "SpeculativeAlgorithm"),
            Symbol(spec + "spec_utils", "GrammarTree.from_linear_chain"),
            Symbol(spec + "spec_utils", "build_grammar_vocab_mask",
                   ("reqs", "tree", "sampling_info", "device", "barrier")),
            Symbol(spec + "spec_utils", "prepare_mamba_track_for_verify"),
            Symbol("sglang.srt.layers.attention.hybrid_linear_attn_backend",
                   "HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
                   ("last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track", "model",
                    "req_pool_indices")),
            # adaptive widths on a hybrid target: which kernel verifies its linear layers
            Symbol("sglang.srt.layers.attention.hybrid_linear_attn_backend", "HybridLinearAttnBackend.full_attn_backend"),
            Symbol("sglang.srt.layers.attention.hybrid_linear_attn_backend", "HybridLinearAttnBackend.linear_attn_backend"),
            Symbol("sglang.srt.layers.attention.linear.gdn_backend", "GDNAttnBackend.kernel_dispatcher"),
            Symbol("sglang.srt.layers.attention.linear.gdn_backend", "GDNKernelDispatcher.verify_kernel_is_flashinfer"),
            # width 1 as a DECODE on a hybrid target: the live state copied to a crossed track boundary
            Symbol("sglang.kernels.ops.mamba.mamba_state_scatter_triton", "track_mamba_states_all_layers",
                   ("conv_states_pool", "ssm_states_pool", "cache_indices", "mamba_track_mask", "mamba_track_indices",
                    "batch_size", "check_freed_slots")),
            Symbol("sglang.srt.layers.attention.hybrid_linear_attn_backend", "MambaAttnBackendBase._translate_mamba_indices"),
            # SGLANG_DFLASH_GDN_STATE=snapshot: the verify redirected, the conv windows committed alone
            Symbol("sglang.srt.layers.attention.linear.gdn_backend", "GDNKernelDispatcher.target_verify",
                   ("ssm_states", "cache_indices")),
            Symbol("sglang.kernels.ops.mamba.mamba_state_scatter_triton", "scatter_mamba_states_after_mtp_verify",
                   ("mamba_caches", "state_indices_tensor", "last_correct_step_indices", "mamba_track_indices",
                    "mamba_steps_to_track")),
        ]
        if self.has("declared_resolution"):
            syms += [
                Symbol("sglang.srt.arg_groups.model_override_base", "resolving_view"),
                Symbol("sglang.srt.arg_groups.overrides", "declare_resolution", ("server_args", "source")),
                Symbol("sglang.srt.runtime_context", "get_spec"),
            ]
        if self.has("mamba_track_grid"):
            syms.append(Symbol("sglang.srt.runtime_context", "mamba_track_grid", ("tree_page",)))
        if self.has("logprobs_reach_worker"):
            syms.append(Symbol("sglang.srt.layers.logprob_processor", "compute_spec_logprobs",
                               ("batch", "logits_output", "predict", "chain_stride")))
        else:
            syms.append(Symbol("sglang.srt.layers.logprob_processor", "compute_spec_v2_logprobs",
                               ("batch", "logits_output", "predict", "accept_index", "speculative_num_steps")))
        if self.has("min_new_tokens_model_eos"):
            syms.append(Symbol("sglang.srt.managers.schedule_batch", "Req.eos_token_ids"))
        if self.has("kv_loc_plan"):
            syms.append(Symbol("sglang.srt.mem_cache.kv_index_translator", "KVIndexTranslator.bind_own_plan",
                               ("forward_batch",)))
        return syms


def split_target(dotted: str) -> tuple[str, str]:
    """``pkg.module.Class.member`` -> (``pkg.module``, ``Class.member``); functions split at the last dot."""
    parts = dotted.split(".")
    cut = next((i for i in range(1, len(parts)) if parts[i][0].isupper()), len(parts) - 1)
    return ".".join(parts[:cut]), ".".join(parts[cut:])


@lru_cache(maxsize=1)
def tapped_decode_runner_class():
    """SGLang's decode graph runner, capturing plain DECODE steps that return the tapped hidden
    states. On a speculative target its ``__init__`` picks TARGET_VERIFY and the server's hidden
    mode, then captures (inside ``__init__``) with the verify's spec input; the mode, the hidden
    capture and the absent spec input are fixed here, so every read sees them."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    class TappedDecodeGraphRunner(DecodeCudaGraphRunner):
        @property
        def capture_forward_mode(self):
            return ForwardMode.DECODE

        @capture_forward_mode.setter
        def capture_forward_mode(self, mode):
            pass  # TARGET_VERIFY, the base's choice for any speculative target

        @property
        def capture_hidden_mode(self):
            return CaptureHiddenMode.FULL

        @capture_hidden_mode.setter
        def capture_hidden_mode(self, mode):
            pass  # the server's mode (NULL), or what a spec input asks for

        def get_spec_info(self, num_tokens: int):
            return None  # a plain decode batch (decode planning would read a draft's kv_indptr)

    return TappedDecodeGraphRunner


@lru_cache(maxsize=1)
def running() -> SGLangRelease:
    """The release installed in this environment."""
    return SGLangRelease(installed_version())


def installed_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def source_digest(function) -> str:
    """sha256 (first 16 hex digits) of a function's dedented source: where the plugin repeats or
    bypasses a piece of SGLang, it does so only for the versions of that piece it has read."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(function)).encode()).hexdigest()[:16]


def installed_source_root() -> Optional[str]:
    """The folder of the installed ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def missing_symbols(release: SGLangRelease, sglang_root: str) -> list[str]:
    """The symbols of ``release.symbols()`` that the SGLang source tree at ``sglang_root`` lacks.

    Read from the source with ``ast``: nothing is imported, so the launcher stays light and the
    same check runs on any release's unpacked wheel.
    """
    tree = _SourceTree(sglang_root)
    return [str(sym) for sym in release.symbols() if not tree.defines(sym)]


class _SourceTree:
    """SGLang's modules parsed on demand, for one check. The trees (~400k objects) go with it:
    kept alive in every server process, they made each full GC there ~0.15-0.6 s, and a GC
    in the HTTP process holds a wave's requests back."""

    def __init__(self, root: str):
        self.root = root
        self._trees: dict[str, Optional[ast.Module]] = {}

    def _parse(self, module: str) -> Optional[ast.Module]:
        if module not in self._trees:
            self._trees[module] = _parse(self.root, module)
        return self._trees[module]

    def defines(self, sym: Symbol) -> bool:
        node = self._resolve(sym.module, sym.qualname.split("."))
        if node is None:
            return False
        if sym.params:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return False
            a = node.args
            names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
            return a.kwarg is not None or set(sym.params) <= names
        return True

    def _resolve(self, module: str, path: list[str], depth: int = 0):
        tree = self._parse(module)
        if tree is None or depth > 8:
            return None
        node = self._lookup(tree, module, path[0], depth)
        for name in path[1:]:
            if not isinstance(node, ast.ClassDef):
                return None
            node = self._member(node, module, name, depth)
        return node

    def _lookup(self, tree: ast.Module, module: str, name: str, depth: int):
        """A top-level name: defined here, else imported (``from x import name`` or ``*``)."""
        nodes = [node for stmt in tree.body for node in _flatten(stmt)]
        found = next((node for node in nodes if _binds(node, name)), None)
        if found is not None:
            return found
        star_sources = []
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, self.root)
                for alias in node.names:
                    if alias.name == "*":
                        star_sources.append(source)
                    elif (alias.asname or alias.name) == name:
                        found = self._resolve(source, [alias.name], depth + 1)
                        # An imported submodule, or a name we cannot follow (outside sglang).
                        return found if found is not None else ast.Pass()
        for source in star_sources:
            found = self._resolve(source, [name], depth + 1)
            if found is not None:
                return found
        return None

    def _member(self, cls: ast.ClassDef, module: str, name: str, depth: int):
        """A method, class attribute, dataclass field or ``self.name = ...`` of a class or its bases."""
        found = next((inner for node in cls.body for inner in _flatten(node) if _binds(inner, name)), None)
        if found is not None:
            return found
        for fn in ast.walk(cls):
            if isinstance(fn, (ast.Assign, ast.AnnAssign)):
                targets = fn.targets if isinstance(fn, ast.Assign) else [fn.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        return fn
        tree = self._parse(module)
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self._lookup(tree, module, base.id, depth + 1)
                if isinstance(found, ast.ClassDef):
                    hit = self._member_in_module_of(found, module, base.id, name, depth + 1)
                    if hit is not None:
                        return hit
        return None

    def _member_in_module_of(self, cls, module, base_name, name, depth):
        # The base may live in another module: find the module that defines it.
        tree = self._parse(module)
        for stmt in tree.body:
            for node in _flatten(stmt):
                if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == base_name for a in node.names):
                    return self._member(cls, _absolute(module, node, self.root), name, depth)
        return self._member(cls, module, name, depth)


def _binds(node, name: str) -> bool:
    """``node`` defines ``name`` in its scope: a def, a class, or an (annotated) assignment."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name


def _flatten(stmt):
    """A statement, and those of the ``if``/``try`` blocks it opens (guarded imports), except
    ``if TYPE_CHECKING:`` blocks, which define nothing at run time."""
    yield stmt
    if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.dump(stmt.test):
        return
    for field in ("body", "orelse", "finalbody", "handlers"):
        if isinstance(stmt, (ast.If, ast.Try)) or (field == "body" and isinstance(stmt, ast.ExceptHandler)):
            for child in getattr(stmt, field, []) or []:
                yield from _flatten(child)


def _absolute(module: str, node: ast.ImportFrom, root: str) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    is_package = os.path.isfile(os.path.join(root, *package[1:], "__init__.py"))
    base = package if is_package else package[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _parse(root: str, module: str) -> Optional[ast.Module]:
    parts = module.split(".")
    if parts[0] != "sglang":
        return None
    base = os.path.join(root, *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return ast.parse(f.read(), filename=path)
    return None
