"""DFlash draft checkpoint parsing and start-up validation.

Reads z-lab DFlash checkpoints exactly as published (``config.json`` plus safetensors without
embedding or lm_head) and checks them against the target before any GPU memory is touched.
Every problem raises :class:`DFlashConfigError`, whose message names the offending field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

DRAFT_ARCHITECTURE = "DFlashDraftModel"

# The environment switches the plugin reads, all here (the README lists them).
IMPL_ENV = "SGLANG_DFLASH_IMPL"  # plugin (default) or builtin: SGLang's own DFLASH, for side by side
# For --dtype float32 servers (AR too): SGLang's CUDA rmsnorm and JIT q/k-norm have no float32 path.
FP32_NORM_ENV = "SGLANG_DFLASH_FP32_NORM"  # 1 = float32 norms take SGLang's torch implementation
FUSED_CONTEXT_KV_ENV = "SGLANG_DFLASH_FUSED_CONTEXT_KV"  # 0 = draft context K/V layer by layer (A/B runs)
# 0 = each step's draft context K/V written by eager launches after the accept, not inside the
# target's verify CUDA graphs (A/B runs).
CONTEXT_IN_GRAPH_ENV = "SGLANG_DFLASH_CONTEXT_IN_GRAPH"
# 0 = the scheduler's per-step KV reservation through SGLang's own DFlashDraftInputV2 code, not the
# plugin's, which fills the host lengths in bulk (draft_input.py; A/B runs).
BULK_PREPARE_ENV = "SGLANG_DFLASH_BULK_PREPARE"
# 0 = the DFLASH passes' attention on the Triton and FlashInfer backends through SGLang's own kernels,
# not the plugin's block kernel (ops/block_attention.py; A/B runs); all = behind a hybrid target's
# wrapper at every query tile too, not only those timed (block_attention_route.HYBRID_TILE_LIMIT).
BLOCK_ATTENTION_ENV = "SGLANG_DFLASH_BLOCK_ATTENTION"
# 0 = FlashInfer still plans its prefill wrapper before every replay of a DFLASH pass that the block
# kernel serves whole, though the kernel reads nothing the plan makes (A/B runs).
SKIP_UNUSED_PLANS_ENV = "SGLANG_DFLASH_SKIP_UNUSED_PLANS"
# 0 = the draft pass replayed through SGLang's graph runner (its host set-up, 0.5-1 ms a step), not
# the plugin's own CUDA graphs fed in place by the block set-up (draft_graph.py; A/B runs).
DRAFT_GRAPHS_ENV = "SGLANG_DFLASH_DRAFT_GRAPHS"
# 0 = a Triton pass the block kernel serves by the request table still goes through SGLang's
# forward_extend, which copies each layer's K/V into contiguous tensors the kernel never reads (A/B runs).
SKIP_KV_COPIES_ENV = "SGLANG_DFLASH_SKIP_KV_COPIES"
# 0 = the scheduler still copies each step's committed lengths to the host for a FlashInfer backend
# whose DFLASH replays go unplanned, though nothing of that backend reads them (A/B runs).
SKIP_HOST_LENGTHS_ENV = "SGLANG_DFLASH_SKIP_HOST_LENGTHS"
# 0 = SGLang's prefill CUDA graphs keep their smallest bucket of 4 tokens, so a prefill of one token
# (a radix-cache hit on the whole prompt) pads more than 2x and runs eagerly (compat; A/B runs).
ONE_TOKEN_PREFILL_GRAPH_ENV = "SGLANG_DFLASH_ONE_TOKEN_PREFILL_GRAPH"
# 0 = the target's verify logits cast to float32 inside every verify, as SGLang does, instead of only
# for the batches that read more than an argmax (sampling.HalfVerifyLogits; A/B runs).
HALF_VERIFY_LOGITS_ENV = "SGLANG_DFLASH_HALF_VERIFY_LOGITS"
# 0 = a hybrid target's width-1 step stays a 1-token verify whose recurrent state is committed from
# the verify's scratch, not a plain DECODE that advances the state in place (A/B runs).
HYBRID_DECODE_ENV = "SGLANG_DFLASH_HYBRID_DECODE"
# The verify widths a step may choose. Unset: B, B/2, ..., 1 (adaptive) wherever that serves, else
# the fixed block; "auto": adaptive or a start-up error saying why not; "fixed": the block alone; or
# a list holding B, e.g. "16,4,1". --speculative-num-draft-tokens fixes the block (set to "fixed"
# at launch). And how a width is chosen: "throughput" (the default), "awake" (the same, its
# buckets never sleeping: A/B runs), "cycle" (the next width every step, for lossless checks
# across switches), "cycle:N" (N steps a width, timed apart) or "hold:W" (width W every step: a
# width's loop timed against plain decoding's).
WIDTHS_ENV = "SGLANG_DFLASH_WIDTHS"
WIDTH_POLICY_ENV = "SGLANG_DFLASH_WIDTH_POLICY"
WIDTH_POLICIES = ("throughput", "awake", "cycle", "hold")
FALLBACK_ENV = "SGLANG_DFLASH_FALLBACK"
FALLBACK_MODES = ("on", "off", "force")
RAGGED_ENV = "SGLANG_DFLASH_RAGGED"
DRAFT_RING_ENV = "SGLANG_DFLASH_DRAFT_RING"
LEDGER_ENV = "SGLANG_DFLASH_LEDGER"
# The lm_head rows the draft's greedy head reads: "auto" (the default: the 32768 tokens served most
# often when the vocabulary holds at least twice as many), "full", or a row count.
DRAFT_VOCAB_ENV = "SGLANG_DFLASH_DRAFT_VOCAB"
DRAFT_VOCAB_AUTO_ROWS = 32768
IMPLEMENTATIONS = ("plugin", "builtin")


def selected_implementation() -> str:
    impl = os.environ.get(IMPL_ENV, "plugin").strip().lower() or "plugin"
    if impl not in IMPLEMENTATIONS:
        raise SystemExit(f"sglang-dflash: {IMPL_ENV}={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return impl


def fp32_norms() -> bool:
    return os.environ.get(FP32_NORM_ENV) == "1"


def fused_context_kv() -> bool:
    return os.environ.get(FUSED_CONTEXT_KV_ENV, "1") != "0"


def context_in_verify_graph() -> bool:
    return os.environ.get(CONTEXT_IN_GRAPH_ENV, "1") != "0"


def bulk_prepare() -> bool:
    return os.environ.get(BULK_PREPARE_ENV, "1") != "0"


def block_attention_kernel() -> bool:
    return os.environ.get(BLOCK_ATTENTION_ENV, "1") != "0"


def block_attention_every_tile() -> bool:
    return os.environ.get(BLOCK_ATTENTION_ENV, "1") == "all"


def skip_unused_plans() -> bool:
    return os.environ.get(SKIP_UNUSED_PLANS_ENV, "1") != "0"


def own_draft_graphs() -> bool:
    return os.environ.get(DRAFT_GRAPHS_ENV, "1") != "0"


def draft_attention_default(server_args, target_backend: Optional[str], tp_size: int, window_size,
                            draft: Optional["DFlashDraftConfig"], decode_graphs: bool = True) -> Optional[str]:
    """The draft's attention backend where the launch names none: "triton" on an FA3 target, whose
    drafts the plugin's own CUDA graphs then serve (SGLang would give the draft FA3, which they do
    not); None (SGLang's choice) where the launch names one or the graphs could not serve anyway
    (:func:`block_kernel_takes_draft`).
    Up to SGLang 0.5.18 the launch writes SGLang's own choice into ``server_args`` as if named, so
    there the draft keeps it; from 0.5.19 that choice is a declared resolution and the field stays
    what the user gave."""
    if getattr(server_args, "speculative_draft_attention_backend", None) or not own_draft_graphs():
        return None
    if not decode_graphs or tp_size > 1 or window_size is not None:
        return None
    if not block_kernel_takes_draft(server_args, draft):
        return None
    return "triton" if target_backend == "fa3" else None


def block_kernel_takes_draft(server_args, draft: Optional["DFlashDraftConfig"]) -> bool:
    """Whether the block kernel, which the plugin's draft graphs need for every attention call of the
    pass, would take the draft's on Triton: the kernel on (``SGLANG_DFLASH_BLOCK_ATTENTION``), pages
    of one token, the KV cache in the model's dtype (no fp8 scales), no sliding-window layer (the
    Qwen3.5-4B draft's) and a head size it serves. A draft not read yet says nothing against."""
    if not block_attention_kernel() or (getattr(server_args, "page_size", None) or 1) != 1:
        return False
    if getattr(server_args, "kv_cache_dtype", None) not in (None, "auto"):
        return False
    if draft is None:
        return True
    from .ops.block_attention import HEAD_DIMS

    return not draft.has_sliding_layers and draft.head_dim in HEAD_DIMS


def skip_kv_copies() -> bool:
    return os.environ.get(SKIP_KV_COPIES_ENV, "1") != "0"


def one_token_prefill_graph() -> bool:
    return os.environ.get(ONE_TOKEN_PREFILL_GRAPH_ENV, "1") != "0"


def skip_host_lengths() -> bool:
    return os.environ.get(SKIP_HOST_LENGTHS_ENV, "1") != "0"


def half_verify_logits() -> bool:
    return os.environ.get(HALF_VERIFY_LOGITS_ENV, "1") != "0"


def hybrid_decode() -> bool:
    return os.environ.get(HYBRID_DECODE_ENV, "1") != "0"


def verify_widths(block_size: int) -> tuple[int, ...]:
    """The widths a step may verify, widest first: every candidate width (adaptive) unless
    :data:`WIDTHS_ENV` names others; ``(block_size,)`` for ``fixed``."""
    text = os.environ.get(WIDTHS_ENV, "").strip().lower()
    if text == "fixed":
        return (block_size,)
    if text in ("", "auto"):
        from .adaptive import candidate_widths

        return candidate_widths(block_size)
    try:
        widths = {int(w) for w in text.split(",") if w.strip()}
    except ValueError:
        raise DFlashConfigError(WIDTHS_ENV, f"{text!r} is not 'auto', 'fixed' or a comma list of widths") from None
    if block_size not in widths or not all(1 <= w <= block_size for w in widths):
        raise DFlashConfigError(WIDTHS_ENV, f"{text!r}: widths lie in 1..{block_size} and include {block_size} "
                                            "(--speculative-num-draft-tokens)")
    return tuple(sorted(widths, reverse=True))


def widths_by_default() -> bool:
    """Nothing names the widths: adaptive gives way to the fixed block where it cannot serve,
    instead of stopping the server."""
    return not os.environ.get(WIDTHS_ENV, "").strip()


_widths_fixed_by_flag = False  # this process wrote WIDTHS_ENV for a block named by flag


def fix_block_named_by_flag(args) -> bool:
    """A block the user names (``--speculative-num-draft-tokens`` or ``--speculative-dflash-block-size``)
    is the one width, unless :data:`WIDTHS_ENV` says otherwise. Set in the launching process, which
    SGLang's scheduler processes inherit; a later server of the same process (an in-process
    ``Engine``) that names no block gets the default back. True if it fixed the block."""
    global _widths_fixed_by_flag
    if _widths_fixed_by_flag and os.environ.get(WIDTHS_ENV) == "fixed":
        del os.environ[WIDTHS_ENV]
    _widths_fixed_by_flag = False
    named = args.speculative_num_draft_tokens is not None or args.speculative_dflash_block_size is not None
    if named and widths_by_default():
        os.environ[WIDTHS_ENV] = "fixed"
        _widths_fixed_by_flag = True
        return True
    return False


def admissions_as_plain_decoding(args) -> dict:
    """The field to declare so new requests join a running batch as under plain decoding.

    SGLang holds a DFLASH server's new prefills until 2-4 running slots are free
    (``--min-free-slots-delay``, on by default for DFLASH), to batch admissions it takes to be
    expensive. Here an admission is the target's prefill plus the draft context projected from its
    hidden states, about what it costs plain decoding; held, the last requests of a full batch wait
    a whole generation for their first token (the 8B rig at c64: 2.3-2.8 s). A value the user sets
    wins."""
    if not hasattr(args, "min_free_slots_delay") or args.min_free_slots_delay is not None:
        return {}
    return {"min_free_slots_delay": 1}  # 1: SGLang's own "off"


def width_policy_kind() -> str:
    kind = os.environ.get(WIDTH_POLICY_ENV, "throughput").strip().lower() or "throughput"
    name, colon, hold = kind.partition(":")
    numbered = hold.isdigit() and int(hold) >= 1
    if name not in WIDTH_POLICIES or (colon and (name not in ("cycle", "hold") or not numbered)) \
            or (name == "hold" and not colon):
        raise DFlashConfigError(WIDTH_POLICY_ENV, f"{kind!r} is not one of throughput, awake, cycle, "
                                                  "cycle:N (N steps a width) or hold:W (width W every step)")
    return kind


def check_held_width(kind: str, widths: Sequence[int]) -> None:
    """``hold:W`` holds a width the step may verify: one of ``widths``."""
    name, _, width = kind.partition(":")
    if name == "hold" and int(width) not in widths:
        raise DFlashConfigError(WIDTH_POLICY_ENV, f"{kind!r}: width {width} is not one of the verify widths "
                                                  f"{', '.join(map(str, widths))}")


def draft_fallback(widths: tuple[int, ...]) -> str:
    """The per-request fallback (:class:`~sglang_dflash.fallback.DraftHealth`): ``on`` by default
    when width 1 is among the verify widths (a batch whose every request falls back must run a
    plain decode step), ``off``, or ``force`` (a fixed pattern of requests in and out of fallback,
    for lossless checks)."""
    mode = os.environ.get(FALLBACK_ENV, "").strip().lower()
    if mode and mode not in FALLBACK_MODES:
        raise DFlashConfigError(FALLBACK_ENV, f"{mode!r} is not one of {', '.join(FALLBACK_MODES)}")
    if mode in ("on", "force") and 1 not in widths:
        raise DFlashConfigError(FALLBACK_ENV, f"{mode!r} needs width 1 among the verify widths "
                                              f"({WIDTHS_ENV}=auto or a list holding 1)")
    return mode or ("on" if 1 in widths else "off")


def scheduler_ledger() -> bool:
    """A server without DFLASH times its scheduler's worker calls by mode, as the plugin's worker
    always does (``/get_server_info`` ``scheduler_ledger``): plain decoding's side of a profile."""
    return os.environ.get(LEDGER_ENV, "0").strip() == "1"


def draft_ring() -> bool:
    """Draft K/V bounded by ``--speculative-draft-window-size``: a ring of W + B slots per request
    (:class:`~sglang_dflash.draft.DraftRing`; opt-in until measured on a GPU)."""
    value = os.environ.get(DRAFT_RING_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise DFlashConfigError(DRAFT_RING_ENV, f"must be 0 or 1, got {value!r}")
    return value == "1"


def ragged_verify() -> bool:
    """Each request verifies its own width in one target forward, from SGLang's compact ragged
    verify graphs (fa3; experimental, off unless :data:`RAGGED_ENV` is 1)."""
    return os.environ.get(RAGGED_ENV, "0").strip() == "1"


def draft_vocab_rows(vocab_rows: int) -> Optional[int]:
    """How many lm_head rows the draft's greedy head reads (``None``: all of them), from
    :data:`DRAFT_VOCAB_ENV`. The draft only proposes, so a smaller head changes which tokens are
    proposed and never which are committed."""
    text = os.environ.get(DRAFT_VOCAB_ENV, "auto").strip().lower() or "auto"
    if text == "full":
        return None
    if text == "auto":
        return DRAFT_VOCAB_AUTO_ROWS if vocab_rows >= 2 * DRAFT_VOCAB_AUTO_ROWS else None
    try:
        rows = int(text)
    except ValueError:
        raise DFlashConfigError(DRAFT_VOCAB_ENV, f"{text!r} is not 'auto', 'full' or a row count") from None
    if rows < 16 or rows % 16:
        raise DFlashConfigError(DRAFT_VOCAB_ENV, f"{rows} rows: give a multiple of 16, at least 16")
    return rows if rows < vocab_rows else None


DEFAULT_BLOCK_SIZE = 16
LAYER_TYPES = ("full_attention", "sliding_attention")
# Buffers some HF exports carry along; they hold no trained weights.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


class DFlashConfigError(ValueError):
    """A draft checkpoint or flag that cannot serve; ``field`` names the culprit."""

    def __init__(self, field_name: str, problem: str, source: Optional[str] = None):
        self.field = field_name
        self.problem = problem
        self.source = source
        where = f" in {source}" if source else ""
        # A flag or switch is the user's own: name it alone; anything else lives in the draft checkpoint.
        users_own = field_name.startswith(("--", "SGLANG_")) and not source
        subject = "" if users_own else f"DFlash draft{where}: "
        super().__init__(f"{subject}{field_name}: {problem}")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Layers tapped when the checkpoint names none: evenly from 1 to n-3 (one draft layer: n//2)."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise DFlashConfigError(
            "target_layer_ids",
            f"cannot derive defaults from {num_target_layers} target / {num_draft_layers} draft layers",
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    if last < first:
        raise DFlashConfigError(
            "target_layer_ids",
            f"absent, and the default needs a target with >= 4 layers (it has {num_target_layers})",
        )
    step = (last - first) / (num_draft_layers - 1)
    return [int(round(first + i * step)) for i in range(num_draft_layers)]


def _positive_int(raw: Any, field_name: str, source: Optional[str], minimum: int = 1) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw:
        raise DFlashConfigError(field_name, f"must be an integer, got {raw!r}", source)
    if int(raw) < minimum:
        raise DFlashConfigError(field_name, f"must be >= {minimum}, got {int(raw)}", source)
    return int(raw)


@dataclass(frozen=True)
class DFlashDraftConfig:
    """The draft's own shape plus the DFlash fields (``block_size``, taps, mask id, layer types)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: Optional[tuple[int, ...]]  # None: derive from the target at validation
    mask_token_id: Optional[int]
    layer_types: tuple[str, ...]
    sliding_window: Optional[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: Optional[dict] = None
    max_position_embeddings: Optional[int] = None
    attention_bias: bool = False
    num_target_layers: Optional[int] = None
    vocab_size: Optional[int] = None
    source: Optional[str] = field(default=None, compare=False)

    @property
    def num_context_features(self) -> int:
        """K, the number of tapped target layers that ``fc`` concatenates (needs resolved taps)."""
        if self.target_layer_ids is None:
            raise DFlashConfigError("target_layer_ids", "not resolved yet; call resolve_for_target", self.source)
        return len(self.target_layer_ids)

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: Optional[str] = None) -> "DFlashDraftConfig":
        archs = raw.get("architectures") or []
        if DRAFT_ARCHITECTURE not in archs:
            raise DFlashConfigError(
                "architectures", f"expected [{DRAFT_ARCHITECTURE!r}], got {list(archs)!r}", source
            )
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, Mapping):
            raise DFlashConfigError("dflash_config", f"must be an object, got {type(dflash).__name__}", source)

        def need(key: str) -> int:
            if raw.get(key) is None:
                raise DFlashConfigError(key, "missing", source)
            return _positive_int(raw[key], key, source)

        hidden = need("hidden_size")
        layers = need("num_hidden_layers")
        heads = need("num_attention_heads")
        kv_heads = _positive_int(raw.get("num_key_value_heads", heads), "num_key_value_heads", source)
        head_dim = _positive_int(raw.get("head_dim") or hidden // heads, "head_dim", source)
        inter = need("intermediate_size")
        if raw.get("hidden_act", "silu") != "silu":
            raise DFlashConfigError("hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}", source)
        if heads % kv_heads:
            raise DFlashConfigError(
                "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}", source
            )

        # dflash_config.block_size wins over the legacy top-level key.
        raw_block = dflash.get("block_size", raw.get("block_size", DEFAULT_BLOCK_SIZE))
        block = _positive_int(raw_block, "block_size", source, minimum=2)

        taps = dflash.get("target_layer_ids")
        if taps is not None:
            if not isinstance(taps, Sequence) or isinstance(taps, str) or not taps:
                raise DFlashConfigError("target_layer_ids", f"must be a non-empty list, got {taps!r}", source)
            taps = tuple(_positive_int(t, f"target_layer_ids[{i}]", source, minimum=0) for i, t in enumerate(taps))

        mask_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask_id is not None:
            mask_id = _positive_int(mask_id, "mask_token_id", source, minimum=0)

        layer_types = raw.get("layer_types")
        if layer_types is None:
            layer_types = ("full_attention",) * layers
        layer_types = tuple(layer_types)
        if len(layer_types) != layers:
            raise DFlashConfigError(
                "layer_types", f"has {len(layer_types)} entries for {layers} draft layers", source
            )
        for i, kind in enumerate(layer_types):
            if kind not in LAYER_TYPES:
                raise DFlashConfigError(f"layer_types[{i}]", f"unknown layer type {kind!r}", source)
        window = raw.get("sliding_window")
        if "sliding_attention" in layer_types:
            if window is None:
                raise DFlashConfigError("sliding_window", "required by sliding_attention layers", source)
            window = _positive_int(window, "sliding_window", source)
        else:
            window = None

        num_target_layers = dflash.get("num_target_layers", raw.get("num_target_layers"))
        if num_target_layers is not None:
            num_target_layers = _positive_int(num_target_layers, "num_target_layers", source)
        rope_theta = raw.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it
            rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 1e6)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            block_size=block,
            target_layer_ids=taps,
            mask_token_id=mask_id,
            layer_types=layer_types,
            sliding_window=window,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=raw.get("max_position_embeddings"),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_target_layers=num_target_layers,
            vocab_size=raw.get("vocab_size"),
            source=source,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "DFlashDraftConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise DFlashConfigError("speculative_draft_model_path", f"{path!r} is not a directory")
        if not os.path.isfile(config_path):
            raise DFlashConfigError("config.json", "missing", path)
        try:
            with open(config_path) as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DFlashConfigError("config.json", f"not valid JSON ({e})", path) from None
        return cls.from_dict(raw, source=path)

    def resolve_for_target(self, target: "TargetInfo") -> "DFlashDraftConfig":
        """Check this draft against its target; returns a copy with the tap layers filled in."""
        src = self.source
        if self.hidden_size != target.hidden_size:
            raise DFlashConfigError(
                "hidden_size",
                f"draft has {self.hidden_size} but the target has {target.hidden_size}; "
                "the draft reuses the target's embedding and lm_head, so they must match",
                src,
            )
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise DFlashConfigError(
                "vocab_size", f"draft was built for {self.vocab_size} tokens, the target has {target.vocab_size}", src
            )
        taps = self.target_layer_ids
        if taps is None:
            taps = tuple(default_target_layer_ids(target.num_layers, self.num_hidden_layers))
        for i, layer in enumerate(taps):
            if layer >= target.num_layers:
                raise DFlashConfigError(
                    f"target_layer_ids[{i}]", f"layer {layer} is out of range for a {target.num_layers}-layer target", src
                )
        if self.mask_token_id is not None and self.mask_token_id >= target.vocab_size:
            raise DFlashConfigError(
                "mask_token_id",
                f"{self.mask_token_id} lies outside the target embedding (vocab_size {target.vocab_size})",
                src,
            )
        if target.context_length is not None and self.block_size > target.context_length:
            raise DFlashConfigError(
                "block_size", f"{self.block_size} exceeds the context length {target.context_length}", src
            )
        return replace(self, target_layer_ids=tuple(taps))

    def with_block_size(self, block_size: int) -> "DFlashDraftConfig":
        return replace(self, block_size=_positive_int(block_size, "block_size", self.source, minimum=2))


# Config keys of targets whose layers are not all attention (linear attention, Mamba, hybrids of them).
HYBRID_TARGET_KEYS = ("full_attention_interval", "linear_conv_kernel_dim", "linear_num_value_heads",
                      "mamba_d_state", "ssm_state_size", "hybrid_override_pattern", "attn_layer_indices")


@dataclass(frozen=True)
class TargetInfo:
    """What the draft must agree with, read from the target's ``config.json``."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    context_length: Optional[int] = None
    # Every layer attention (full or sliding window): a hybrid target (linear attention, Mamba) keeps
    # SGLang's prefill graph buckets, as a one-token capture has not been checked on its state kernels.
    attention_only: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], context_length: Optional[int] = None) -> "TargetInfo":
        text = raw.get("text_config") or raw  # multimodal targets (Qwen3.5) nest the language model
        kinds = set(text.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
        names = " ".join([*(raw.get("architectures") or ()), str(raw.get("model_type", ""))]).lower()
        return cls(
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            vocab_size=int(text.get("vocab_size", raw.get("vocab_size"))),
            context_length=context_length or text.get("max_position_embeddings"),
            attention_only=not kinds and not any(k in text for k in HYBRID_TARGET_KEYS) and "mamba" not in names,
        )

    @classmethod
    def from_pretrained(cls, path: str, context_length: Optional[int] = None) -> "TargetInfo":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f), context_length)


def expected_draft_tensors(cfg: DFlashDraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft checkpoint must hold (no embedding, no lm_head), with its shape."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_context_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            }
        )
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def canonical_tensor_name(name: str) -> str:
    """Published drafts store keys with or without a ``model.`` prefix; we use the bare form."""
    return name[len("model.") :] if name.startswith("model.") else name


def check_draft_tensors(cfg: DFlashDraftConfig, found: Mapping[str, Sequence[int]]) -> None:
    """Raise on missing, extra or misshapen tensors (``found`` maps checkpoint names to shapes).

    Names in the message are spelled as in the checkpoint (with its ``model.`` prefix, if it
    uses one), so a grep of the file finds them.
    """
    expected = expected_draft_tensors(cfg)
    as_stored = {canonical_tensor_name(k): k for k in found if not k.endswith(IGNORED_TENSOR_SUFFIXES)}
    have = {name: tuple(found[key]) for name, key in as_stored.items()}
    prefix = "model." if any(key.startswith("model.") for key in as_stored.values()) else ""
    missing = sorted(prefix + name for name in set(expected) - set(have))
    extra = sorted(as_stored[name] for name in set(have) - set(expected))
    if missing:
        raise DFlashConfigError("weights", f"missing tensors {_clip(missing)}", cfg.source)
    if extra:
        raise DFlashConfigError("weights", f"unexpected tensors {_clip(extra)}", cfg.source)
    for name, shape in expected.items():
        if have[name] != shape:
            raise DFlashConfigError(as_stored[name], f"has shape {list(have[name])}, expected {list(shape)}",
                                    cfg.source)


def _clip(names: list[str], n: int = 6) -> str:
    shown = ", ".join(names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}] ({len(names)} in all)"


def read_checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors headers, without loading any data."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise DFlashConfigError("weights", "no *.safetensors file", path)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        full = os.path.join(path, name)
        try:
            _check_safetensors_length(full)  # first: newer safetensors refuse a short file with a vaguer message
            with safe_open(full, framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except DFlashConfigError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise DFlashConfigError(name, f"unreadable safetensors file ({e})", path) from None
    return shapes


def _check_safetensors_length(path: str) -> None:
    """A truncated file keeps a valid header; compare the header's data span with the file size."""
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise DFlashConfigError(
            os.path.basename(path), f"truncated: header promises {8 + header_len + end} bytes, file has {size}",
            os.path.dirname(path),
        )


def is_hub_id(path: str) -> bool:
    """``org/name`` that is not a folder here: SGLang downloads those, so the checks must too."""
    return not os.path.exists(path) and path.count("/") == 1 and not path.startswith((".", "/", "~"))


def local_checkpoint(path: str, flag: str, revision: Optional[str] = None) -> str:
    """A folder to read ``config.json`` and safetensors from: the path itself, or the hub snapshot."""
    if not is_hub_id(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # offline, unknown repo, no access: all say the same to the user
        raise DFlashConfigError(flag, f"{path!r} is not a local folder and the hub has no copy ({type(e).__name__})") \
            from None


def load_and_validate(draft_path: str, target: TargetInfo, block_size: Optional[int] = None) -> DFlashDraftConfig:
    """Everything checked at server start: config fields, target agreement, and the tensors on disk."""
    cfg = DFlashDraftConfig.from_pretrained(draft_path)
    if block_size is not None:
        cfg = cfg.with_block_size(block_size)
    cfg = cfg.resolve_for_target(target)
    check_draft_tensors(cfg, read_checkpoint_shapes(draft_path))
    return cfg


def check_draft_folder(path: str, revision: Optional[str] = None) -> str:
    """The draft's folder, with a ``config.json`` that transformers can read; returns the folder.

    Runs before SGLang reads the draft through transformers, which would end a bad file in a
    traceback through the launcher.
    """
    flag = "--speculative-draft-model-path"
    folder = local_checkpoint(path, flag, revision)
    if not os.path.isdir(os.path.expanduser(folder)):
        raise DFlashConfigError(flag, f"{path!r} does not exist")
    config_path = os.path.join(os.path.expanduser(folder), "config.json")
    if not os.path.isfile(config_path):
        raise DFlashConfigError(flag, f"{path!r} has no config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashConfigError("config.json", f"not valid JSON ({e})", folder) from None
    if not isinstance(raw, dict):
        raise DFlashConfigError("config.json", f"must hold a JSON object, got {type(raw).__name__}", folder)
    if not raw.get("model_type"):
        raise DFlashConfigError(
            "model_type", "missing; transformers needs it to read the config (published DFlash drafts say \"qwen3\")",
            folder,
        )
    return folder


def read_draft_config(path: str, revision: Optional[str] = None) -> Optional[dict]:
    """The draft's ``config.json`` as a dict, or None where the folder cannot tell yet."""
    try:
        folder = local_checkpoint(path, "--speculative-draft-model-path", revision)
        with open(os.path.join(os.path.expanduser(folder), "config.json")) as f:
            raw = json.load(f)
        return raw if isinstance(raw, dict) else None
    except (OSError, ValueError, DFlashConfigError):
        return None


def read_draft_shape(path: str, revision: Optional[str] = None) -> Optional[DFlashDraftConfig]:
    """The draft's parsed config, or None where the folder cannot tell yet or it does not parse
    (the launch's validation names why)."""
    raw = read_draft_config(path, revision)
    try:
        return DFlashDraftConfig.from_dict(raw, source=path) if raw is not None else None
    except DFlashConfigError:
        return None


def builtin_serves(server_args, release) -> Optional[str]:
    """Why SGLang's built-in DFLASH, not the plugin, serves this server; None if the plugin does.

    The plugin never takes away what the built-in serves: a draft architecture or variant it does
    not implement, DP attention on releases whose built-in has it, or either role of a
    PD-disaggregated deployment.
    """
    view = release.resolving(server_args)
    path = getattr(view, "speculative_draft_model_path", None)
    raw = (read_draft_config(path, getattr(view, "speculative_draft_model_revision", None)) if path else None) or {}
    arch = (raw.get("architectures") or [None])[0]
    if arch in release.builtin_only_drafts():
        return f"the draft's architecture {arch} is implemented by the built-in only"
    variant = release.builtin_only_variant(raw)
    if variant is not None:
        return f"the draft uses {variant}, implemented by the built-in only"
    if release.has("builtin_dp_attention") and release.dp_attention(view):
        return "DP attention is served by the built-in only"
    role = release.pd_role(view)
    if role is not None:
        return f"PD disaggregation (--disaggregation-mode {role}) is served by the built-in only"
    return None


# Attention backends whose kernels exist for Blackwell (compute capability 10.x) only.
BLACKWELL_ONLY_BACKENDS = ("fa4", "trtllm_mha")
BACKEND_FLAGS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend",
                 "speculative_draft_attention_backend")


def gpu_capability() -> Optional[tuple[int, int]]:
    try:
        import torch

        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def check_attention_backends(args) -> None:
    """A Blackwell-only backend asked for on an older GPU fails here, in one line."""
    asked = [(f, getattr(args, f, None)) for f in BACKEND_FLAGS if getattr(args, f, None) in BLACKWELL_ONLY_BACKENDS]
    capability = gpu_capability() if asked else None
    if capability is not None and capability[0] < 10:
        field, backend = asked[0]
        raise DFlashConfigError("--" + field.replace("_", "-"), (
            f"{backend} runs on Blackwell GPUs (compute capability 10.x), this GPU is "
            f"{capability[0]}.{capability[1]}: use fa3, flashinfer or triton"))


def validate_server_args(server_args, release) -> tuple[DFlashDraftConfig, TargetInfo]:
    """Every start-up check that needs only files and flags. Returns the resolved draft config and
    what was read of the target."""
    args = release.resolving(server_args)
    if args.pp_size != 1:
        raise DFlashConfigError("--pp-size", f"DFLASH needs pp_size 1, got {args.pp_size}")
    if release.dp_attention(args):
        flag = "--attn-dp-size" if release.has("attn_dp_size") else "--enable-dp-attention"
        raise DFlashConfigError(flag, "sglang-dflash does not serve DFLASH with DP attention")
    if getattr(args, "enable_unified_memory", False):
        raise DFlashConfigError("--enable-unified-memory", "sglang-dflash writes draft KV by physical slot; "
                                "unified memory would need translated writes")
    if getattr(args, "mamba_radix_cache_strategy", None) == "extra_buffer_lazy":
        raise DFlashConfigError("--mamba-radix-cache-strategy", "extra_buffer_lazy is not served with DFLASH; "
                                "use extra_buffer")
    check_attention_backends(args)
    if args.speculative_draft_model_path is None:
        raise DFlashConfigError("--speculative-draft-model-path", "required with --speculative-algorithm DFLASH")
    draft_path = local_checkpoint(args.speculative_draft_model_path, "--speculative-draft-model-path",
                                  getattr(args, "speculative_draft_model_revision", None))
    block = args.speculative_num_draft_tokens or args.speculative_dflash_block_size
    for flag, value in (("--speculative-num-draft-tokens", args.speculative_num_draft_tokens),
                        ("--speculative-dflash-block-size", args.speculative_dflash_block_size)):
        if value is not None and int(value) < 2:
            raise DFlashConfigError(flag, f"the block must hold the last token and >= 1 draft, got {value}")
    target_path = local_checkpoint(args.model_path, "--model-path", getattr(args, "revision", None))
    if not os.path.isfile(os.path.join(target_path, "config.json")):
        raise DFlashConfigError("--model-path", f"{target_path!r} has no config.json")
    target = TargetInfo.from_pretrained(target_path, context_length=args.context_length)
    config = load_and_validate(draft_path, target, block_size=block)
    window = getattr(args, "speculative_draft_window_size", None)
    if window is not None and not (isinstance(window, int) and window >= config.block_size):
        raise DFlashConfigError(
            "--speculative-draft-window-size",
            f"must be an integer >= the block size {config.block_size} (the draft sees at least one block), "
            f"got {window!r}",
        )
    if draft_ring() and window is None:
        raise DFlashConfigError(DRAFT_RING_ENV, "bounds draft KV by the draft window: it needs "
                                                "--speculative-draft-window-size")
    # the experimental switches, checked before any process starts
    check_held_width(width_policy_kind(), verify_widths(config.block_size))
    from .gdn_state import keeps_state_in_snapshots

    keeps_state_in_snapshots()
    return config, target
