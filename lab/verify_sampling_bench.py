#!/usr/bin/env python3
"""A sampled verify step's draw, path against path: one target sample per verify row (bs x width
rows of the whole vocabulary) through SGLang's torch sampler (a sort per row: the plugin's only
path before 6964934, and still its path for seeded requests) against plain decoding's FlashInfer
kernels (``sampling.PlainDecodingKernels``), at temperature 0.8 and top-p 0.95.

    python3 -m lab.verify_sampling_bench OUT.json [--vocabs 49152,248320] [--batch-sizes 1,8,32,64]

Vocabularies: SmolLM2's 49,152 and the Qwen3.5/3.6 targets' 248,320. Per (vocab, bs, width):
microseconds per draw (CUDA events, median of 7). Per vocab, a check that both paths sample one
distribution: 8,192 draws of one peaked row by each, their total-variation distance beside that of
two torch draws (``tv``: ``{"kernels_vs_torch", "torch_vs_torch"}``).
"""

import argparse
import json
from collections import Counter

import torch

from lab.cuda_timing import event_us
from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

from sglang_dflash.sampling import plain_decoding_kernels

TEMPERATURE, TOP_P = 0.8, 0.95


def rows(bs, width, vocab, gen):
    logits = torch.randn(bs * width, vocab, generator=gen, device="cuda") * 3
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    n = bs * width
    return probs, torch.full((n,), 1 << 30, dtype=torch.int32, device="cuda"), \
        torch.full((n,), TOP_P, device="cuda"), torch.zeros(n, device="cuda")


def same_distribution(kernels, vocab, gen, n=8192) -> dict:
    """One peaked row (a few dozen tokens carry the mass) drawn n times by each path."""
    logits = torch.randn(1, vocab, generator=gen, device="cuda") * 4
    probs = torch.softmax(logits / TEMPERATURE, dim=-1).expand(n, -1).contiguous()
    ks = torch.full((n,), 1 << 30, dtype=torch.int32, device="cuda")
    ps, mps, positions = torch.full((n,), TOP_P, device="cuda"), torch.zeros(n, device="cuda"), torch.arange(n, device="cuda")
    draw_torch = lambda: Counter(top_k_top_p_min_p_sampling_from_probs_torch(  # noqa: E731
        probs, ks, ps, mps, False, None, positions).tolist())
    a, b, c = draw_torch(), draw_torch(), Counter(kernels.sample(probs, ks, ps, mps, False).tolist())
    tv = lambda x, y: round(0.5 * sum(abs(x[t] - y[t]) for t in set(x) | set(y)) / n, 4)  # noqa: E731
    return {"kernels_vs_torch": tv(a, c), "torch_vs_torch": tv(a, b)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--vocabs", default="49152,248320")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--widths", default="16,8")
    args = ap.parse_args()
    kernels = plain_decoding_kernels("flashinfer")
    assert kernels is not None, "SGLang's sampler holds no FlashInfer kernels here"
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"temperature": TEMPERATURE, "top_p": TOP_P, "rows": []}
    for vocab in map(int, args.vocabs.split(",")):
        for width in map(int, args.widths.split(",")):
            for bs in map(int, args.batch_sizes.split(",")):
                probs, ks, ps, mps = rows(bs, width, vocab, gen)
                positions = torch.arange(bs * width, device="cuda")
                torch_us = event_us(lambda: top_k_top_p_min_p_sampling_from_probs_torch(
                    probs, ks, ps, mps, False, None, positions), calls=5)
                kernel_us = event_us(lambda: kernels.sample(probs, ks, ps, mps, False), calls=5)
                row = {"vocab": vocab, "width": width, "bs": bs, "torch_us": round(torch_us, 1),
                       "kernels_us": round(kernel_us, 1), "speedup": round(torch_us / kernel_us, 2)}
                report["rows"].append(row)
                print(row, flush=True)
        report.setdefault("tv", {})[str(vocab)] = same_distribution(kernels, vocab, gen)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["tv"]))


if __name__ == "__main__":
    main()
