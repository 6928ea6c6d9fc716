"""Train a DFlash draft against a frozen target (the public recipe, SpecForge-style).

Per sequence, anchors ``a`` are sampled among response positions; each anchor becomes a block
``[token_a, mask x (B-1)]`` at positions ``a..a+B-1``. All blocks of a batch run in one draft
forward: queries are the blocks, keys are the target's tapped features for the whole sequence
(visible strictly before the anchor) plus the blocks (visible only inside their own block;
sliding layers causally). Slot k is trained to predict the token at ``a+k`` (same-position
labels, k >= 1) with weight ``exp(-(k-1)/gamma)``. Embedding and lm_head are the target's, frozen.

With ``labels="target"`` (the default) the label of slot k is the target's own greedy choice after
``a+k-1``, and a slot counts only while the text before it stays on the target's greedy path. That
is what greedy verification accepts, so responses sampled at a temperature train the draft as
cleanly as greedy ones. ``labels="text"`` takes the response tokens as they are.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from ..config import DFlashDraftConfig, default_target_layer_ids
from ..reference import ReferenceDraft
from .atomic import write_atomically, write_text_atomically
from .batch import FrozenTarget, batch_loss
from .data import Example, pad_id
from .held_out import evaluate, split_eval
from .progress import progress_bar


@dataclass
class TrainConfig:
    out_dir: str
    block_size: int = 16
    draft_layers: int = 3
    target_layer_ids: Optional[list[int]] = None
    mask_token_id: Optional[int] = None
    steps: int = 2000
    batch_size: int = 8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    max_length: int = 1024
    anchors: int = 64
    gamma: Optional[float] = None  # loss decay; default 7 for block 16, scaled with the block
    labels: str = "target"  # "target": the target's greedy next token (on its greedy path); "text": the response
    grad_clip: float = 1.0
    save_every: int = 500
    max_minutes: Optional[float] = None  # training-time budget over all resumes; the LR schedule follows it
    pause_after_minutes: Optional[float] = None  # save and stop this long after the command began; resume goes on
    loss_chunk: int = 8192  # rows of lm_head logits alive at once (they are recomputed in backward)
    seed: int = 0
    eval_examples: int = 0  # held out of training; their loss and accuracy go to eval_log.jsonl at each save
    init_from: Optional[str] = None  # a draft checkpoint of the same shape to start from (not resumed: new schedule)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.labels not in ("target", "text"):
            raise ValueError(f"TrainConfig.labels must be 'target' or 'text', got {self.labels!r}")

    @property
    def decay(self) -> float:
        return self.gamma if self.gamma is not None else 7.0 * self.block_size / 16


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: Optional[int]) -> int:
    """A row that already exists in the target embedding (resized rows would be untrained)."""
    if requested is None:
        requested = getattr(tokenizer, "mask_token_id", None)
    if requested is None:
        vocab = tokenizer.get_vocab()
        requested = next((vocab[t] for t in ("<|mask|>", "<|MASK|>", "<mask>") if t in vocab), None)
    if requested is None:
        raise SystemExit("no mask token in the tokenizer: pass --mask-token-id (an existing, rarely used row)")
    if not 0 <= requested < vocab_size:
        raise SystemExit(f"--mask-token-id {requested} is outside the target vocabulary ({vocab_size})")
    return int(requested)


def draft_config_dict(target_config, cfg: TrainConfig, mask_token_id: int) -> dict:
    """The z-lab ``config.json`` for a draft shaped like one target layer."""
    t = getattr(target_config, "text_config", None) or target_config
    taps = cfg.target_layer_ids or default_target_layer_ids(t.num_hidden_layers, cfg.draft_layers)
    heads = t.num_attention_heads
    rope_theta = getattr(t, "rope_theta", None) or (getattr(t, "rope_parameters", None) or {}).get("rope_theta", 1e4)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "num_hidden_layers": cfg.draft_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", heads),
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "intermediate_size": t.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        # The dtype the weights are saved in: without it SGLang's built-in loads the draft as fp16.
        "torch_dtype": "bfloat16",
        "num_target_layers": t.num_hidden_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask_token_id, "block_size": cfg.block_size},
    }


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay over ``progress`` in [0, 1] of the run."""
    warm = max(cfg.warmup_ratio, 1e-6)
    if progress < warm:
        return cfg.lr * max(progress, 1.0 / max(cfg.steps, 1)) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warm) / (1 - warm))))


def run_progress(step: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """How far the run is: by steps, or by training time (all resumes) when a budget is set, whichever is further."""
    by_steps = step / max(cfg.steps, 1)
    return max(by_steps, elapsed_s / (60 * cfg.max_minutes)) if cfg.max_minutes else by_steps


def save_checkpoint(draft: ReferenceDraft, config: dict, out_dir: str, dtype=torch.bfloat16,
                    state: Optional[dict] = None) -> None:
    """The exact z-lab layout: config.json + model.safetensors (no embedding, no lm_head).

    Each file is replaced whole (``write_atomically``): a kill mid-save leaves the previous
    checkpoint as it was. ``trainer_state.pt`` goes last and carries its own copy of the weights,
    so a resume never depends on which of the other files got written.
    """
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.state_dict().items()}
    write_atomically(os.path.join(out_dir, "model.safetensors"), lambda tmp: save_file(tensors, tmp))
    write_text_atomically(os.path.join(out_dir, "config.json"), json.dumps(config, indent=1))
    if state is not None:
        write_atomically(os.path.join(out_dir, "trainer_state.pt"), lambda tmp: torch.save(state, tmp))


def read_saved_config(state_path: str) -> dict:
    """The ``TrainConfig`` a ``trainer_state.pt`` was written under (to refuse an incompatible resume)."""
    return torch.load(state_path, map_location="cpu", weights_only=False).get("config", {})


def rng_states(rng: random.Random, gen: torch.Generator) -> dict:
    """Everything random a step draws from: the batch sampler, the anchor generator, torch's global RNGs."""
    states = {"batches": rng.getstate(), "anchors": gen.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict, rng: random.Random, gen: torch.Generator) -> None:
    rng.setstate(states["batches"])
    # The states are CPU byte tensors; torch.load's map_location may have moved them to the GPU.
    gen.set_state(states["anchors"].cpu())
    torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])


def keep_log_rows_up_to(path: str, step: int) -> None:
    """Drop rows past ``step`` (and a line cut by a kill): the resumed run writes those steps again."""
    if not os.path.isfile(path):
        return
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                rows.append(line if line.endswith("\n") else line + "\n")
    write_text_atomically(path, "".join(rows))


def train(target_model, tokenizer, examples: Sequence[Example], cfg: TrainConfig, resume: bool = False,
          log=print, started: Optional[float] = None, eval_set: Optional[Sequence[Example]] = None) -> str:
    """Train and write the draft to ``cfg.out_dir``; resumes from its ``trainer_state.pt`` if asked.

    ``started`` (``time.monotonic()``) is when the command began: ``pause_after_minutes`` counts
    from there, so regeneration and loading fit inside a time-limited job too. ``eval_set``: the
    held-out examples scored at each save, given (none of ``examples`` is held out then).
    """
    device = next(target_model.parameters()).device
    vocab = target_model.get_input_embeddings().weight.shape[0]
    mask_id = resolve_mask_token_id(tokenizer, vocab, cfg.mask_token_id)
    config = draft_config_dict(target_model.config, cfg, mask_id)
    target = FrozenTarget(target_model, config["dflash_config"]["target_layer_ids"])
    torch.manual_seed(cfg.seed)
    draft = ReferenceDraft(DFlashDraftConfig.from_dict(config)).to(device)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)
    if cfg.init_from:
        init_draft_from(draft, cfg.init_from)
        log(f"initialised from {cfg.init_from}")
    start, trained_s = 0, 0.0
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    state_path = os.path.join(cfg.out_dir, "trainer_state.pt")
    if resume and os.path.isfile(state_path):
        state = torch.load(state_path, map_location=device, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        start, trained_s = state["step"], state.get("train_seconds", 0.0)
        if "rng" in state:  # the next batch and anchors are the ones an uninterrupted run would draw
            restore_rng_states(state["rng"], rng, gen)
        else:  # a state from before the RNG was saved: fresh streams, seeded by the step
            gen.manual_seed(cfg.seed + start)
            rng.seed(cfg.seed + start)
        # The LR schedule needs no state: it is a function of the step (and trained time), both restored.
        for name in ("train_log.jsonl", "eval_log.jsonl"):
            keep_log_rows_up_to(os.path.join(cfg.out_dir, name), start)
        log(f"resumed from step {start}")
    pad = pad_id(tokenizer)
    history = []
    if cfg.steps == 0:  # the untrained baseline: initialised weights in the same layout
        save_checkpoint(draft, config, cfg.out_dir)
        return cfg.out_dir
    if run_progress(start, trained_s, cfg) >= 1:
        log(f"the training budget is spent (step {start}, {trained_s / 60:.1f} min): nothing to resume")
        return cfg.out_dir
    pool, held_out = (list(examples), list(eval_set)) if eval_set else split_eval(examples, cfg.eval_examples, cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    bar = progress_bar(cfg.steps, "training draft", initial=start)
    t0 = time.monotonic()
    started = t0 if started is None else started
    for step in range(start, cfg.steps):
        progress = run_progress(step, trained_s + time.monotonic() - t0, cfg)
        batch = rng.sample(pool, min(cfg.batch_size, len(pool)))
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, cfg)
        loss, acc, _ = batch_loss(draft, target, batch, cfg, mask_id, pad, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        loss_value, acc_value = torch.stack([loss.detach().float(), acc.float()]).tolist()  # one host sync
        history.append({"step": step + 1, "loss": loss_value, "acc": acc_value})
        now = time.monotonic()
        bar.update(1)
        postfix = {"loss": f"{loss_value:.3f}", "acc": f"{acc_value:.3f}"}
        if cfg.max_minutes:  # the bar's ETA counts steps; a time budget may end the run first
            postfix["budget_left"] = f"{max(0.0, cfg.max_minutes - (trained_s + now - t0) / 60):.1f}min"
        bar.set_postfix(postfix, refresh=False)
        done = step + 1 == cfg.steps or run_progress(step + 1, trained_s + now - t0, cfg) >= 1
        done = done or (cfg.pause_after_minutes is not None and now - started >= 60 * cfg.pause_after_minutes)
        if done or (step + 1) % cfg.save_every == 0:
            # The log first: rows past the saved step are dropped on resume, missing rows could not come back.
            with open(os.path.join(cfg.out_dir, "train_log.jsonl"), "a") as f:
                for h in history:
                    f.write(json.dumps(h) + "\n")
            history.clear()
            save_checkpoint(draft, config, cfg.out_dir, state={
                "draft": draft.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                "train_seconds": trained_s + now - t0, "config": asdict(cfg), "rng": rng_states(rng, gen)})
            if held_out:
                scoring = time.monotonic()
                row = {"step": step + 1, **evaluate(draft, target, held_out, cfg, mask_id, pad)}
                with open(os.path.join(cfg.out_dir, "eval_log.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.write(f"step {step + 1}: held-out loss {row['eval_loss']:.3f}, accuracy {row['eval_acc']:.3f}, "
                          f"accept length served {row['eval_served_accept_len']:.2f} "
                          f"(at random positions {row['eval_accept_len']:.2f})")
                t0 += time.monotonic() - scoring  # scoring is not training: the time budget excludes it
        if done:
            break
    bar.close()
    return cfg.out_dir


def init_draft_from(draft: ReferenceDraft, path: str) -> None:
    """Copy a checkpoint's weights into ``draft``; refuses one of another shape, naming the tensor."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    own = draft.state_dict()
    for name, value in own.items():
        if name not in tensors or tensors[name].shape != value.shape:
            got = tuple(tensors[name].shape) if name in tensors else "missing"
            raise SystemExit(f"--init-from {path}: tensor {name} is {got}, this draft needs {tuple(value.shape)}")
    draft.load_state_dict({k: tensors[k].to(own[k].dtype) for k in own})


def load_trained_draft(path: str, device="cpu") -> ReferenceDraft:
    with open(os.path.join(path, "config.json")) as f:
        cfg = DFlashDraftConfig.from_dict(json.load(f))
    draft = ReferenceDraft(cfg)
    draft.load_state_dict({k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()})
    return draft.to(device).eval()
