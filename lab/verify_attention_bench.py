#!/usr/bin/env python3
"""The target verify's attention on the Triton backend, kernel against kernel: SGLang's extend
kernel (what a DFLASH verify runs on NVIDIA without the plugin's), its split-KV verify kernel
(enabled by SGLang on gfx95 only) and the plugin's block kernel (``ops.block_attention``), on a
target's attention heads (default the 8B-shape rig's: 32 query, 8 KV, dim 128), a block per request.

    python3 -m lab.verify_attention_bench OUT.json [--dtype bfloat16|float32] [--no-split-kv]
        [--shape 8b|qwen3.5-4b|qwen3.5-27b|qwen3.6-35b-a3b] [--block 16]

The hybrid shapes' full-attention layers (heads of 256) decide ``HYBRID_TILE_LIMIT``: whether the
block kernel's query tile of a block times the GQA group beats SGLang's kernel there.

Per batch size and context: microseconds per call (median of CUDA-event timings, each over 50
calls), the split-KV kernel at 4 splits (an eager verify's short-context choice) and at 16 (a
CUDA-graph capture, whose index buffer is sized for the longest context), the block kernel at
its default split count and warps and at 1, 2, 4 and 8 splits (heads over 128: at 4 and at 8 warps),
and the largest difference of each output from
the extend kernel's and from a float64 reference.
"""

import argparse
import json
import math

import torch

from lab.cuda_timing import event_us
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

from sglang_dflash.ops.block_attention import block_attention, default_splits, query_rows, warps_for
from sglang_dflash.reference import block_attention as ref_block_attention

# query heads, KV heads, head size of each target's (full-)attention layers
SHAPES = {"8b": (32, 8, 128), "qwen3.5-4b": (16, 4, 256), "qwen3.5-27b": (24, 4, 256),
          "qwen3.6-35b-a3b": (16, 2, 256)}


def problem(bs, lo, hi, heads, block, dtype, gen):
    """``bs`` requests of ``block`` queries over prefixes of ``lo``-``hi`` tokens in shuffled slots."""
    hq, hkv, d = heads
    prefix = torch.randint(lo, hi + 1, (bs,), generator=gen)
    slots = int(prefix.sum()) + 64
    kb = torch.randn(slots, hkv, d, generator=gen).to("cuda", dtype)
    vb = torch.randn(slots, hkv, d, generator=gen).to("cuda", dtype)
    kv_indices = torch.randperm(slots, generator=gen)[: int(prefix.sum())].to("cuda", torch.int64)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = prefix.cumsum(0)
    qo_indptr = torch.arange(0, (bs + 1) * block, block, dtype=torch.int32)
    q = torch.randn(bs * block, hq, d, generator=gen).to("cuda", dtype)
    k = torch.randn(bs * block, hkv, d, generator=gen).to("cuda", dtype)
    v = torch.randn(bs * block, hkv, d, generator=gen).to("cuda", dtype)
    return dict(q=q, k=k, v=v, kb=kb, vb=vb, qo=qo_indptr.cuda(), kvp=kv_indptr.cuda(), kvi=kv_indices,
                prefix=prefix, block=block, scale=1 / math.sqrt(d),
                mask_indptr=torch.zeros(bs + 1, dtype=torch.int64, device="cuda"))


def reference(p):
    """float64: each query attends to its request's prefix and to the block up to itself."""
    return ref_block_attention(p["q"], p["k"], p["v"], p["kb"], p["vb"], p["kvp"], p["kvi"], p["block"], p["scale"],
                               causal=True)


def run_extend(p, o):
    extend_attention_fwd(p["q"], p["k"], p["v"], o, p["kb"], p["vb"], p["qo"], p["kvp"], p["kvi"], None, True,
                         p["mask_indptr"], p["block"], 1.0, 1.0, p["scale"])


def run_split(p, o, kvi):
    ran = verify_splitkv_fwd(p["q"], p["k"], p["v"], o, p["kb"], p["vb"], p["qo"], p["kvp"], kvi, None, True,
                             p["mask_indptr"], p["block"], 1.0, 1.0, p["scale"], max_bs=len(p["prefix"]))
    assert ran, "verify_splitkv_fwd declined the problem"


def run_block(p, o, splits, warps=None):
    block_attention(p["q"], p["k"], p["v"], o, p["kb"], p["vb"], p["kvp"], p["kvi"], p["block"], p["scale"], True,
                    splits=splits, warps=warps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-split-kv", action="store_true", help="leave SGLang's split-KV kernel out")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    heads, block = SHAPES[args.shape], args.block
    hq, hkv, d = heads
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs, lo, hi in [(1, 128, 384), (8, 128, 384), (32, 128, 384), (64, 128, 384), (8, 1024, 4096),
                       (32, 1024, 4096)]:
        p = problem(bs, lo, hi, heads, block, dtype, gen)
        # 16 splits: the index buffer as a CUDA graph holds it, sized past 8192 tokens a request
        kvi_graph = torch.zeros(bs * 8192, dtype=torch.int64, device="cuda")
        kvi_graph[: p["kvi"].numel()] = p["kvi"]
        o_ext = torch.empty_like(p["q"])
        row = {"shape": args.shape, "block": block, "tile_rows": query_rows(block, hq // hkv), "bs": bs, "context": [lo, hi],
               "dtype": args.dtype,
               "extend_us": event_us(lambda: run_extend(p, o_ext))}
        outs = {"extend": o_ext}
        if not args.no_split_kv:
            outs["split4"], outs["split16"] = torch.empty_like(p["q"]), torch.empty_like(p["q"])
            row["split4_us"] = event_us(lambda: run_split(p, outs["split4"], p["kvi"]))
            row["split16_us"] = event_us(lambda: run_split(p, outs["split16"], kvi_graph))
        row["block_default_splits"] = default_splits(bs, hkv, p["q"].device)
        for splits in (None, 1, 2, 4, 8):
            name = "block" if splits is None else f"block_s{splits}"
            outs[name] = torch.empty_like(p["q"])
            row[f"{name}_us"] = event_us(lambda: run_block(p, outs[name], splits))
        row["block_warps"] = warps_for(query_rows(block, hq // hkv), d)
        if d > 128:  # the wide heads' tile at either warp count, half the accumulator a thread at 8
            for warps in (4, 8):
                outs[f"block_w{warps}"] = torch.empty_like(p["q"])
                row[f"block_w{warps}_us"] = event_us(lambda: run_block(p, outs[f"block_w{warps}"], None, warps))
        ref = reference(p)
        for name, o in outs.items():
            row[f"{name}_max_err_vs_f64"] = float((o.double() - ref).abs().max())
            if name != "extend":
                row[f"{name}_max_diff_vs_extend"] = float((o.float() - o_ext.float()).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump({"device": torch.cuda.get_device_name(), "heads": list(heads), "block": block, "rows": rows},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
