"""Write a tiny random Qwen3 target and a DFlash draft (z-lab layout) for GPU tests.

    python scripts/make_tiny_pair.py OUT [--draft zero|random] [--block-size 16] [--target-arch qwen3_5]

It needs the package installed (``pip install -e .``), and transformers and tokenizers.

The target has one "magnet" token: its final norm amplifies one hidden coordinate that only
the magnet's lm_head row reads, so greedy decoding emits it in runs of varying length. A
``zero`` draft (final norm weight 0) always proposes token 0 = the magnet, which gives the
server partial acceptance of every length: the multi-token commit, KV and stop bookkeeping
all get exercised while the output stays the target's own. ``random`` is an untrained draft.

``--target-arch qwen3_5`` writes a hybrid target instead: Qwen3.5 (``Qwen3_5ForConditionalGeneration``,
a one-block vision tower, and a processor), whose layers are three gated-delta-net (linear
attention) layers to one full-attention layer; ``qwen3_next`` writes the Qwen3-Next MoE hybrid.

Random top-2 routing is chaotic in bf16: a rounding step flips a token's second expert, and the
recurrent state carries the change on (fp32 against bf16, the plain Qwen3-Next target's top-2 margins
moved by up to 68 nats). ``--expert-spread`` makes the experts one shared expert plus that fraction of
their own random deviation, so a flip moves little while routing stays top-2 of 4; ``--magnet-bias``
adds a constant to the magnet coordinate of every token embedding, so answers are mostly magnet runs
with margins the bf16 rule can decide.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch
from safetensors.torch import save_file

from sglang_dflash.bench.cli import HelpFormatter

SPECIALS = ["<|magnet|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # magnet = id 0
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # Qwen3.5's processor


def train_tokenizer(out_dirs, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:150]
    tok.train(files, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS + VISION_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for d in out_dirs:
        fast.save_pretrained(d)
    return fast


def hybrid_target(arch, vocab, eos_id, H, layers):
    """A random Qwen3.5 / Qwen3-Next target: every fourth layer full attention, the rest gated delta net."""
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    text = dict(
        vocab_size=vocab, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
        layer_types=layer_types, max_position_embeddings=16384, tie_word_embeddings=False, eos_token_id=eos_id,
    )
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=H,
                              shared_expert_intermediate_size=H, rope_theta=1e6, partial_rotary_factor=0.25)
        model = Qwen3NextForCausalLM(cfg)
        return model, cfg, model.model.norm
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    # 16 rotary dims (head_dim 64 x 0.25): the three M-RoPE sections cover its 8 frequencies
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                               "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=H,
                  num_position_embeddings=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(cfg)
    return model, cfg.text_config, model.model.language_model.norm


def pull_experts_together(target_dir, spread):
    """Rewrite the saved experts as expert 0 plus ``spread`` of their own deviation from it."""
    from safetensors.torch import load_file

    for path in glob.glob(os.path.join(target_dir, "*.safetensors")):
        state = load_file(path)
        for name in state:
            head, sep, tail = name.partition(".mlp.experts.")
            if sep and not tail.startswith("0."):
                base = state[f"{head}.mlp.experts.0.{tail.split('.', 1)[1]}"]
                state[name] = base + spread * (state[name] - base)
        save_file(state, path, metadata={"format": "pt"})


def save_hybrid_extras(target_dir, arch, tok, cfg_path):
    """Qwen3.5's vision token ids point into this vocabulary; SGLang loads its processor too."""
    if arch != "qwen3_5":
        return
    from transformers import Qwen2VLImageProcessorFast, Qwen3VLProcessor, Qwen3VLVideoProcessor

    with open(cfg_path) as f:
        raw = json.load(f)
    ids = dict(zip(VISION_SPECIALS, tok.convert_tokens_to_ids(VISION_SPECIALS)))
    raw.update(vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
               image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    with open(cfg_path, "w") as f:
        json.dump(raw, f, indent=1)
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorFast(), tokenizer=tok,
                     video_processor=Qwen3VLVideoProcessor(), chat_template=tok.chat_template).save_pretrained(target_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("out", help="folder that gets target/ and draft/")
    ap.add_argument("--draft", choices=["zero", "random"], default="zero",
                    help="zero: always proposes the magnet token; random: an untrained draft")
    ap.add_argument("--block-size", type=int, default=16, help="the draft's block size")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of target and draft")
    ap.add_argument("--layers", type=int, default=8, help="target layers (>= 4)")
    ap.add_argument("--draft-layers", type=int, default=2, help="draft layers")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size to train (specials included)")
    ap.add_argument("--magnet", type=float, default=3.0, help="strength of the magnet token (0: off)")
    ap.add_argument("--logit-scale", type=float, default=8.0, help="lm_head gain: peaky logits, few near-ties")
    ap.add_argument("--target-arch", choices=["qwen3", "qwen3_5", "qwen3_next"], default="qwen3",
                    help="qwen3: dense; qwen3_5, qwen3_next: hybrid (gated delta net) targets")
    ap.add_argument("--draft-sliding-window", type=int, default=0,
                    help="make the first draft layer a sliding_attention layer with this window (0: all full)")
    ap.add_argument("--expert-spread", type=float, default=1.0,
                    help="qwen3_next: each expert is expert 0 plus this fraction of its own deviation (1: independent)")
    ap.add_argument("--magnet-bias", type=float, default=0.0,
                    help="added to the magnet coordinate of every token embedding (0: none)")
    args = ap.parse_args()
    if not 0 <= args.expert_spread <= 1:
        ap.error("--expert-spread must lie in [0, 1]")
    if args.block_size < 2 or args.layers < 4 or args.draft_layers < 1 or args.hidden < 2:
        ap.error("--block-size >= 2, --layers >= 4, --draft-layers >= 1 and --hidden >= 2 are required")
    smallest_vocab = 256 + len(SPECIALS + VISION_SPECIALS)  # the byte alphabet and the special tokens
    if args.vocab < smallest_vocab or args.draft_sliding_window < 0 or args.logit_scale <= 0 or args.magnet < 0:
        ap.error(f"--vocab >= {smallest_vocab}, --draft-sliding-window >= 0, --logit-scale > 0 and --magnet >= 0 "
                 "are required")
    target_dir, draft_dir = os.path.join(args.out, "target"), os.path.join(args.out, "draft")
    os.makedirs(target_dir, exist_ok=True)
    os.makedirs(draft_dir, exist_ok=True)
    tok = train_tokenizer([target_dir, draft_dir], args.vocab)
    vocab = len(tok)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")

    from transformers import Qwen3Config, Qwen3ForCausalLM

    H, heads, kv, hd = args.hidden, 8, 4, 64
    torch.manual_seed(0)
    if args.target_arch == "qwen3":
        cfg = Qwen3Config(
            vocab_size=vocab, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=args.layers,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=16384,
            rope_theta=1e6, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
        )
        target = Qwen3ForCausalLM(cfg)
        final_norm, norm_offset = target.model.norm, 0.0
    else:  # the hybrids' RMSNorm scales by (1 + weight)
        target, cfg, final_norm = hybrid_target(args.target_arch, vocab, tok.eos_token_id, H, args.layers)
        norm_offset = 1.0
    target = target.float()
    with torch.no_grad():
        target.lm_head.weight.mul_(args.logit_scale)
        if args.magnet:
            j = H - 1
            final_norm.weight[j] = args.magnet * 8 - norm_offset
            target.lm_head.weight[:, j] = 0
            target.lm_head.weight[0, j] = args.logit_scale
        if args.magnet_bias:
            target.get_input_embeddings().weight[:, H - 1] += args.magnet_bias
    target.save_pretrained(target_dir, safe_serialization=True)
    if args.expert_spread < 1:
        pull_experts_together(target_dir, args.expert_spread)
    save_hybrid_extras(target_dir, args.target_arch, tok, os.path.join(target_dir, "config.json"))

    taps = sorted({1, args.layers // 2 - 1, args.layers // 2 + 1, args.layers - 2})
    dcfg = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "rms_norm_eps",
                                          "max_position_embeddings", "eos_token_id")}
    dcfg.update(
        model_type="qwen3", num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, rope_theta=1e6,
        hidden_act="silu", tie_word_embeddings=False, architectures=["DFlashDraftModel"],
        num_hidden_layers=args.draft_layers, num_target_layers=args.layers, block_size=args.block_size,
        **({"layer_types": ["sliding_attention"] + ["full_attention"] * (args.draft_layers - 1),
            "sliding_window": args.draft_sliding_window, "use_sliding_window": True} if args.draft_sliding_window else {}),
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
