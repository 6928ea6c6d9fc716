"""Real-shape target and draft checkpoints with no download: timing at scale on any machine.

``write_rig`` writes a Qwen3-shaped target (HF layout) and a DFlash draft (z-lab layout) whose
safetensors are *sparse*: the header is real and the tensor bytes are a hole, which reads as
zeros. A 16 GB Qwen3-8B appears in milliseconds and takes no disk.

* ``zero`` weights: every logit ties, target and draft both pick token 0, every drafted token is
  accepted (tau = block size): the all-accept ceiling.
* ``random`` weights (the servers load with ``--load-format dummy``): drafts are almost never
  accepted (tau ~ 1): the pure cost of speculating.

Requests are token ids (``--skip-tokenizer-init``; no tokenizer is written) with ``ignore_eos``.
:func:`floor_ratio` is the bytes a DFLASH step must read at concurrency 1 over a plain step's.

Besides the dense Qwen3 shapes here, ``rig_hybrid`` holds the hybrid targets the published
Qwen3.5/3.6 drafts are for (``qwen3.5-4b``, ``qwen3.5-27b``, ``qwen3.6-35b-a3b``).
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
from dataclasses import dataclass

from ..config import DFlashDraftConfig, default_target_layer_ids, expected_draft_tensors
from . import rig_hybrid

MODES = ("zero", "random")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 151936
    head_dim: int = 128
    tie_embeddings: bool = False
    mask_token_id: int = 151669  # the published Qwen3 drafts' mask row


SHAPES = {
    "qwen3-8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12288),
    "qwen3-32b": Shape(hidden=5120, layers=64, heads=64, kv_heads=8, intermediate=25600),
    "qwen3-4b": Shape(hidden=2560, layers=36, heads=32, kv_heads=8, intermediate=9728, tie_embeddings=True),
}
DRAFT_LAYERS = 5
HYBRID_SHAPES = rig_hybrid.SHAPES
LAYOUTS = ("multimodal", "text")


def all_shapes() -> list[str]:
    return sorted(SHAPES) + sorted(HYBRID_SHAPES)


def vocab(shape: str) -> int:
    return (HYBRID_SHAPES[shape] if shape in HYBRID_SHAPES else SHAPES[shape]).vocab


def target_tensors(s: Shape) -> dict[str, tuple[int, ...]]:
    """Qwen3ForCausalLM's tensors, as HF names them."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {"model.embed_tokens.weight": (s.vocab, s.hidden), "model.norm.weight": (s.hidden,)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (s.hidden,), p + "post_attention_layernorm.weight": (s.hidden,),
            p + "self_attn.q_proj.weight": (q, s.hidden), p + "self_attn.k_proj.weight": (kv, s.hidden),
            p + "self_attn.v_proj.weight": (kv, s.hidden), p + "self_attn.o_proj.weight": (s.hidden, q),
            p + "self_attn.q_norm.weight": (s.head_dim,), p + "self_attn.k_norm.weight": (s.head_dim,),
            p + "mlp.gate_proj.weight": (s.intermediate, s.hidden), p + "mlp.up_proj.weight": (s.intermediate, s.hidden),
            p + "mlp.down_proj.weight": (s.hidden, s.intermediate),
        })
    if not s.tie_embeddings:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


def target_config(s: Shape) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.intermediate, "vocab_size": s.vocab,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "tie_word_embeddings": s.tie_embeddings, "attention_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    }


def draft_config(s: Shape, block_size: int, layers: int = DRAFT_LAYERS) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": s.hidden,
        "num_hidden_layers": layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.intermediate, "vocab_size": s.vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_target_layers": s.layers,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": default_target_layer_ids(s.layers, layers),
                          "mask_token_id": s.mask_token_id, "block_size": block_size},
    }


def draft_tensors(s: Shape, block_size: int, layers: int = DRAFT_LAYERS) -> dict[str, tuple[int, ...]]:
    return expected_draft_tensors(DFlashDraftConfig.from_dict(draft_config(s, block_size, layers)))


def write_sparse_safetensors(path: str, tensors: dict[str, tuple[int, ...]], dtype: str = "BF16") -> int:
    """A valid safetensors file whose data is a hole (zeros); returns its size in bytes."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors.items():
        n = itemsize * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return 8 + len(blob) + offset


def write_rig(out_dir: str, shape: str = "qwen3-8b", block_size: int = 16,
              layout: str = "multimodal") -> tuple[str, str]:
    """``out_dir/target`` and ``out_dir/draft``; returns their paths. Rewrites nothing already there
    but the configs. ``layout`` names a hybrid target's classes (``rig_hybrid``)."""
    if shape in HYBRID_SHAPES:
        h = HYBRID_SHAPES[shape]
        parts = (("target", rig_hybrid.target_config(h, layout), rig_hybrid.target_tensors(h, layout)),
                 ("draft", rig_hybrid.draft_config(h, block_size), rig_hybrid.draft_tensors(h, block_size)))
    else:
        s = SHAPES[shape]
        parts = (("target", target_config(s), target_tensors(s)),
                 ("draft", draft_config(s, block_size), draft_tensors(s, block_size)))
    paths = []
    for name, config, tensors in parts:
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        if shape in HYBRID_SHAPES:
            if read_shapes(folder) != tensors:  # absent, or another layout: a hole costs nothing to rewrite
                write_sharded(folder, tensors)
        elif not os.path.exists(os.path.join(folder, "model.safetensors")):
            write_sparse_safetensors(os.path.join(folder, "model.safetensors"), tensors)
        paths.append(folder)
    return paths[0], paths[1]


SHARD_BYTES = 5 * 10**9  # as published checkpoints shard: one 50-70 GB file is mapped whole by some loaders


def write_sharded(folder: str, tensors: dict[str, tuple[int, ...]], shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Sparse shards of at most ``shard_bytes`` (a bigger tensor alone in one) and the index that
    names each tensor's shard; earlier shards in ``folder`` are removed."""
    for old in os.listdir(folder):
        if old.endswith(".safetensors") or old == "model.safetensors.index.json":
            os.remove(os.path.join(folder, old))
    shards, size = [{}], 0
    for name, shape in tensors.items():
        n = 2 * math.prod(shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += n
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        write_sparse_safetensors(os.path.join(folder, file), shard)
        weight_map.update(dict.fromkeys(shard, file))
        files.append(file)
    if len(shards) > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": tensor_bytes(tensors)}, "weight_map": weight_map}, f, indent=1)
    return files


def read_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes from the headers of every safetensors file in ``folder`` (nothing mapped)."""
    out = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        try:
            with open(os.path.join(folder, file), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return {}
        header.pop("__metadata__", None)
        out.update({k: tuple(v["shape"]) for k, v in header.items()})
    return out


def tensor_bytes(tensors: dict[str, tuple[int, ...]], itemsize: int = 2) -> int:
    return sum(itemsize * math.prod(shape) for shape in tensors.values())


def floor_ratio(shape: str, block_size: int = 16) -> dict:
    """Weight bytes a DFLASH step reads at concurrency 1 (target once, draft once, the target's
    lm_head again for the drafted positions) over a plain step's (target once)."""
    if shape in HYBRID_SHAPES:
        return hybrid_floor_ratio(shape, block_size)
    s = SHAPES[shape]
    lm_head = s.vocab * s.hidden * 2
    # A step reads the whole lm_head but only its tokens' embedding rows (untied: a table apart).
    target = tensor_bytes(target_tensors(s)) - (0 if s.tie_embeddings else lm_head)
    draft = tensor_bytes(draft_tensors(s, block_size))
    return {"target_gb": target / 1e9, "draft_gb": draft / 1e9, "lm_head_gb": lm_head / 1e9,
            "floor_ratio_c1": (target + draft + lm_head) / target}


def hybrid_floor_ratio(shape: str, block_size: int = 16) -> dict:
    """As :func:`floor_ratio`; a MoE verify reads the experts its ``block_size`` tokens pick, by
    expectation ``E (1 - (1 - k/E)^B)`` a layer when picks spread (the rig's routing switch),
    against a plain step's ``k``."""
    h = HYBRID_SHAPES[shape]
    lm_head = h.vocab * h.hidden * 2
    plain = rig_hybrid.step_bytes(h, 1)
    experts = h.experts * (1 - (1 - h.experts_per_tok / h.experts) ** block_size) if h.moe else None
    verify = rig_hybrid.step_bytes(h, block_size, experts)
    draft = tensor_bytes(rig_hybrid.draft_tensors(h, block_size))
    out = {"target_gb": plain / 1e9, "draft_gb": draft / 1e9, "lm_head_gb": lm_head / 1e9,
           "floor_ratio_c1": (verify + draft + lm_head) / plain}
    if h.moe:
        out.update(verify_target_gb=verify / 1e9, verify_experts_per_layer=round(experts, 1))
    return out


def rig_payloads(n: int, prompt_len: int, max_new_tokens: int, vocab: int = 151936, seed: int = 0) -> list[dict]:
    """Token-id requests that always run to ``max_new_tokens``."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)],
             "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
            for _ in range(n)]


def add_options(ap) -> None:
    """The --rig options, for every command that can run on the rig."""
    ap.add_argument("--rig", "--rig-weights", dest="rig", choices=MODES,
                    help="no model: a real-shape pair with zero (tau = block size) or random (tau ~ 1) weights, "
                         "token-id prompts")
    ap.add_argument("--rig-shape", choices=all_shapes(), default="qwen3-8b",
                    help="the --rig target's shape: dense Qwen3, or the hybrids the Qwen3.5/3.6 drafts are for")
    ap.add_argument("--rig-layout", choices=LAYOUTS, default="multimodal",
                    help="a hybrid target's classes: multimodal (the published Qwen3_5*ForConditionalGeneration, "
                         "language_model_only; SGLang >= 0.5.22) or text (Qwen3_5*ForCausalLM, for 0.5.17)")
    ap.add_argument("--rig-dir", default="/tmp/dflash-rig", help="where --rig writes its checkpoints")
    ap.add_argument("--rig-prompt-len", type=int, default=128, help="prompt tokens of a --rig request")


def resolve_paths(ap, args) -> None:
    """With --rig: check the options and point --model-path and --draft-model-path at the rig."""
    if args.model_path or args.draft_model_path:
        ap.error("--rig writes its own target and draft: leave out --model-path and --draft-model-path")
    if args.rig_prompt_len < 1:
        ap.error("--rig-prompt-len must be >= 1")
    args.model_path = os.path.join(args.rig_dir, args.rig_shape, "target")
    args.draft_model_path = os.path.join(args.rig_dir, args.rig_shape, "draft")


def server_flags(mode: str) -> list[str]:
    flags = ["--skip-tokenizer-init"]
    return flags + (["--load-format", "dummy"] if mode == "random" else [])


def server_env(mode: str, shape: str) -> dict:
    """Environment for every server on the rig (the MoE zero rig's expert routing)."""
    return rig_hybrid.server_env(shape, mode)


def describe(shape: str) -> dict:
    """What a runner needs before starting servers on a hybrid rig: weight bytes, the bytes floor
    at block 16 and 8, the experts a verify step reads, and where the shapes come from."""
    h = HYBRID_SHAPES[shape]
    out = {"memory": rig_hybrid.memory_report(shape),
           "floor_ratio_c1": {f"b{b}": round(floor_ratio(shape, b)["floor_ratio_c1"], 3) for b in (16, 8)},
           "server_env": {w: rig_hybrid.server_env(shape, w) for w in MODES}, "sources": h.sources}
    if h.moe:
        out["experts_per_layer_per_verify"] = {
            f"c{c}/b{b}": rig_hybrid.verify_step_experts(h, c, b) for c in (1, 8, 32) for b in (16, 8, 1)}
    return out


if __name__ == "__main__":  # python -m sglang_dflash.bench.rig: the hybrid rigs at a glance
    print(json.dumps({shape: describe(shape) for shape in sorted(HYBRID_SHAPES)}, indent=1))
