"""How far bf16 moves a tiny target's top-2 margins, on the CPU, before a GPU call spends time on it.

    python -m lab.bf16_margin_noise TARGET [TARGET ...] [--prompts 8] [--new-tokens 64] [--out FILE]

The GPU lossless tests run hybrids in bf16 (SGLang's chunked gated-delta-rule kernel refuses
float32) and excuse a divergence only on a near-tie: 2x the largest margin shift the AR server's own
kernels show. That rule decides only when few ordinary positions fall under it (tie rate <= 5%,
tests/gpu/test_server_gpu.py). This scores each TARGET the same way with transformers: greedy answers
in float32, then every answer position's top-2 log-prob margin in float32 and in bf16. A target whose
tie rate is high here will leave the GPU rule undecided too.
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def margins(model, ids, start):
    with torch.no_grad():
        top = model(ids).logits[0, start - 1:-1].float().log_softmax(-1).topk(2).values
    return top[:, 0] - top[:, 1]


def score(target, n_prompts=8, new_tokens=64, magnet_id=0):
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    half = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    rng = random.Random(11)  # the prompts' shape of tests/gpu: random ids, 8-64 long
    shifts, exact, answers = [], [], []
    for _ in range(n_prompts):
        prompt = torch.tensor([[rng.randrange(10, 4000) for _ in range(rng.randrange(8, 64))]])
        with torch.no_grad():
            ids = full.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        a, b = margins(full, ids, prompt.shape[1]), margins(half, ids, prompt.shape[1])
        shifts += (a - b).abs().tolist()
        exact += a.tolist()
        answers += ids[0, prompt.shape[1]:].tolist()
    shift, margin = torch.tensor(shifts), torch.tensor(exact)
    near_tie = 2 * shift.max().item()
    return {"target": target, "positions": len(exact),
            "margin_shift_nats": {"max": shift.max().item(), "p99": shift.quantile(0.99).item(),
                                  "median": shift.median().item()},
            "margin_nats": {"median": margin.median().item(), "p5": margin.quantile(0.05).item()},
            "magnet_share": sum(t == magnet_id for t in answers) / len(answers),
            "near_tie_nats": near_tie, "tie_rate": (margin <= near_tie).float().mean().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="Hugging Face folders (scripts/make_tiny_pair.py OUT/target)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", help="write the rows here as JSON")
    args = ap.parse_args()
    if args.prompts < 1 or args.new_tokens < 2:
        ap.error("--prompts >= 1 and --new-tokens >= 2 are required")
    rows = []
    for t in args.targets:
        rows.append(score(t, args.prompts, args.new_tokens))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
