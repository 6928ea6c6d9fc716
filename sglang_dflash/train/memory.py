"""How much memory a training run needs, checked against the device before any slow work.

The estimate counts the tensors that live at the step's peak; it is written out term by term so a
refusal can say what dominates. With the defaults on a small target (SmolLM2-135M: batch 8,
1024 tokens, 64 anchors of 16) the chunked lm_head loss dominates (5.6 of 7.2 GB); on Qwen3-8B with a
5-layer draft the frozen target's float32 weights lead (33 GB, then 26 of activations, 17 of draft
state: 76 GB).

Persistent over the run:
- the frozen target, loaded in float32: 4 bytes per parameter (counted from the safetensors
  headers, else from config.json);
- the draft: float32 weights, gradients and two Adam moments, 16 bytes per parameter.

At the peak of one step (``B`` sequences of ``T`` = ``--max-length`` tokens, the worst case;
``N`` = anchors x block size query rows per sequence; ``a`` = 2 bytes under CUDA's bf16 autocast,
4 on CPU):
- the tapped target features, float32, kept through the step;
- the larger of two phases that do not overlap:
  - the target forward: every layer's hidden states (``output_hidden_states``) and the logits;
  - the draft forward saved for backward (per layer and query row: float32 residual and norms,
    q/k/v, attention output, MLP gate/up/activation/product), the context keys and values, the
    attention masks (and on CPU the math path's scores and probabilities), plus one lm_head loss
    chunk live in backward (logits in ``a`` bytes, their float32 copy, log-softmax and its gradient).

Not counted: allocator fragmentation, cuBLAS workspaces and the CUDA context, a few percent more;
the check refuses only when the counted tensors alone exceed what is free.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

GB = 1e9


def safetensors_parameter_count(folder: str) -> Optional[int]:
    """Elements over every ``*.safetensors`` file in ``folder``, read from the headers only; None if none."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        return None
    total = 0
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for key, meta in header.items():
            if key != "__metadata__":
                count = 1
                for dim in meta["shape"]:
                    count *= dim
                total += count
    return total


def config_parameter_count(text_config) -> int:
    """A dense decoder's parameters from its config (the fallback when no safetensors header is there)."""
    h, layers, vocab = text_config.hidden_size, text_config.num_hidden_layers, text_config.vocab_size
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or h // heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    per_layer = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * text_config.intermediate_size
    embeddings = vocab * h * (1 if getattr(text_config, "tie_word_embeddings", False) else 2)
    return layers * per_layer + embeddings


def training_memory(draft_cfg, target_text_config, target_params: int, draft_params: int, batch_size: int,
                    max_length: int, anchors: int, loss_chunk: int, device_type: str) -> dict[str, int]:
    """Bytes per term of the module docstring's estimate; ``total`` is their peak sum."""
    a = 2 if device_type == "cuda" else 4
    B, T = batch_size, max_length
    N = anchors * draft_cfg.block_size
    rows = B * N
    h, inter, vocab = draft_cfg.hidden_size, draft_cfg.intermediate_size, target_text_config.vocab_size
    q = draft_cfg.num_attention_heads * draft_cfg.head_dim
    kv = draft_cfg.num_key_value_heads * draft_cfg.head_dim
    layers = draft_cfg.num_hidden_layers
    keys = T + N  # each query row sees the context and the blocks
    features = B * T * draft_cfg.num_context_features * h * 4
    target_forward = (target_text_config.num_hidden_layers + 1) * B * T * target_text_config.hidden_size * 4 \
        + B * T * vocab * a
    per_row = 3 * h * 4 + a * (2 * q + 2 * kv + h + 4 * inter)
    masks = B * N * keys * (1 + (2 if device_type == "cuda" else 0))  # bool, and SDPA's additive bias on CUDA
    scores = 2 * B * draft_cfg.num_attention_heads * N * keys * 4 if device_type != "cuda" else 0
    draft_saved = layers * (rows * per_row + B * T * 2 * kv * a + masks + scores) + B * T * h * (a + 4)
    loss = min(loss_chunk, rows) * vocab * (a + 12)
    out = {
        "target weights": 4 * target_params,
        "draft weights, gradients and Adam": 16 * draft_params,
        "activations": features + max(target_forward, draft_saved + loss),
    }
    out["total"] = sum(out.values())
    return out


def free_memory(device_type: str) -> tuple[int, str]:
    """Bytes free on the device the trainer would use, and its name for a message."""
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free, f"cuda:{torch.cuda.current_device()}"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, "CPU memory"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "CPU memory"


def describe(need: dict[str, int]) -> str:
    """``"41.3 GB (target weights 32.1, ...)"`` for a one-line refusal."""
    parts = ", ".join(f"{name} {value / GB:.1f}" for name, value in need.items() if name != "total")
    return f"{need['total'] / GB:.1f} GB ({parts})"
