#!/usr/bin/env python3
"""The DFLASH passes' attention on the FA3 backend, kernel against kernel: FA3's paged
``flash_attn_with_kvcache`` as SGLang's FA3 backend calls it for a TARGET_VERIFY pass (page size 1,
the request table as page table, the block already in the cache) against the plugin's block kernel
over the same table (``ops.block_attention_by_table``), on the 8B-shape rig's heads (32 query, 8 KV,
dim 128), a block of 16 per request, causal (the verify) and not (the draft).

    python3 -m lab.fa3_verify_bench OUT.json [--calls 20]

Each kernel runs from a CUDA graph of ``--calls`` calls, as a serving step replays it; per batch
size and context: microseconds per call (median of 7 replays) and the largest error of each
output against a float64 reference; the block kernel also at 1, 2, 4, 8 and 16 prefix splits
(its default is read from the batch's shape).
"""

import argparse
import json
import math

import torch

from lab.cuda_timing import graph_us
from sglang.kernels.ops.attention.flash_attention import flash_attn_with_kvcache

from sglang_dflash.ops.block_attention import block_attention_by_table, default_splits
from sglang_dflash.reference import block_attention as ref_block_attention

HQ, HKV, D, W = 32, 8, 128, 16


def problem(bs, lo, hi, gen):
    """Request b's prefix is ``lens[b]`` keys, its block the W after: table rows of random slots."""
    lens = torch.randint(lo, hi + 1, (bs,), generator=gen)
    width = int(lens.max()) + W
    slots = bs * width + 64
    table = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in range(bs)]).to(torch.int32)
    return dict(
        q=torch.randn(bs * W, HQ, D, generator=gen).to("cuda", torch.bfloat16),
        kc=torch.randn(slots, HKV, D, generator=gen).to("cuda", torch.bfloat16),
        vc=torch.randn(slots, HKV, D, generator=gen).to("cuda", torch.bfloat16),
        table=table.cuda(), rows=torch.arange(bs, device="cuda"), lens=lens.cuda(), lens_cpu=lens)


def reference(p, causal):
    lens, table = p["lens_cpu"].tolist(), p["table"].long()
    kvi = torch.cat([table[b, :n] for b, n in enumerate(lens)])
    kvp = torch.tensor([0] + lens).cumsum(0).cuda()
    block = torch.cat([table[b, n:n + W] for b, n in enumerate(lens)])
    return ref_block_attention(p["q"], p["kc"][block], p["vc"][block], p["kc"], p["vc"], kvp, kvi, W,
                               1 / math.sqrt(D), causal)


def fa3(p, o, causal):
    bs = len(p["lens"])
    flash_attn_with_kvcache(
        q=p["q"], k_cache=p["kc"].unsqueeze(1), v_cache=p["vc"].unsqueeze(1), page_table=p["table"],
        cache_seqlens=p["seqlens"], cu_seqlens_q=p["cu_q"], max_seqlen_q=W, softmax_scale=1 / math.sqrt(D),
        causal=causal, out=o) if bs else None


def block(p, o, causal, splits=None):
    block_attention_by_table(p["q"], o, p["kc"], p["vc"], p["table"], p["rows"], p["lens"], W, 1 / math.sqrt(D),
                             causal, splits=splits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs, lo, hi in [(1, 128, 384), (4, 128, 384), (8, 128, 384), (16, 128, 384), (32, 128, 384),
                       (64, 128, 384), (1, 1024, 4096), (8, 1024, 4096), (32, 1024, 4096)]:
        p = problem(bs, lo, hi, gen)
        p["seqlens"] = (p["lens"] + W).to(torch.int32)
        p["cu_q"] = torch.arange(0, (bs + 1) * W, W, dtype=torch.int32, device="cuda")
        for causal in (True, False):
            row = {"bs": bs, "context": [lo, hi], "causal": causal, "splits": default_splits(bs, HKV, p["q"].device)}
            ref = reference(p, causal)
            for name, fn in (("fa3", fa3), ("block", block)):
                o = torch.empty_like(p["q"])
                row[f"{name}_us"] = graph_us(lambda: fn(p, o, causal), args.calls)
                row[f"{name}_max_err_vs_f64"] = float((o.double() - ref).abs().max())
            row["fa3_over_block"] = row["fa3_us"] / row["block_us"]
            for splits in (1, 2, 4, 8, 16):
                o = torch.empty_like(p["q"])
                row[f"block_s{splits}_us"] = graph_us(lambda: block(p, o, causal, splits), args.calls)
            rows.append(row)
            print(json.dumps(row), flush=True)
            json.dump({"device": torch.cuda.get_device_name(), "heads": [HQ, HKV, D], "block": W,
                       "calls_per_graph": args.calls, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
