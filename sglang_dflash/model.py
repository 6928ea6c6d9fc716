"""The DFlash draft network on SGLang layers (parallel linears, RMSNorm, RoPE, RadixAttention).

The draft owns no embedding and no lm_head: the worker feeds it the target's embeddings of
``[last token, mask x (B-1)]`` and reads its hidden states through the target's lm_head.
Its attention sees, per layer, the context K/V that the worker wrote into the draft KV cache
from target hidden states (``context_kv``), plus the block itself:

* full layers are ``ENCODER_ONLY``, i.e. bidirectional over the block and the whole context;
* ``sliding_attention`` layers are causal ``DECODER`` layers with the configured window.

The math is the one in :mod:`sglang_dflash.reference`; GPU tests compare the two.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.utils import apply_qk_norm
from sglang.srt.runtime_context import get_parallel

from .config import (
    IGNORED_TENSOR_SUFFIXES, DFlashConfigError, DFlashDraftConfig, canonical_tensor_name, fused_context_kv,
)
from .ops.context_kv import norm_rope_split


def _draft_config(hf_config) -> DFlashDraftConfig:
    raw, path = hf_config.to_dict(), getattr(hf_config, "_name_or_path", None)
    # The checkpoint's own config.json wins: transformers' Qwen3Config drops ``sliding_window``
    # unless ``use_sliding_window`` is set, though ``layer_types`` still names sliding layers.
    file = os.path.join(path, "config.json") if path else None
    if file and os.path.isfile(file):
        with open(file) as f:
            raw.update(json.load(f))
    return DFlashDraftConfig.from_dict(raw, source=path)


def has_dense_weight(linear: nn.Module) -> bool:
    """Unquantised, or in SGLang's fp8 layout: ``[in, out]`` with one scale per output channel or
    one in all (``--speculative-draft-model-quantization fp8`` on a 16-bit checkpoint)."""
    if type(linear.quant_method) is UnquantizedLinearMethod:
        return True
    w, scale = linear.weight, getattr(linear, "weight_scale", None)
    return (
        w.dtype == torch.float8_e4m3fn and scale is not None and not hasattr(linear, "weight_scale_inv")
        and tuple(w.shape) == (linear.input_size_per_partition, linear.output_size_per_partition)
        and scale.numel() in (1, w.shape[1])
    )


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A linear's weight as a dense ``[out, in]`` matrix (fp8 dequantised); None if it has none."""
    if type(linear.quant_method) is UnquantizedLinearMethod:
        return linear.weight
    if not has_dense_weight(linear):
        return None
    return (linear.weight.t().float() * linear.weight_scale.float().reshape(-1, 1)).to(dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_parallel().tp_size
        hd = cfg.head_dim
        self.head_dim = hd
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd, cfg.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rotary_emb = get_rope(
            hd, rotary_dim=hd, max_position=cfg.max_position_embeddings or 32768,
            base=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
        )
        sliding = cfg.layer_types[layer_id] == "sliding_attention"
        self.attn = RadixAttention(
            self.num_heads, hd, hd**-0.5, self.num_kv_heads, layer_id=layer_id,
            # SGLang's window counts the keys left of the query; the checkpoint's includes it.
            sliding_window_size=cfg.sliding_window - 1 if sliding else -1,
            attn_type=AttentionType.DECODER if sliding else AttentionType.ENCODER_ONLY,
            prefix=f"{prefix}.attn",
        )

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x.reshape(-1, self.head_dim)).view_as(x)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # One fused in-place kernel for both norms where SGLang has it (as its own Qwen3 layers do).
        q, k = apply_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v, forward_batch))
        return out

    def kv_weight(self, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The K and V rows of ``qkv_proj`` (and bias) as a dense matrix, fp8 dequantised; None
        for another quantisation."""
        w = dense_weight(self.qkv_proj, dtype)
        if w is None:
            return None
        b = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :]
        return w[self.q_size :], b

    def context_kv(self, positions: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated at the token's absolute position) and V of projected target context."""
        if type(self.qkv_proj.quant_method) is UnquantizedLinearMethod:
            w, b = self.kv_weight(ctx.dtype)  # K and V rows only: Q of context is never used
            kv = F.linear(ctx, w, b)
        else:
            kv = self.qkv_proj(ctx)[0][..., self.q_size :]  # the layer's own kernels
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k = self._norm_heads(k, self.k_norm)
        _, k = self.rotary_emb(positions, torch.empty_like(k), k)
        return k.view(-1, self.num_kv_heads, self.head_dim), v.reshape(-1, self.num_kv_heads, self.head_dim)


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_id, quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg, quant_config, prefix=f"{prefix}.mlp")

    def forward(self, positions, hidden, residual, forward_batch):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DFlashDraftModel(nn.Module):
    """Registered under the checkpoint's architecture name ``DFlashDraftModel``."""

    # Weight names in the checkpoint -> (fused parameter, shard id).
    STACKED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        cfg = _draft_config(config)
        self.dflash_config = cfg
        self.block_size = cfg.block_size
        self.layers = nn.ModuleList(
            DFlashLayer(cfg, i, quant_config, prefix=f"layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # K is fixed by the checkpoint: taps listed, else one per draft layer (the default rule).
        num_features = len(cfg.target_layer_ids) if cfg.target_layer_ids else cfg.num_hidden_layers
        self.fc = nn.Linear(num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self._stacked_kv = None  # (weight, bias, k-norm weights), built after the weights load
        self._stacked_stale = False  # weights reloaded since: copy them into the same tensors
        self._fused_context_kv = fused_context_kv()

    def get_attention_sliding_window_size(self) -> Optional[int]:
        cfg = self.dflash_config
        return cfg.sliding_window - 1 if cfg.has_sliding_layers else None

    def project_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        if target_hidden.shape[-1] != self.fc.in_features:
            raise RuntimeError(
                f"DFlash draft expects {self.fc.in_features} context features per token "
                f"(fc.weight), the target captured {target_hidden.shape[-1]}"
            )
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def context_kv(self, positions: torch.Tensor, ctx: torch.Tensor) -> list[tuple[RadixAttention, torch.Tensor, torch.Tensor]]:
        """(attention, K, V) of projected target context for every draft layer.

        One stacked GEMM and one Triton launch for all layers where they allow it (unquantised or
        fp8, one shared plain RoPE over the whole head, on CUDA); else layer by layer.
        """
        stacked = self._stacked_context_weights(ctx)
        if stacked is None:
            return [(layer.self_attn.attn, *layer.self_attn.context_kv(positions, ctx)) for layer in self.layers]
        weight, bias, k_norm_weight = stacked
        attn = self.layers[0].self_attn
        k, v = norm_rope_split(
            F.linear(ctx, weight, bias), positions, k_norm_weight, attn.rotary_emb.cos_sin_cache,
            attn.k_norm.variance_epsilon, len(self.layers), attn.num_kv_heads, attn.head_dim,
        )
        return [(layer.self_attn.attn, k[i], v[i]) for i, layer in enumerate(self.layers)]

    def _stacked_context_weights(self, ctx: torch.Tensor):
        if self._stacked_stale and self._stacked_kv:
            # In place: a verify CUDA graph may have captured these tensors' addresses.
            for held, fresh in zip(self._stacked_kv, self._build_stacked_weights()):
                if held is not None:
                    held.copy_(fresh)
        self._stacked_stale = False
        if self._stacked_kv is None:
            attns = [layer.self_attn for layer in self.layers]
            rope = attns[0].rotary_emb
            plain_rope = (
                isinstance(rope, RotaryEmbedding)
                and type(rope).forward_cuda is RotaryEmbedding.forward_cuda
                and type(rope).forward_native is RotaryEmbedding.forward_native
                and rope.is_neox_style and rope.rotary_dim == rope.head_size
            )
            ok = (
                self._fused_context_kv and ctx.is_cuda and plain_rope
                and all(a.rotary_emb is rope for a in attns)
                and len({a.k_norm.variance_epsilon for a in attns}) == 1
                and all(has_dense_weight(a.qkv_proj) for a in attns)
            )
            self._stacked_kv = self._build_stacked_weights() if ok else False
        return self._stacked_kv or None

    def _build_stacked_weights(self) -> tuple:
        attns = [layer.self_attn for layer in self.layers]
        rows = [a.kv_weight(self.fc.weight.dtype) for a in attns]
        weight = torch.cat([w for w, _ in rows])
        bias = None if rows[0][1] is None else torch.cat([b for _, b in rows])
        return weight, bias, torch.stack([a.k_norm.weight for a in attns]).contiguous()

    def prepare_context_kv(self, device) -> None:
        """Build the stacked K/V weights now, outside any CUDA-graph capture (a tensor made during
        capture would live in the graph's private memory)."""
        self._stacked_context_weights(torch.empty(0, device=device))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
        get_embedding: bool = False,
        pp_proxy_tensors=None,
    ) -> LogitsProcessorOutput:
        if input_embeds is None:
            raise RuntimeError("the DFlash draft runs on the target's embeddings (input_embeds)")
        # SGLang's eager extend path hands embeddings over as bf16 whatever the model dtype.
        hidden, residual = input_embeds.to(self.fc.weight.dtype), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        if hidden.numel():
            hidden, _ = self.norm(hidden, residual)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._stacked_stale = True  # a copy of K/V rows: refreshed from the new weights at next use
        params = dict(self.named_parameters())
        unloaded = set(params)
        for raw_name, tensor in weights:
            name = canonical_tensor_name(raw_name)
            if name.endswith(IGNORED_TENSOR_SUFFIXES):
                continue
            shard = None
            for ckpt, (fused, shard_id) in self.STACKED.items():
                if f".{ckpt}." in name:
                    name, shard = name.replace(f".{ckpt}.", f".{fused}."), shard_id
                    break
            if name not in params:
                raise DFlashConfigError(raw_name, "unexpected tensor in the draft checkpoint")
            param = params[name]
            if shard is None:
                if tuple(param.shape) != tuple(tensor.shape) and name == "fc.weight":
                    raise DFlashConfigError(raw_name, f"shape {list(tensor.shape)}, expected {list(param.shape)}")
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            unloaded.discard(name)
        if unloaded:
            raise DFlashConfigError("weights", f"the checkpoint lacks {sorted(unloaded)[:6]}")


EntryClass = DFlashDraftModel
