"""How far bf16 moves a tiny target's top-2 margins, on the CPU, before a GPU call spends time on it.

    python -m lab.bf16_margin_noise TARGET [TARGET ...] [--prompts 8] [--new-tokens 64] [--out FILE]
    python -m lab.bf16_margin_noise TARGET --hybrid-request 180 --position 3 --token 0

The GPU lossless tests run hybrids in bf16 (SGLang's chunked gated-delta-rule kernel refuses
float32) and excuse a divergence only on a near-tie: 2x the largest margin shift the AR server's own
kernels show. That rule decides only when few ordinary positions fall under it (tie rate <= 5%,
tests/gpu/test_server_gpu.py). This scores each TARGET the same way with transformers: greedy answers
in float32, then every answer position's top-2 log-prob margin in float32 and in bf16. A target whose
tie rate is high here will leave the GPU rule undecided too.

``--hybrid-request I --position P --token T`` scores one divergence of tests/gpu/test_hybrid_gpu.py
instead: its I-th greedy prompt, the first P tokens of the float32 answer, then T's gap to the best
token there, in float32 and in bf16.
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


def hybrid_test_prompt(index):
    """The ``index``-th greedy prompt of tests/gpu/test_hybrid_gpu.py (its ``short_prompts``)."""
    rng = random.Random(21)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(8, 64))] for _ in range(index + 1)]
    return prompts[index]


def gap_at(target, prompt, position, token):
    """``token``'s log-prob gap to the best one after ``position`` answer tokens, per dtype."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        answer = full.generate(torch.tensor([prompt]), max_new_tokens=position, do_sample=False)[0, len(prompt):]
    ids = torch.tensor([prompt + answer.tolist()])
    row = {"target": target, "answer_prefix": answer.tolist(), "token": token}
    for dtype in (torch.float32, torch.bfloat16):
        model = full if dtype == torch.float32 else AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
        with torch.no_grad():
            logprobs = model(ids).logits[0, -1].float().log_softmax(-1)
        top = logprobs.topk(5)
        row[str(dtype).removeprefix("torch.")] = {
            "gap_nats": (logprobs.max() - logprobs[token]).item(),
            "top": [[v, i] for v, i in zip(top.values.tolist(), top.indices.tolist())]}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="Hugging Face folders (scripts/make_tiny_pair.py OUT/target)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", help="write the rows here as JSON")
    ap.add_argument("--hybrid-request", type=int, help="score one divergence of the hybrid GPU test instead")
    ap.add_argument("--position", type=int, default=0, help="with --hybrid-request: answer tokens before it")
    ap.add_argument("--token", type=int, default=0, help="with --hybrid-request: the speculative token")
    args = ap.parse_args()
    if args.prompts < 1 or args.new_tokens < 2 or args.position < 0 or (args.hybrid_request or 0) < 0:
        ap.error("--prompts >= 1, --new-tokens >= 2, --position >= 0 and --hybrid-request >= 0 are required")
    rows = []
    for t in args.targets:
        if args.hybrid_request is not None:
            rows.append(gap_at(t, hybrid_test_prompt(args.hybrid_request), args.position, args.token))
        else:
            rows.append(score(t, args.prompts, args.new_tokens))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
