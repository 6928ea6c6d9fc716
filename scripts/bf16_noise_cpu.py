#!/usr/bin/env python3
"""Can a bf16 near-tie rule decide on a tiny random target? A CPU estimate before spending GPU time.

    python scripts/make_tiny_pair.py /tmp/t --logit-scale 8 --magnet 3
    python scripts/bf16_noise_cpu.py /tmp/t/target [more targets]

Greedy continuations are scored in float32 and in bf16; the largest top-2 margin disagreement is
the noise, and the tie rate is the share of ordinary positions whose margin is within twice that
(the GPU test's rule). A rate above a few percent means bf16 divergences prove nothing there.
"""

import random
import sys

import torch
from transformers import AutoModelForCausalLM


def top2_margins(model, ids, start):
    with torch.no_grad():
        top = model(ids).logits[0, start - 1:-1].float().log_softmax(-1).topk(2).values
    return top[:, 0] - top[:, 1]


def main(paths):
    for path in paths:
        fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        vocab, rng = fp32.config.vocab_size, random.Random(0)
        noise, margins = [], []
        for _ in range(6):
            prompt = torch.tensor([[rng.randrange(10, vocab) for _ in range(rng.randrange(8, 64))]])
            with torch.no_grad():
                ids = fp32.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=96,
                                    do_sample=False, pad_token_id=0)
            m32, m16 = top2_margins(fp32, ids, prompt.shape[1]), top2_margins(bf16, ids, prompt.shape[1])
            noise += (m32 - m16).abs().tolist()
            margins += m32.tolist()
        bound = 2 * max(noise)
        print(f"{path}: noise max {max(noise):.3f} nats, median margin {sorted(margins)[len(margins) // 2]:.2f}, "
              f"tie rate {sum(m <= bound for m in margins) / len(margins):.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
