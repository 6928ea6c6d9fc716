"""One training batch: sequences padded, anchors drawn, blocks built, the draft's loss and hits.

``cfg`` is the trainer's ``TrainConfig`` (block_size, anchors, max_length, labels, decay, loss_chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from ..reference import ReferenceDraft
from .data import Example

if TYPE_CHECKING:
    from .trainer import TrainConfig


class FrozenTarget:
    """A Hugging Face causal LM seen as DFlash needs it: tapped features, embedding, lm_head."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = list(layer_ids)
        self.embed = model.get_input_embeddings().weight
        self.lm_head = model.get_output_embeddings().weight

    @torch.no_grad()
    def features(self, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        """Tapped features ``[B, T, n_taps * H]`` and the greedy next token after every position ``[B, T]``."""
        out = self.model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1), out.logits.argmax(-1)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor):
        """The interface of ``reference.TinyTarget``: logits and the hidden-state tuple of one sequence."""
        out = self.model(input_ids=ids[None], output_hidden_states=True)
        return out.logits[0], [h[0] for h in out.hidden_states]



def collate(examples: Sequence[Example], max_length: int, pad_id: int):
    """Right-padded ids, attention mask, and the loss mask (response tokens only)."""
    T = min(max_length, max(len(e.ids) for e in examples))
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), T), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = min(len(e.ids), T)
        ids[i, :n] = torch.tensor(e.ids[:n])
        attn[i, :n] = 1
        loss_mask[i, e.response_start:n] = True
    return ids, attn, loss_mask


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``n`` anchors per row whose next token is supervised; -1 marks an unused slot."""
    B, T = loss_mask.shape
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, 1:]
    anchors = torch.full((B, n), -1, dtype=torch.long)
    for b in range(B):
        cand = ok[b].nonzero().flatten()
        if cand.numel():
            pick = cand[torch.randperm(cand.numel(), generator=generator)[:n]].sort().values
            anchors[b, : pick.numel()] = pick
    return anchors


def block_batch(ids, loss_mask, anchors, block_size: int, mask_token_id: int, decay: float,
                greedy: Optional[torch.Tensor] = None):
    """Block ids, positions, same-position labels and loss weights for every anchor.

    ``greedy`` (``[B, T]``, the target's greedy token after each position) makes the labels the
    target's choices. Slot k then counts only if the text's tokens at slots 1..k-1 are those
    choices too: past a step off the greedy path, serving would never see that context.
    """
    B, T = ids.shape
    offs = torch.arange(block_size, device=ids.device)
    valid = anchors >= 0
    pos = anchors.clamp(min=0)[..., None] + offs  # [B, nb, bs]
    in_seq = pos < T
    gathered = ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pos)
    supervised = loss_mask.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pos) & in_seq & valid[..., None]
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[..., 0] = gathered[..., 0]
    if greedy is not None:
        chosen = greedy.gather(1, (pos - 1).clamp(0, T - 1).flatten(1)).view_as(pos)
        on_path = torch.ones_like(supervised)
        on_path[..., 2:] = (gathered == chosen)[..., 1:-1].long().cumprod(-1).bool()
        supervised &= on_path
        gathered = chosen
    labels = torch.where(supervised, gathered, torch.full_like(gathered, -100))
    labels[..., 0] = -100  # slot 0 is the given token
    weights = torch.exp(-(offs.clamp(min=1) - 1).float() / decay).expand_as(pos) * (labels >= 0)
    return block_ids.flatten(1), pos.flatten(1), labels.flatten(1), weights.flatten(1)


def _chunk_loss(hidden, lm_head, labels, weights):
    logits = hidden.to(lm_head.dtype) @ lm_head.T
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1) == labels


def lm_loss(hidden, lm_head, labels, weights, chunk: int):
    """Weighted same-position cross-entropy over rows of ``hidden``, and which rows' argmax is the label.

    Vocabulary-wide logits for every block slot do not fit at once (61k rows x 49k vocab is 12 GB
    in float32), so rows go through lm_head in chunks that are recomputed in backward.
    """
    from torch.utils.checkpoint import checkpoint

    total, hits = hidden.new_zeros((), dtype=torch.float32), []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], lm_head, labels[i:i + chunk], weights[i:i + chunk])
        part, hit = checkpoint(_chunk_loss, *args, use_reentrant=False) if hidden.requires_grad else _chunk_loss(*args)
        total = total + part
        hits.append(hit)
    hits = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return total / weights.sum().clamp(min=1e-6), hits


def block_accept_lengths(hits: torch.Tensor, supervised: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Tokens one verify step would commit for each block, ``[B, blocks]`` (0 where ``valid`` is False):
    the draft slots that equal the target's token, counted from slot 1 up to the first miss, plus the
    bonus (as ``accept_block``).

    ``hits``: one flag per supervised slot, in order; ``supervised``: ``[B, blocks * block_size]``;
    ``valid``: ``[B, blocks]``, False for unused anchor slots. An unsupervised slot ends a block.
    """
    grid = torch.zeros(supervised.shape, dtype=torch.bool, device=hits.device)
    grid[supervised] = hits
    grid = grid.view(*valid.shape, block_size)[..., 1:]
    return (grid.long().cumprod(-1).sum(-1) + 1) * valid


def block_hits(draft: ReferenceDraft, target: FrozenTarget, ids, feats, greedy, loss_mask, anchors,
               cfg: TrainConfig, mask_token_id: int):
    """The draft's weighted loss over the supervised slots of the blocks at ``anchors``, which of those
    slots it predicts, and the supervised-slot mask ``[B, blocks * block_size]``."""
    block_ids, pos, labels, weights = block_batch(ids, loss_mask, anchors, cfg.block_size, mask_token_id, cfg.decay,
                                                  greedy if cfg.labels == "target" else None)
    masks = draft.layer_masks(anchors, ids.shape[1])
    ctx_pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    hidden = draft(target.embed[block_ids].to(feats.dtype), pos, feats, ctx_pos, masks)
    keep = labels >= 0
    loss, hits = lm_loss(hidden[keep], target.lm_head, labels[keep], weights[keep], cfg.loss_chunk)
    return loss, hits, keep


def loss_and_accuracy(draft: ReferenceDraft, target: FrozenTarget, ids, attn, loss_mask, anchors, cfg: TrainConfig,
                      mask_token_id: int, accept_lengths: bool = False, features: Optional[tuple] = None):
    """``features``: the target's ``(feats, greedy)`` for ``ids`` when the caller has them already."""
    device = target.embed.device
    ids, attn, loss_mask, anchors = (t.to(device) for t in (ids, attn, loss_mask, anchors))
    feats, greedy = features if features is not None else target.features(ids, attn)
    loss, hits, keep = block_hits(draft, target, ids, feats, greedy, loss_mask, anchors, cfg, mask_token_id)
    acc = hits.float().mean() if hits.numel() else loss.new_zeros(())
    # Only the held-out evaluation asks for accept lengths: the training step skips the extra work.
    valid = anchors >= 0
    accepted = block_accept_lengths(hits, keep, valid, cfg.block_size)[valid] if accept_lengths else None
    return loss, acc, accepted


def batch_loss(draft, target: FrozenTarget, examples: Sequence[Example], cfg: TrainConfig, mask_id: int, pad: int,
               generator: torch.Generator, accept_lengths: bool = False):
    """Loss, accuracy and (if asked) per-block accept lengths of one batch of examples, anchors
    drawn from ``generator`` (bf16 autocast on CUDA)."""
    ids, attn, loss_mask = collate(examples, cfg.max_length, pad)
    anchors = sample_anchors(loss_mask, cfg.anchors, generator)
    device = target.embed.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return loss_and_accuracy(draft, target, ids, attn, loss_mask, anchors, cfg, mask_id, accept_lengths)
