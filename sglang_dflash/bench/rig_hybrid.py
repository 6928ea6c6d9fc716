"""Hybrid rigs: Qwen3.5-4B, Qwen3.5-27B and Qwen3.6-35B-A3B (gated delta net, 3 linear-attention
layers to 1 gated full-attention layer; the 35B-A3B a mixture of experts) with their DFlash drafts,
written as sparse safetensors like the dense rig (``rig.py``).

Targets are written as the published checkpoints name their text weights
(``Qwen3_5[Moe]ForConditionalGeneration``: ``model.language_model.*`` and ``lm_head``), with
``language_model_only`` set so SGLang 0.5.23 builds no vision tower and loads no processor; the
vision weights (about 0.9 GB at these sizes, never read by text requests) are left out.
``layout="text"`` writes the text-only classes (``Qwen3_5[Moe]ForCausalLM``, ``model.*``)
instead, for releases without ``language_model_only`` (0.5.17).

Zero weights keep the dense rig's property: every logit ties, the target and the draft both pick
token 0, every draft is accepted. For the MoE that has a cost: every decode token is the same
token at a layer stack that mixes nothing, so every router sees the same input and picks the same
``k`` experts, whatever the router weights (``zero_rig_hidden`` below). The spread real text has
comes from SGLang's benchmark switch ``SGLANG_SIMULATE_UNIFORM_EXPERTS`` (0.5.17 and 0.5.23),
which :func:`server_env` sets: each token a uniform random first expert and the rest ``E/k``
apart, weights ``1/k``. Expert outputs are zero either way, so the tokens, and the acceptance,
stay as they are. :func:`verify_step_experts` counts the experts a verify step reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..config import DFlashDraftConfig, expected_draft_tensors

LINEAR, FULL, SLIDING = "linear_attention", "full_attention", "sliding_attention"
ROUTING_ENV = "SGLANG_SIMULATE_UNIFORM_EXPERTS"


@dataclass(frozen=True)
class DraftShape:
    """A DFlash draft in z-lab's layout (Qwen3 decoder layers over fc(tapped target layers))."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    sliding_layers: int = 0  # the first N layers slide (z-lab: [S, ..., S, F])
    sliding_window: Optional[int] = None
    rope_theta: float = 1e7

    @property
    def layer_types(self) -> list[str]:
        return [SLIDING] * self.sliding_layers + [FULL] * (self.layers - self.sliding_layers)


@dataclass(frozen=True)
class HybridShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    linear_value_heads: int
    draft: DraftShape
    tie_embeddings: bool
    intermediate: int = 0  # dense FFN; 0 for the MoE
    experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    head_dim: int = 256
    linear_key_heads: int = 16
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    conv_kernel: int = 4
    full_interval: int = 4
    vocab: int = 248320
    rope_theta: float = 1e7
    partial_rotary: float = 0.25
    max_position: int = 262144
    eos: int = 248044
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def layer_types(self) -> list[str]:
        return [FULL if (i + 1) % self.full_interval == 0 else LINEAR for i in range(self.layers)]


# Where each shape comes from. "found": a config.json (or its transcription) was read; "derived":
# no config.json was found and the shape is worked out as the note says.
SHAPES = {
    "qwen3.5-4b": HybridShape(
        hidden=2560, layers=32, heads=16, kv_heads=4, linear_value_heads=32, intermediate=9216, tie_embeddings=True,
        # 6 layers, 5 sliding: the 35B-A3B draft's layout; 6 layers and 8 taps at 4B's width give
        # 1.269e9 bytes = 1.18 GiB, the size a public MLX port lists for z-lab/Qwen3.5-4B-DFlash.
        draft=DraftShape(layers=6, heads=32, kv_heads=8, head_dim=128, intermediate=9216,
                         target_layer_ids=(1, 5, 9, 13, 17, 21, 25, 29), mask_token_id=248070,
                         sliding_layers=5, sliding_window=4096),
        sources={
            "target": "found: THUDM/slime pull 1721 (scripts/models/qwen3.5-4B.sh, 'checked against the "
                      "HuggingFace Qwen3.5-4B config': 32 layers, hidden 2560, 16/4 heads of 256, FFN 9216, "
                      "vocab 248320, rope 1e7, rotary 0.25); linear heads 16 QK / 32 V of 128 from Qwen3.5-4B "
                      "text_config test fixtures in public repositories; tied embeddings from sgl-project/SpecForge "
                      "configs/qwen3.5-4b-vl-dflash.json@1827372 (tie_word_embeddings true, 32 target layers)",
            "draft": "derived: no config.json found. z-lab layout of z-lab/Qwen3.6-35B-A3B-DFlash (6 layers, "
                     "5 sliding_attention + 1 full, 32/8 heads of 128, 8 taps by the default rule); the seed "
                     "card says the 4B draft is a sliding-window one; a public MLX port lists the draft at "
                     "1.18 GiB, which this layout gives exactly (5 layers would give 0.97 GiB); the window "
                     "4096 is the 35B-A3B draft's; mask 248070 (z-lab/dflash#73, hipfire's "
                     "z-lab/Qwen3.5-*-DFlash metadata)",
        },
    ),
    "qwen3.5-27b": HybridShape(
        hidden=5120, layers=64, heads=24, kv_heads=4, linear_value_heads=48, intermediate=17408, tie_embeddings=False,
        draft=DraftShape(layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=17408,
                         target_layer_ids=(1, 16, 31, 46, 61), mask_token_id=248070),
        sources={
            "target": "found: a public report quoting Qwen/Qwen3.6-27B's config.json (text_config: 64 layers, "
                      "hidden 5120, FFN 17408, 24/4 heads of 256, linear 16 QK / 48 V of 128, kernel 4, "
                      "untied, vocab 248320), the same architecture as Qwen3.5-27B per THUDM/slime "
                      "scripts/models/qwen3.5-27B.sh and the seed card (64 layers, 5120, 17408, 24/4, 256)",
            "draft": "derived: no config.json of z-lab/Qwen3.5-27B-DFlash found. z-lab's Qwen3.6-27B-DFlash "
                     "(dflash_reference.md, SpecForge mirror: 5 layers, 32/8 heads of 128, FFN 17408, taps "
                     "[1,16,31,46,61]) with every layer full attention, as the 3.5 drafter is "
                     "(spiritbuun/Qwen3.6-27B-DFlash-GGUF card); 1.73e9 parameters against the card's 2B. "
                     "SpecForge's own recipe configs/qwen3.5-27b-dflash.json@95d22a7 (24/4 heads of 256, taps "
                     "[3,15,31,47,59], no mask id) is a training template, not the published draft",
        },
    ),
    "qwen3.6-35b-a3b": HybridShape(
        hidden=2048, layers=40, heads=16, kv_heads=2, linear_value_heads=32, tie_embeddings=False,
        experts=256, experts_per_tok=8, moe_intermediate=512, shared_intermediate=512,
        draft=DraftShape(layers=6, heads=32, kv_heads=8, head_dim=128, intermediate=6144,
                         target_layer_ids=(1, 6, 11, 16, 22, 27, 32, 37), mask_token_id=248077,
                         sliding_layers=5, sliding_window=4096),
        sources={
            "target": "found: a public Qwen3.6-35B-A3B converter that checks the checkpoint's config.json "
                      "(surogate serve tools/convert/qwen3_6_35b_a3b/convert.py, found by content search, its "
                      "repository unnamed by the index: Qwen3_5MoeForConditionalGeneration, "
                      "40 layers, hidden 2048, 16/2 heads of 256, linear 16 QK / 32 V of 128, 256 experts, "
                      "top 8, expert FFN 512, shared 512, untied), agreeing with the model card",
            "draft": "found: the same converter's check of the DFlash config.json it reads beside the model "
                     "(Qwen3.6-35B-A3B/dflash-bf16; 6 layers: 5 "
                     "sliding_attention window 4096 + 1 full, 32/8 heads of 128, FFN 6144, taps "
                     "[1,6,11,16,22,27,32,37], mask 248077, block 16, rope 1e7). 0.39e9 parameters; the card "
                     "rounds to 0.5B",
        },
    ),
}


# ---------------------------------------------------------------------------------------------
# Target


def text_config(s: HybridShape) -> dict:
    """The real config's text_config (the keys SGLang and transformers read)."""
    cfg = {
        "model_type": "qwen3_5_moe_text" if s.moe else "qwen3_5_text",
        "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab,
        "layer_types": s.layer_types, "full_attention_interval": s.full_interval,
        "linear_num_key_heads": s.linear_key_heads, "linear_num_value_heads": s.linear_value_heads,
        "linear_key_head_dim": s.linear_key_dim, "linear_value_head_dim": s.linear_value_dim,
        "linear_conv_kernel_dim": s.conv_kernel, "attn_output_gate": True, "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": s.max_position, "partial_rotary_factor": s.partial_rotary,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": s.partial_rotary,
                            "rope_theta": s.rope_theta, "rope_type": "default"},
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "tie_word_embeddings": s.tie_embeddings,
        "bos_token_id": s.eos, "eos_token_id": s.eos, "dtype": "bfloat16", "use_cache": True,
    }
    if s.moe:
        cfg.update(num_experts=s.experts, num_experts_per_tok=s.experts_per_tok, moe_intermediate_size=s.moe_intermediate,
                   shared_expert_intermediate_size=s.shared_intermediate, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False)
    else:
        cfg["intermediate_size"] = s.intermediate
    return cfg


def target_config(s: HybridShape, layout: str = "multimodal") -> dict:
    text = text_config(s)
    if layout == "text":
        return {"architectures": ["Qwen3_5MoeForCausalLM" if s.moe else "Qwen3_5ForCausalLM"], **text}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if s.moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if s.moe else "qwen3_5",
        # No vision tower, no processor: token-id requests only (SGLang >= 0.5.22 reads this).
        "language_model_only": True,
        "text_config": text, "tie_word_embeddings": s.tie_embeddings,
        "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
    }


def target_tensors(s: HybridShape, layout: str = "multimodal") -> dict[str, tuple[int, ...]]:
    """The text weights as the published checkpoints name them (transformers' state dict)."""
    base = "model.language_model." if layout == "multimodal" else "model."
    h, hd = s.hidden, s.head_dim
    key, value = s.linear_key_heads * s.linear_key_dim, s.linear_value_heads * s.linear_value_dim
    conv = 2 * key + value  # q, k and v go through the short convolution together
    out = {base + "embed_tokens.weight": (s.vocab, h)}
    for i, kind in enumerate(s.layer_types):
        p = f"{base}layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if kind == FULL:
            a = p + "self_attn."
            out.update({
                a + "q_proj.weight": (2 * s.heads * hd, h),  # queries and the output gate
                a + "k_proj.weight": (s.kv_heads * hd, h), a + "v_proj.weight": (s.kv_heads * hd, h),
                a + "o_proj.weight": (h, s.heads * hd), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
            })
        else:
            a = p + "linear_attn."
            out.update({
                a + "in_proj_qkv.weight": (conv, h), a + "in_proj_z.weight": (value, h),
                a + "in_proj_b.weight": (s.linear_value_heads, h), a + "in_proj_a.weight": (s.linear_value_heads, h),
                a + "conv1d.weight": (conv, 1, s.conv_kernel), a + "dt_bias": (s.linear_value_heads,),
                a + "A_log": (s.linear_value_heads,), a + "norm.weight": (s.linear_value_dim,),
                a + "out_proj.weight": (h, value),
            })
        m = p + "mlp."
        if s.moe:
            e, inter, shared = s.experts, s.moe_intermediate, s.shared_intermediate
            out.update({
                m + "gate.weight": (e, h),
                # fused expert tensors, as transformers 5 saves them; SGLang loads these and per-expert names alike
                m + "experts.gate_up_proj": (e, 2 * inter, h), m + "experts.down_proj": (e, h, inter),
                m + "shared_expert.gate_proj.weight": (shared, h), m + "shared_expert.up_proj.weight": (shared, h),
                m + "shared_expert.down_proj.weight": (h, shared), m + "shared_expert_gate.weight": (1, h),
            })
        else:
            out.update({m + "gate_proj.weight": (s.intermediate, h), m + "up_proj.weight": (s.intermediate, h),
                        m + "down_proj.weight": (h, s.intermediate)})
    out[base + "norm.weight"] = (h,)
    if not s.tie_embeddings:
        out["lm_head.weight"] = (s.vocab, h)
    return out


# ---------------------------------------------------------------------------------------------
# Draft


def draft_config(s: HybridShape, block_size: int) -> dict:
    d = s.draft
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": s.hidden,
        "num_hidden_layers": d.layers, "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim, "intermediate_size": d.intermediate, "vocab_size": s.vocab,
        "rms_norm_eps": 1e-6, "rope_theta": d.rope_theta, "rope_scaling": None, "max_position_embeddings": s.max_position,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "dtype": "bfloat16",
        "num_target_layers": s.layers, "block_size": block_size, "eos_token_id": s.eos, "layer_types": d.layer_types,
        "dflash_config": {"target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id,
                          "block_size": block_size},
    }
    if d.sliding_layers:
        # transformers' Qwen3Config keeps a window only with use_sliding_window set
        cfg.update(sliding_window=d.sliding_window, use_sliding_window=True, max_window_layers=d.layers)
    return cfg


def draft_tensors(s: HybridShape, block_size: int = 16) -> dict[str, tuple[int, ...]]:
    return expected_draft_tensors(DFlashDraftConfig.from_dict(draft_config(s, block_size)))


# ---------------------------------------------------------------------------------------------
# Bytes and routing


def tensor_bytes(tensors: dict[str, tuple[int, ...]], itemsize: int = 2) -> int:
    return sum(itemsize * math.prod(shape) for shape in tensors.values())


def expert_bytes(s: HybridShape, itemsize: int = 2) -> int:
    """One routed expert of one layer (gate, up and down)."""
    return 3 * s.hidden * s.moe_intermediate * itemsize if s.moe else 0


def step_bytes(s: HybridShape, tokens: int, distinct_experts: Optional[float] = None) -> int:
    """Weight bytes one target forward over ``tokens`` tokens reads: every dense weight, the
    lm_head, the embedding rows of its tokens, and per MoE layer the experts its tokens pick
    (``distinct_experts`` a layer; default: a plain step's ``k`` for one token)."""
    t = target_tensors(s)
    total = tensor_bytes(t)
    embed = 2 * s.vocab * s.hidden
    if not s.tie_embeddings:
        total -= embed  # a table apart: only the tokens' rows are read
    total += 2 * s.hidden * tokens
    if s.moe:
        experts = distinct_experts if distinct_experts is not None else min(s.experts, s.experts_per_tok * tokens)
        total -= s.layers * s.experts * expert_bytes(s)
        total += int(s.layers * experts * expert_bytes(s))
    return total


def router_topk(router, hidden, k: int):
    """Top-k expert ids per token (rows of ``hidden``) under a router weight [experts, hidden]."""
    return (hidden.float() @ router.float().t()).topk(k, dim=-1).indices


def zero_rig_hidden(s: HybridShape, tokens: int):
    """What every router of the zero-weight target sees at decode: the same vector for every token
    (one token id, nothing mixed in), here a random one; its logits tie no matter the router."""
    import torch

    return torch.randn(1, s.hidden, generator=torch.Generator().manual_seed(1)).expand(tokens, -1)


def simulated_topk(s: HybridShape, tokens: int, seed: int = 0):
    """SGLang's SGLANG_SIMULATE_UNIFORM_EXPERTS rule: a uniform first expert per token, the other
    k-1 spaced E/k after it (topk.py, 0.5.17 and 0.5.23)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, s.experts, (tokens, 1), generator=g)
    step = max(s.experts // s.experts_per_tok, 1)
    return (first + torch.arange(s.experts_per_tok) * step) % s.experts


def verify_step_experts(s: HybridShape, batch: int, block: int, routing: str = "simulated", seed: int = 0) -> float:
    """Distinct experts a layer reads in one verify step of ``batch`` requests x ``block`` tokens,
    averaged over 8 draws (CPU):

    * ``simulated``: the zero rig served with :func:`server_env`;
    * ``router``: a random router over random hidden states: what a routing spread as real
      text's gives (and the random-weight rig, whose tokens differ);
    * ``zero``: the zero rig without the switch: every token the same input, so ``k`` experts."""
    import torch

    if not s.moe:
        return 0.0
    tokens, counts = batch * block, []
    for draw in range(8):
        g = torch.Generator().manual_seed(seed * 1000 + draw)
        if routing == "simulated":
            ids = simulated_topk(s, tokens, seed * 1000 + draw)
        else:
            router = torch.randn(s.experts, s.hidden, generator=g)
            hidden = zero_rig_hidden(s, tokens) if routing == "zero" else torch.randn(tokens, s.hidden, generator=g)
            ids = router_topk(router, hidden, s.experts_per_tok)
        counts.append(len(torch.unique(ids)))
    return sum(counts) / len(counts)


def server_env(shape: str, weights: Optional[str]) -> dict:
    """Environment for every server on a rig (target and AR alike): the MoE zero rig routes as
    text would (module docstring); the random rig's tokens differ, so its router spreads alone."""
    s = SHAPES.get(shape)
    return {ROUTING_ENV: "1"} if s is not None and s.moe and weights == "zero" else {}


# Recurrent-state slots SGLang 0.5.23 keeps a running request under ``--mamba-radix-cache-strategy
# extra_buffer`` with the overlap scheduler (``_calculate_mamba_ratio`` in kv_cache_configurator.py).
STATE_SLOTS_PER_REQUEST = 5


def state_bytes_per_request(s: HybridShape) -> int:
    """One request's recurrent state in SGLang's ``MambaPool``: each linear layer's convolution
    window (bf16) and SSM state (float32, the checkpoints' ``mamba_ssm_dtype``)."""
    linear = s.layer_types.count(LINEAR)
    conv = (2 * s.linear_key_heads * s.linear_key_dim + s.linear_value_heads * s.linear_value_dim) * (s.conv_kernel - 1) * 2
    ssm = s.linear_value_heads * s.linear_value_dim * s.linear_key_dim * 4
    return linear * (conv + ssm)


def state_pool(shape: str, running: int, block_size: Optional[int] = None) -> tuple[list[str], int]:
    """Flags that size a rig server's recurrent-state pool for ``running`` requests, and the bytes
    SGLang then takes for it inside ``--mem-fraction-static``: the slots, and on a speculative
    server (``block_size``) a snapshot per draft token for each request's verify.

    Left to itself SGLang gives the state 0.9/1.9 of what the fraction leaves after the weights and
    splits that between slots and snapshots: at the Qwen3.5-4B shape a state is 49 MiB and a block-16
    verify's snapshots 786 MiB a request, so by 0.5.23's rule a 4 GiB pool runs one DFLASH request at a time."""
    s = SHAPES.get(shape)
    if s is None:
        return [], 0
    per_request = state_bytes_per_request(s)
    slots = STATE_SLOTS_PER_REQUEST * running
    total = (slots + 1) * per_request  # SGLang adds a padding slot
    if block_size:
        total += (running + 1) * block_size * per_request
    return ["--max-running-requests", str(running), "--max-mamba-cache-size", str(slots)], total


def state_pool_for(shape: str, server_args: list[str], running: int,
                   block_size: Optional[int] = None) -> tuple[list[str], int]:
    """:func:`state_pool` for a server with ``server_args``: nothing where they size the pool
    already (``--max-mamba-cache-size``), their ``--max-running-requests`` where they set it."""
    if shape not in SHAPES or "--max-mamba-cache-size" in server_args:
        return [], 0
    capped = "--max-running-requests" in server_args
    if capped:
        running = int(server_args[server_args.index("--max-running-requests") + 1])
    flags, total = state_pool(shape, running, block_size)
    return (flags[2:] if capped else flags), total


def fp8_bytes(tensors: dict[str, tuple[int, ...]]) -> int:
    """Weight bytes under ``--quantization fp8`` (an estimate): projections and experts at one
    byte, the embedding, lm_head, routers, convolutions and norms as they are."""
    kept = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")
    return sum(math.prod(shape) * (2 if len(shape) < 2 or name.endswith(kept) else 1)
               for name, shape in tensors.items())


def memory_report(shape: str, block_size: int = 16) -> dict:
    """Weight bytes of the rig's two checkpoints, so a runner can tell which servers fit a GPU
    (an H200 holds 141 GB; each server also needs KV, recurrent state and CUDA graphs). A plain
    server holds the target; a DFLASH server the target and the draft."""
    s = SHAPES[shape]
    t, d = target_tensors(s), draft_tensors(s, block_size)
    target, draft = tensor_bytes(t), tensor_bytes(d)
    return {"target_gb": round(target / 1e9, 2), "draft_gb": round(draft / 1e9, 2),
            "plugin_server_gb": round((target + draft) / 1e9, 2),
            "two_servers_gb": round((2 * target + draft) / 1e9, 2),  # plain decoding beside one DFLASH server
            "fp8_target_gb": round(fp8_bytes(t) / 1e9, 2)}
