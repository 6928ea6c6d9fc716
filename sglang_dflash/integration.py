"""The thin, version-gated hooks that make ``--speculative-algorithm DFLASH`` run this plugin.

SGLang calls :func:`register` (entry point group ``sglang.srt.plugins``) early in every process:
the launcher, the engine and each scheduler subprocess. ``DFLASH`` is a reserved algorithm name,
so instead of registering a new one we keep the enum member, and with it every in-tree
``is_dflash()`` branch (aux-hidden capture on the target, KV cell sizing, graph plumbing), and
swap what it builds:

* AROUND ``SpeculativeAlgorithm.create_worker``: DFLASH builds :class:`sglang_dflash.worker.DFlashWorker`.
* AROUND ``speculative_hook._handle_dflash``: the plugin validates the draft checkpoint against
  the target before SGLang's own DFLASH argument policy runs.
* AROUND ``speculative_hook._resolve_speculative_algorithm_alias``: that runs first and reads the
  draft's config through the hub client, so a mistyped local path would end in a hub traceback.
* ``ModelRegistry.models["DFlashDraftModel"]``: the plugin's draft network, set where the worker
  is created (the registry holds classes in a dict that hooks cannot reach).
* AROUND ``Req.update_finish_state``: SGLang checks ``max_new_tokens`` before stop tokens and
  stop strings, so when one verify step accepts several tokens and reaches the budget, a stop
  inside that step was ignored. The hook lets the earlier stop win, as plain decoding would.

``SGLANG_DFLASH_IMPL=builtin`` leaves SGLang's own DFLASH in place (only the log line is added),
so both can be measured side by side.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sglang_dflash")

IMPL_ENV = "SGLANG_DFLASH_IMPL"
# Opt-in, for correctness runs: SGLang's CUDA rmsnorm kernel has no float32 path, so
# ``--dtype float32`` servers (AR included) fail without it.
FP32_NORM_ENV = "SGLANG_DFLASH_FP32_NORM"
RMSNORM_CUDA = "sglang.srt.layers.layernorm.RMSNorm.forward_cuda"
GEMMA_RMSNORM_CUDA = "sglang.srt.layers.layernorm.GemmaRMSNorm.forward_cuda"  # Qwen3.5 / Qwen3-Next
# Its JIT kernel has no float32 build either, and a failed build is retried on every forward.
QKNORM_CHECK = "sglang.srt.models.utils.can_use_fused_inplace_qknorm"
IMPLEMENTATIONS = ("plugin", "builtin")
# Hook targets were read in these SGLang releases; anything else keeps the built-in.
SUPPORTED_SGLANG = ("0.5.17",)

CREATE_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
HANDLE_DFLASH_ARGS = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
RESOLVE_ALGORITHM = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
UPDATE_FINISH_STATE = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
DRAFT_ARCHITECTURE = "DFlashDraftModel"


def selected_implementation() -> str:
    impl = os.environ.get(IMPL_ENV, "plugin").strip().lower() or "plugin"
    if impl not in IMPLEMENTATIONS:
        raise SystemExit(f"sglang-dflash: {IMPL_ENV}={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return impl


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def register() -> None:
    """Entry point: installs the hooks (the registry applies them once all plugins have run)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    impl = selected_implementation()
    if os.environ.get(FP32_NORM_ENV) == "1":
        HookRegistry.register(RMSNORM_CUDA, fp32_rmsnorm_hook, HookType.AROUND)
        HookRegistry.register(GEMMA_RMSNORM_CUDA, fp32_rmsnorm_hook, HookType.AROUND)
        HookRegistry.register(QKNORM_CHECK, fp32_qknorm_hook, HookType.AROUND)
    found = sglang_version()
    if impl == "plugin" and found not in SUPPORTED_SGLANG:
        logger.warning(
            "sglang-dflash supports SGLang %s, found %s: DFLASH stays with the built-in implementation.",
            "/".join(SUPPORTED_SGLANG), found,
        )
        impl = "builtin"
    if impl == "plugin":
        HookRegistry.register(CREATE_WORKER, create_worker_hook, HookType.AROUND)
        HookRegistry.register(HANDLE_DFLASH_ARGS, handle_dflash_args_hook, HookType.AROUND)
        HookRegistry.register(RESOLVE_ALGORITHM, draft_path_hook, HookType.AROUND)
        HookRegistry.register(UPDATE_FINISH_STATE, stop_before_length_hook, HookType.AROUND)
    else:
        HookRegistry.register(HANDLE_DFLASH_ARGS, log_builtin_hook, HookType.AROUND)


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
    if not self.is_dflash():
        return original(self, server_args)
    install_draft_model()
    from .worker import DFlashWorker

    return DFlashWorker


def install_draft_model() -> None:
    """Point SGLang's registry entry for the published draft architecture at the plugin's model."""
    from sglang.srt.models.registry import ModelRegistry

    from .model import DFlashDraftModel

    ModelRegistry.models[DRAFT_ARCHITECTURE] = DFlashDraftModel


def log_builtin_hook(original, server_args):
    logger.info("DFLASH is served by SGLang's built-in implementation (%s=builtin).", IMPL_ENV)
    return original(server_args)


def draft_path_hook(original, algorithm, draft_path, *args, **kwargs):
    """A local draft path that is not a checkpoint: one line now, not a hub-client traceback."""
    from .config import is_hub_id

    if (algorithm or "").upper() == "DFLASH" and draft_path and not is_hub_id(draft_path):
        folder = os.path.expanduser(draft_path)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            what = "has no config.json" if os.path.exists(folder) else "does not exist"
            raise SystemExit(f"sglang-dflash: --speculative-draft-model-path: {draft_path!r} {what}")
    return original(algorithm, draft_path, *args, **kwargs)


def handle_dflash_args_hook(original, server_args):
    """Validate the draft checkpoint and the flags, then let SGLang apply its DFLASH defaults."""
    from .config import DFlashConfigError

    try:
        cfg = validate_server_args(server_args)
    except DFlashConfigError as e:
        # One line and a non-zero exit, before any process or GPU memory is set up.
        raise SystemExit(f"sglang-dflash: {e}") from None
    if server_args.speculative_num_draft_tokens is None and server_args.speculative_dflash_block_size is None:
        server_args.speculative_num_draft_tokens = cfg.block_size
    original(server_args)
    logger.info(
        "DFLASH is served by sglang-dflash (block_size=%d, draft=%s, target_layer_ids=%s).",
        server_args.speculative_num_draft_tokens, server_args.speculative_draft_model_path,
        list(cfg.target_layer_ids),
    )


def validate_server_args(server_args):
    """Every start-up check that needs only files and flags. Returns the resolved draft config."""
    from .config import DFlashConfigError, TargetInfo, load_and_validate, local_checkpoint

    if server_args.pp_size != 1:
        raise DFlashConfigError("--pp-size", f"DFLASH needs pp_size 1, got {server_args.pp_size}")
    if getattr(server_args, "enable_dp_attention", False):
        raise DFlashConfigError("--enable-dp-attention", "DFLASH does not support DP attention")
    if server_args.speculative_draft_model_path is None:
        raise DFlashConfigError("--speculative-draft-model-path", "required with --speculative-algorithm DFLASH")
    draft_path = local_checkpoint(server_args.speculative_draft_model_path, "--speculative-draft-model-path",
                                  getattr(server_args, "speculative_draft_model_revision", None))
    block = server_args.speculative_num_draft_tokens or server_args.speculative_dflash_block_size
    for flag, value in (("--speculative-num-draft-tokens", server_args.speculative_num_draft_tokens),
                        ("--speculative-dflash-block-size", server_args.speculative_dflash_block_size)):
        if value is not None and int(value) < 2:
            raise DFlashConfigError(flag, f"the block must hold the last token and >= 1 draft, got {value}")
    target_path = local_checkpoint(server_args.model_path, "--model-path", getattr(server_args, "revision", None))
    if not os.path.isfile(os.path.join(target_path, "config.json")):
        raise DFlashConfigError("--model-path", f"{target_path!r} has no config.json")
    target = TargetInfo.from_pretrained(target_path, context_length=server_args.context_length)
    config = load_and_validate(draft_path, target, block_size=block)
    window = getattr(server_args, "speculative_draft_window_size", None)
    if window is not None and not (isinstance(window, int) and window >= config.block_size):
        raise DFlashConfigError(
            "--speculative-draft-window-size",
            f"must be an integer >= the block size {config.block_size} (the draft sees at least one block), got {window!r}",
        )
    return config
