"""Pure-torch DFlash math: the reference the GPU path and the tests are checked against.

Nothing here imports SGLang. ``ReferenceDraft`` uses the checkpoint's own parameter names, so a
z-lab ``model.safetensors`` loads into it directly and the trainer (``sglang_dflash.train``)
optimises this very module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashDraftConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (Llama/Qwen3) on ``x[..., T, heads, head_dim]``."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd))
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)[..., None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)[..., None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def draft_attention_mask(
    anchors: torch.Tensor,
    block_size: int,
    context_len: int,
    *,
    causal: bool = False,
    sliding_window: Optional[int] = None,
    context_window: Optional[int] = None,
) -> torch.Tensor:
    """Which keys each block query may see, as a bool mask ``[..., nb*bs, context_len + nb*bs]``.

    ``anchors[..., b]`` is the position of block b's first (real) token. Keys are the context
    (position j, visible iff j < anchor) followed by all blocks (visible only inside the own block).
    Full layers are bidirectional inside the block; sliding layers are causal with a window of
    ``sliding_window`` keys counting the query itself. ``context_window`` caps the context to the
    last W positions before the anchor (the runtime draft-window flag).
    """
    nb = anchors.shape[-1]
    dev = anchors.device
    offs = torch.arange(block_size, device=dev)
    q_anchor = anchors[..., :, None].expand(*anchors.shape, block_size).reshape(*anchors.shape[:-1], nb * block_size)
    q_pos = (anchors[..., :, None] + offs).reshape(*anchors.shape[:-1], nb * block_size)
    q_blk = torch.arange(nb, device=dev).repeat_interleave(block_size)

    ctx_pos = torch.arange(context_len, device=dev)
    see_ctx = ctx_pos < q_anchor[..., None]
    if context_window is not None:
        see_ctx &= ctx_pos >= q_anchor[..., None] - context_window
    see_blk = q_blk[:, None] == q_blk[None, :]
    see_blk = see_blk.expand(*q_pos.shape, nb * block_size)
    if causal:
        see_blk = see_blk & (q_pos[..., None, :] <= q_pos[..., :, None])
    if sliding_window is not None:
        see_ctx = see_ctx & (ctx_pos > q_pos[..., None] - sliding_window)
        see_blk = see_blk & (q_pos[..., None, :] > q_pos[..., :, None] - sliding_window)
    return torch.cat([see_ctx, see_blk], dim=-1)


def block_attention(q, k, v, k_cache, v_cache, kv_indptr, kv_indices, block: int, sm_scale: float,
                    causal: bool) -> torch.Tensor:
    """Each request's ``block`` queries over its cached prefix (``kv_indices`` rows of the caches)
    and the block's own ``k``/``v`` (causally or all), in float64; the spec of
    ``ops.block_attention``. Shapes: ``q`` ``[bs * block, Hq, D]``, ``k``/``v`` ``[bs * block, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    bounds = kv_indptr.tolist()
    for b in range(len(bounds) - 1):
        idx = kv_indices[bounds[b]:bounds[b + 1]].long()
        rows = slice(b * block, (b + 1) * block)
        keys = torch.cat([k_cache[idx], k[rows]]).double().repeat_interleave(group, 1)
        vals = torch.cat([v_cache[idx], v[rows]]).double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys) * sm_scale
        if causal:
            seen = torch.ones(block, len(idx) + block, dtype=torch.bool, device=q.device).tril(len(idx))
            scores = scores.masked_fill(~seen, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    return out


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(h))
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(h, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        a.k_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        a.v_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        a.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)
        a.q_norm = nn.Module()
        a.q_norm.weight = nn.Parameter(torch.ones(hd))
        a.k_norm = nn.Module()
        a.k_norm.weight = nn.Parameter(torch.ones(hd))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)


class ReferenceDraft(nn.Module):
    """The DFlash draft network. Parameter names equal the checkpoint's tensor names."""

    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_features * h, h, bias=False)
        self.hidden_norm = nn.Module()
        self.hidden_norm.weight = nn.Parameter(torch.ones(h))
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(h))

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat of K tapped target layers))``: once per token, shared by all layers."""
        return rms_norm(self.fc(target_features), self.hidden_norm.weight, self.cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.cfg.head_dim)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K (k_proj, k_norm, RoPE at the absolute position) and V of projected context.

        This is what the GPU worker writes into the draft KV cache for each committed token.
        """
        cfg, out = self.cfg, []
        for layer in self.layers:
            a = layer.self_attn
            k = rms_norm(self._heads(a.k_proj(ctx), cfg.num_key_value_heads), a.k_norm.weight, cfg.rms_norm_eps)
            out.append((apply_rope(k, positions, cfg.rope_theta), self._heads(a.v_proj(ctx), cfg.num_key_value_heads)))
        return out

    def forward_with_context_kv(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_mask: Optional[Sequence[torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Draft hidden states ``[..., Nq, H]`` (after the final norm) for the block queries.

        ``attn_mask[i]`` (bool, ``[..., Nq, S+Nq]``) restricts layer i; None means all visible.
        """
        cfg = self.cfg
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        h = block_embeds
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = rms_norm(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
            q = rms_norm(self._heads(a.q_proj(x), cfg.num_attention_heads), a.q_norm.weight, cfg.rms_norm_eps)
            q = apply_rope(q, block_positions, cfg.rope_theta)
            kb = rms_norm(self._heads(a.k_proj(x), cfg.num_key_value_heads), a.k_norm.weight, cfg.rms_norm_eps)
            kb = apply_rope(kb, block_positions, cfg.rope_theta)
            vb = self._heads(a.v_proj(x), cfg.num_key_value_heads)
            kc, vc = context_kv[i]
            k = torch.cat([kc, kb], dim=-3).repeat_interleave(groups, dim=-2)
            v = torch.cat([vc, vb], dim=-3).repeat_interleave(groups, dim=-2)
            mask = None if attn_mask is None else attn_mask[i].unsqueeze(-3)
            o = F.scaled_dot_product_attention(
                q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask
            ).transpose(-3, -2)
            h = h + a.o_proj(o.reshape(*o.shape[:-2], -1))
            x = rms_norm(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
        return rms_norm(h, self.norm.weight, cfg.rms_norm_eps)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
        attn_mask: Optional[Sequence[torch.Tensor]] = None,
    ) -> torch.Tensor:
        ctx = self.project_context(context_features)
        return self.forward_with_context_kv(block_embeds, block_positions, self.context_kv(ctx, context_positions), attn_mask)

    def layer_masks(self, anchors: torch.Tensor, context_len: int, context_window: Optional[int] = None):
        """Per-layer masks for blocks at ``anchors``: full layers bidirectional, sliding layers causal+window."""
        cfg = self.cfg
        full = draft_attention_mask(anchors, cfg.block_size, context_len, context_window=context_window)
        sliding = None
        if cfg.has_sliding_layers:
            sliding = draft_attention_mask(
                anchors, cfg.block_size, context_len, causal=True,
                sliding_window=cfg.sliding_window, context_window=context_window,
            )
        return [sliding if t == "sliding_attention" else full for t in cfg.layer_types]


# --------------------------------------------------------------------------------------------
# A tiny decoder-only target (Qwen3/Llama shape) for CPU tests and the reference loop.


@dataclass
class TinyTargetConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    logit_scale: float = 1.0


class TinyTarget(nn.Module):
    """Causal LM returning logits and the HF-style hidden-state tuple (index i+1 = layer i output)."""

    def __init__(self, cfg: TinyTargetConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
        self.head_dim = hd

        def w(*shape, scale=0.08):
            return nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.embed = w(cfg.vocab_size, h, scale=1.0)
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = nn.Module()
            layer.wq, layer.wk = w(cfg.num_heads * hd, h), w(cfg.num_kv_heads * hd, h)
            layer.wv, layer.wo = w(cfg.num_kv_heads * hd, h), w(h, cfg.num_heads * hd)
            layer.w_gate, layer.w_up = w(cfg.intermediate_size, h), w(cfg.intermediate_size, h)
            layer.w_down = w(h, cfg.intermediate_size)
            self.layers.append(layer)
        self.lm_head = w(cfg.vocab_size, h, scale=cfg.logit_scale / math.sqrt(h))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cfg, hd = self.cfg, self.head_dim
        T = ids.shape[-1]
        pos = torch.arange(T)
        x = self.embed[ids]
        hidden = [x]
        ones = torch.ones(cfg.hidden_size)
        for layer in self.layers:
            y = rms_norm(x, ones, cfg.rms_norm_eps)
            q = apply_rope((y @ layer.wq.T).view(T, cfg.num_heads, hd), pos, cfg.rope_theta)
            k = apply_rope((y @ layer.wk.T).view(T, cfg.num_kv_heads, hd), pos, cfg.rope_theta)
            v = (y @ layer.wv.T).view(T, cfg.num_kv_heads, hd)
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + o.transpose(0, 1).reshape(T, -1) @ layer.wo.T
            y = rms_norm(x, ones, cfg.rms_norm_eps)
            x = x + (F.silu(y @ layer.w_gate.T) * (y @ layer.w_up.T)) @ layer.w_down.T
            hidden.append(x)
        logits = rms_norm(x, ones, cfg.rms_norm_eps) @ self.lm_head.T
        return logits, hidden


def tapped_features(hidden: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of the tapped layers (HF index ``id + 1``) on the last dim."""
    return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)


# --------------------------------------------------------------------------------------------
# Acceptance and the speculative loop.


@dataclass
class Acceptance:
    accept_len: torch.Tensor  # [bs] drafted tokens accepted (bonus excluded)
    bonus: torch.Tensor  # [bs] target token at index accept_len
    out_tokens: torch.Tensor  # [bs, B] accepted drafts, then the bonus; then the target's other choices
    commit_len: torch.Tensor  # [bs] accept_len + 1


def accept_block(candidates: torch.Tensor, target_tokens: torch.Tensor) -> Acceptance:
    """Greedy DFlash rule on ``[bs, B]`` tensors.

    ``candidates[:, 0]`` is the last committed token and ``candidates[:, 1:]`` the drafts;
    ``target_tokens[:, i]`` is the target's choice for the position after candidate i.
    Drafts are accepted while they equal the target's choice; the target's choice right after
    the last accepted one is the bonus. With sampled ``target_tokens`` the same rule is exact
    sampling, because every committed token is a target sample given the committed prefix.
    """
    bs, B = candidates.shape
    match = (candidates[:, 1:] == target_tokens[:, :-1]).to(torch.int64)
    accept_len = match.cumprod(dim=1).sum(dim=1)
    bonus = target_tokens.gather(1, accept_len[:, None]).squeeze(1)
    # Accepted drafts equal the target's choices: the committed tokens are target_tokens[:, :n].
    return Acceptance(accept_len, bonus, target_tokens.clone(), accept_len + 1)


def truncate_at_stop(tokens: list[int], stop_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut generated tokens after the first stop token and at the token budget; report finished."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@dataclass(frozen=True)
class RequestParams:
    """The per-token sampling parameters of a request, with SGLang's meaning: the additive
    penalties summed, then the repetition scaling, then the logit bias. That is the order of the
    penalties SGLang accumulates before a forward (``SamplingBatchInfo.update_penalties``: its
    overlap scheduler and every speculative worker). Its plain decoding without the overlap
    scheduler applies the penalizers one by one in the iteration order of a set of classes, which
    changes from process to process: with repetition and frequency or presence penalties together,
    that server is a reference only when its process happened to put repetition last."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    logit_bias: dict = field(default_factory=dict)  # token id -> added logit

    def adjust(self, logits: torch.Tensor, generated: Sequence[int], stop_ids: Sequence[int]) -> torch.Tensor:
        """The logits of the next token after ``generated`` (this request's output so far)."""
        z = logits.clone()
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=z.shape[-1])[: z.shape[-1]]
        seen = counts > 0
        # Summed first: SGLang adds them to the logits as one accumulated tensor (update_penalties).
        z = z - (self.frequency_penalty * counts.to(z.dtype) + self.presence_penalty * seen.to(z.dtype))
        if len(generated) < self.min_new_tokens and len(stop_ids):
            z[list(stop_ids)] = float("-inf")
        if self.repetition_penalty != 1.0:
            scaled = torch.where(z < 0, z * self.repetition_penalty, z / self.repetition_penalty)
            z = torch.where(seen, scaled, z)
        for token, bias in self.logit_bias.items():
            z[token] += bias
        return z


PLAIN = RequestParams()


def sample_tokens(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def target_generate(
    target: TinyTarget,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    params: RequestParams = PLAIN,
) -> list[int]:
    """Plain autoregressive decoding: the ground truth."""
    ids = list(prompt)
    out: list[int] = []
    while True:
        logits, _ = target(torch.tensor(ids))
        tok = int(sample_tokens(params.adjust(logits[-1], out, stop_ids), temperature, generator))
        out.append(tok)
        ids.append(tok)
        out, done = truncate_at_stop(out, stop_ids, max_new_tokens)
        if done:
            return out


# propose(context_features [S, K*H], block_ids [B], start) -> drafted tokens [B-1]
Proposer = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def draft_proposer(draft: ReferenceDraft, target: TinyTarget) -> Proposer:
    """One parallel draft pass over [last, mask...] with the target's embedding and lm_head."""

    def propose(context_features: torch.Tensor, block_ids: torch.Tensor, start: int) -> torch.Tensor:
        B = block_ids.shape[0]
        hidden = draft(
            target.embed[block_ids],
            torch.arange(start, start + B),
            context_features,
            torch.arange(context_features.shape[0]),
        )
        return (hidden[1:] @ target.lm_head.T).argmax(-1)

    return propose


@dataclass
class SpecResult:
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # committed per step, bonus included


def speculative_generate(
    target: TinyTarget,
    propose: Proposer,
    prompt: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    mask_token_id: int,
    layer_ids: Sequence[int],
    stop_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    params: RequestParams = PLAIN,
    width: Optional[Callable[[int], int]] = None,
) -> SpecResult:
    """DFlash decoding: draft a block in one pass, verify it in one target pass, keep the match.

    The target is recomputed over the whole sequence each step (no KV cache), which is slow but
    leaves no cache bookkeeping to get wrong: it is the definition the servers must match.
    Verify position k takes ``params`` as plain decoding would there: after the committed output
    and the block's candidates 1..k. ``width(step)`` (1..block_size, default block_size) verifies
    only the block's first candidates at that step; width 1 is a plain decoding step.
    """
    logits, hidden = target(torch.tensor(list(prompt)))
    out = [int(sample_tokens(params.adjust(logits[-1], [], stop_ids), temperature, generator))]
    features = tapped_features(hidden, layer_ids)  # rows = committed positions
    result = SpecResult(out)
    out, done = truncate_at_stop(out, stop_ids, max_new_tokens)
    while not done:
        start = len(prompt) + len(out) - 1  # position of the last committed token
        w = block_size if width is None else width(len(result.accept_lengths))
        candidates = torch.tensor(out[-1:])
        if w > 1:
            block = torch.full((block_size,), mask_token_id, dtype=torch.long)
            block[0] = out[-1]
            candidates = torch.cat([candidates, propose(features[:start], block, start)[: w - 1]])
        seq = torch.tensor(list(prompt) + out[:-1] + candidates.tolist())
        logits, hidden = target(seq)
        drafted = candidates.tolist()
        adjusted = torch.stack([params.adjust(logits[start + k], out + drafted[1 : k + 1], stop_ids)
                                for k in range(w)])
        verified = sample_tokens(adjusted, temperature, generator)
        acc = accept_block(candidates[None], verified[None])
        n = int(acc.commit_len[0])
        result.accept_lengths.append(n)
        features = torch.cat([features[:start], tapped_features(hidden, layer_ids)[start : start + n]])
        out, done = truncate_at_stop(out + acc.out_tokens[0, :n].tolist(), stop_ids, max_new_tokens)
    result.tokens = out
    return result


def copy_states(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> None:
    """:func:`sglang_dflash.ops.state_copy.copy_states` in torch: ``dst[l, dst_index[i]] =
    src[l, src_index[i]]`` for every layer, skipping entries with either index below 0."""
    keep = (dst_index >= 0) & (src_index >= 0)
    dst[:, dst_index[keep].long()] = src[:, src_index[keep].long()]

