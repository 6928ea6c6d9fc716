"""Held-out examples: which ones, and what a draft scores on them at each save.

Two accept lengths are reported, and only one is what serving sees:

- ``eval_accept_len``: the mean over blocks anchored at random response positions. Every position
  weighs the same, so the easy stretches, where one block commits many tokens, count as often as
  the hard ones. It runs above the served figure (about 5.2 against 3.6 for the shipped SmolLM2
  draft, ``results/smollm2-draft/``).
- ``eval_served_accept_len``: greedy serving's own count, tokens over verify steps. Each step starts
  at the last committed token, so a response is walked from its first token (prefill's) by the
  accept length found there; an easy stretch takes few steps, a hard one many. On responses the
  target wrote greedily this is exactly what the reference loop (``reference.speculative_generate``)
  and a server count; the ablation (``lab/train_ablation.py``) ranks drafts by it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

import torch

from .batch import block_accept_lengths, block_hits, collate, loss_and_accuracy, sample_anchors
from .data import Example

if TYPE_CHECKING:
    from .trainer import TrainConfig


def by_prompt(examples: Sequence[Example]) -> list[list[int]]:
    """Indices of the examples grouped by their prompt, groups in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(tuple(e.ids[:e.response_start]), []).append(i)
    return list(groups.values())


def split_eval(examples: Sequence[Example], n: int, seed: int) -> tuple[list[Example], list[Example]]:
    """At least ``n`` examples held out of training, whole prompts at a time: with several responses
    a prompt (``--samples``), a held-out response whose siblings were trained on would score what the
    draft memorised. Prompts are drawn with ``seed``: the same ones on every resume."""
    if n <= 0:
        return list(examples), []
    groups = by_prompt(examples)
    random.Random(seed).shuffle(groups)
    held: set[int] = set()
    for group in groups:
        if len(held) >= n:
            break
        held.update(group)
    if len(held) >= len(examples):
        raise SystemExit(f"--eval-examples {n} leaves nothing to train on ({len(examples)} examples, "
                         f"{len(groups)} prompts)")
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def served_steps(lengths: Sequence[int]) -> list[int]:
    """Tokens each verify step of greedy serving commits on one response.

    Prefill produces the response's first token; ``lengths[i]`` is the accept length of a block
    anchored at its token ``i`` (one entry per token but the last). A step from the last committed
    token commits the length found there, the last step only up to the response's end (as
    ``max_new_tokens`` cuts it).
    """
    steps, i = [], 0
    while i < len(lengths):
        n = min(int(lengths[i]), len(lengths) - i)
        steps.append(n)
        i += n
    return steps


def _accept_rows(draft, target, part: Sequence[Example], ids, attn, loss_mask, feats, greedy, cfg: TrainConfig,
                 mask_id: int) -> list[list[int]]:
    """One collated batch's accept lengths at each response token but the last, from the target's
    features already computed: ``cfg.anchors`` blocks a row per draft pass."""
    device = ids.device
    ends = attn.sum(1).tolist()
    starts = [min(e.response_start, end) for e, end in zip(part, ends)]
    accept_at = torch.zeros(ids.shape, dtype=torch.long, device=device)
    longest = max(end - 1 - start for start, end in zip(starts, ends))
    for first in range(0, max(longest, 0), cfg.anchors):
        anchors = torch.full((len(part), cfg.anchors), -1, dtype=torch.long, device=device)
        for b, (start, end) in enumerate(zip(starts, ends)):
            lo = start + first  # past a shorter response's end, the row stays empty
            row = torch.arange(lo, max(lo, min(lo + cfg.anchors, end - 1)), device=device)
            anchors[b, :row.numel()] = row
        _, hits, keep = block_hits(draft, target, ids, feats, greedy, loss_mask, anchors, cfg, mask_id)
        # An unused slot (-1) adds its length 0 at position 0, which is never a response position.
        lengths = block_accept_lengths(hits, keep, anchors >= 0, cfg.block_size)
        accept_at.scatter_add_(1, anchors.clamp(min=0), lengths)
    rows = accept_at.tolist()
    return [row[start:end - 1] for row, start, end in zip(rows, starts, ends)]


@torch.no_grad()
def accept_lengths_everywhere(draft, target, examples: Sequence[Example], cfg: TrainConfig, mask_id: int,
                              pad: int) -> list[list[int]]:
    """For each example, the accept length of a block anchored at each response token but the last
    (``served_steps``'s input), the target's features computed once a batch."""
    device = target.embed.device
    out = []
    for i in range(0, len(examples), cfg.batch_size):
        part = examples[i:i + cfg.batch_size]
        ids, attn, loss_mask = (t.to(device) for t in collate(part, cfg.max_length, pad))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            feats, greedy = target.features(ids, attn)
            out += _accept_rows(draft, target, part, ids, attn, loss_mask, feats, greedy, cfg, mask_id)
    return out


@torch.no_grad()
def evaluate(draft, target, examples: Sequence[Example], cfg: TrainConfig, mask_id: int, pad: int) -> dict:
    """Loss, accuracy and the mean block accept length at random response positions (anchors fixed by
    the seed: comparable across saves), and the accept length greedy serving would count. One target
    forward a batch serves both."""
    gen = torch.Generator().manual_seed(cfg.seed)
    device = target.embed.device
    loss_sum, acc_sum, batches, accepted, steps = 0.0, 0.0, 0, [], []
    for i in range(0, len(examples), cfg.batch_size):
        part = examples[i:i + cfg.batch_size]
        ids, attn, loss_mask = collate(part, cfg.max_length, pad)
        anchors = sample_anchors(loss_mask, cfg.anchors, gen)
        ids, attn, loss_mask = ids.to(device), attn.to(device), loss_mask.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = target.features(ids, attn)
            loss, acc, accept = loss_and_accuracy(draft, target, ids, attn, loss_mask, anchors, cfg, mask_id,
                                                  accept_lengths=True, features=features)
            rows = _accept_rows(draft, target, part, ids, attn, loss_mask, *features, cfg, mask_id)
        loss_sum, acc_sum, batches = loss_sum + float(loss), acc_sum + float(acc), batches + 1
        accepted.append(accept.float())
        steps += [served_steps(lengths) for lengths in rows]
    accepted = torch.cat(accepted)
    n_steps = sum(len(s) for s in steps)
    tokens = sum(sum(s) + 1 for s in steps)  # the prefill's token is a completion token, not a step
    return {"eval_loss": loss_sum / batches, "eval_acc": acc_sum / batches,
            "eval_accept_len": float(accepted.mean()) if accepted.numel() else None,
            "eval_served_accept_len": tokens / n_steps if n_steps else None}
