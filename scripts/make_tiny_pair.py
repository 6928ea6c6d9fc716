"""Write a tiny random Qwen3 target and a DFlash draft (z-lab layout) for GPU tests.

    python scripts/make_tiny_pair.py OUT [--draft zero|random] [--block-size 16]

The target has one "magnet" token: its final norm amplifies one hidden coordinate that only
the magnet's lm_head row reads, so greedy decoding emits it in runs of varying length. A
``zero`` draft (final norm weight 0) always proposes token 0 = the magnet, which gives the
server partial acceptance of every length: the multi-token commit, KV and stop bookkeeping
all get exercised while the output stays the target's own. ``random`` is an untrained draft.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch
from safetensors.torch import save_file

SPECIALS = ["<|magnet|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # magnet = id 0


def train_tokenizer(out_dirs, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:150]
    tok.train(files, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for d in out_dirs:
        fast.save_pretrained(d)
    return fast


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--draft", choices=["zero", "random"], default="zero")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--magnet", type=float, default=3.0, help="strength of the magnet token (0: off)")
    ap.add_argument("--logit-scale", type=float, default=8.0, help="lm_head gain: peaky logits, few near-ties")
    args = ap.parse_args()
    target_dir, draft_dir = os.path.join(args.out, "target"), os.path.join(args.out, "draft")
    os.makedirs(target_dir, exist_ok=True)
    os.makedirs(draft_dir, exist_ok=True)
    tok = train_tokenizer([target_dir, draft_dir], args.vocab)
    vocab = len(tok)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")

    from transformers import Qwen3Config, Qwen3ForCausalLM

    H, heads, kv, hd = args.hidden, 8, 4, 64
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=16384,
        rope_theta=1e6, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        target.lm_head.weight.mul_(args.logit_scale)
        if args.magnet:
            j = H - 1
            target.model.norm.weight[j] = args.magnet * 8
            target.lm_head.weight[:, j] = 0
            target.lm_head.weight[0, j] = args.logit_scale
    target.save_pretrained(target_dir, safe_serialization=True)

    taps = sorted({1, args.layers // 2 - 1, args.layers // 2 + 1, args.layers - 2})
    dcfg = cfg.to_dict()
    for k in ("layer_types", "max_window_layers", "use_sliding_window", "sliding_window"):
        dcfg.pop(k, None)
    dcfg.update(
        architectures=["DFlashDraftModel"], num_hidden_layers=args.draft_layers, num_target_layers=args.layers,
        block_size=args.block_size,
        dflash_config={"target_layer_ids": taps, "mask_token_id": mask_id, "block_size": args.block_size},
    )
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump(dcfg, f, indent=1)

    from sglang_dflash.config import DFlashDraftConfig
    from sglang_dflash.reference import ReferenceDraft

    draft = ReferenceDraft(DFlashDraftConfig.from_dict(dcfg))
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(0.5) if p.ndim == 2 else None
        if args.draft == "zero":
            draft.norm.weight.zero_()
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, os.path.join(draft_dir, "model.safetensors"))
    print(json.dumps({"target": target_dir, "draft": draft_dir, "vocab": vocab, "mask_id": mask_id, "taps": taps}))


if __name__ == "__main__":
    main()
