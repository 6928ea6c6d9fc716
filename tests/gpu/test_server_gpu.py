"""GPU: the plugin's DFLASH server is lossless against plain decoding on the same tiny models.

Run on a GPU machine (SGLang 0.5.17 importable):  pytest -m gpu tests/gpu -x
``DFLASH_GPU_RESULTS`` names a folder for the JSON evidence (default: a temp dir).

Servers start one at a time; each runs a fixed workload whose outputs are cached for the tests.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from functools import lru_cache

import pytest
import torch

from benchmark_sglang import Server, ServerSpec, get_json, kv_loads, post_json, run_requests

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.environ.get("DFLASH_GPU_RESULTS") or tempfile.mkdtemp(prefix="dflash-gpu-")
os.makedirs(RESULTS, exist_ok=True)
N_PROMPTS, NEW_TOKENS = int(os.environ.get("DFLASH_LOSSLESS_PROMPTS", 200)), 128
NEAR_TIE_NATS = 0.1  # a bf16 flip is excused only when the top-2 log-probs are this close
COMMON = ["--attention-backend", "triton", "--grammar-backend", "none", "--disable-piecewise-cuda-graph",
          "--cuda-graph-max-bs", "32", "--mem-fraction-static", "0.3", "--max-running-requests", "64",
          "--log-level", "warning"]


@lru_cache(maxsize=None)
def tiny_pair():
    out = os.environ.get("DFLASH_TINY_DIR") or tempfile.mkdtemp(prefix="dflash-tiny-")
    if not os.path.exists(os.path.join(out, "draft", "model.safetensors")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_pair.py"), out], check=True)
    with open(os.path.join(out, "draft", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return os.path.join(out, "target"), os.path.join(out, "draft"), vocab


def prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(8, 64))] for _ in range(n)]


def greedy(ids, max_new=NEW_TOKENS, **extra):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **extra}}


def stop_workload(vocab):
    """Stops and budgets that fall inside blocks: token 0 (the magnet) is drafted and emitted often."""
    work = []
    for i, ids in enumerate(prompts(32, vocab, seed=7)):
        work.append(greedy(ids, max_new=5 + i, stop_token_ids=[0]))
        work.append(greedy(ids, max_new=3 + 2 * i))
    for i, ids in enumerate(prompts(12, vocab, seed=8)):
        work.append({"input_ids": ids, "sampling_params": {"max_new_tokens": 64, "temperature": 0, "stop": ["e", "in"]}})
    return work


def server_spec(impl, dtype, block=16, extra=()):
    target, draft, _ = tiny_pair()
    # float32 needs SGLang's torch RMSNorm (its CUDA kernel has no fp32 path): same for every impl.
    fp32 = dtype == "float32"
    env = {"SGLANG_DFLASH_FP32_NORM": "1"} if fp32 else {}
    graphs = ["--cuda-graph-max-bs", "8"] if fp32 else []  # fp32 capture of 32 sizes stalled once
    return ServerSpec(impl, target, draft if impl != "ar" else None, block if impl != "ar" else None,
                      COMMON + ["--dtype", dtype, *graphs, *extra], env)


@lru_cache(maxsize=None)
def collect(impl, dtype="float32", block=16, extra=(), want=("greedy", "stops", "sampling")):
    """Start one server, run the workloads named in ``want``, stop it; returns the outputs."""
    target, draft, vocab = tiny_pair()
    spec = server_spec(impl, dtype, block, extra)
    log = os.path.join(RESULTS, f"server-{impl}-{dtype}-b{block}{'-'.join(extra)}.log")
    out = {}
    with Server(spec, log_path=log, timeout_s=600) as server:
        if "greedy" in want:
            res, wall = run_requests(server.url, [greedy(p) for p in prompts(N_PROMPTS, vocab)], 32)
            out["greedy"] = res
            out["greedy_wall_s"] = wall
        if "stops" in want:
            out["stops"], _ = run_requests(server.url, stop_workload(vocab), 16)
        if "sampling" in want:
            sample = {"input_ids": prompts(1, vocab, seed=3)[0],
                      "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.95}}
            out["sampling"], _ = run_requests(server.url, [sample] * 400, 64)
        out["loads_after"] = kv_loads(server.url)
        out["server_info"] = get_json(server.url + "/server_info")
    return out


def ids(results):
    assert all(r.ok for r in results), next(r.error for r in results if not r.ok)
    return [r.output_ids for r in results]


def save(name, payload):
    with open(os.path.join(RESULTS, name), "w") as f:
        json.dump(payload, f, indent=1)


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------


def test_triton_kernels_match_reference():
    from sglang_dflash.ops import accept_block, prepare_block
    from sglang_dflash.reference import accept_block as ref_accept

    g = torch.Generator().manual_seed(0)
    for B in (2, 4, 8, 16):
        bs = 37
        cand = torch.randint(0, 3, (bs, B), generator=g).cuda()
        tgt = torch.randint(0, 3, (bs, B), generator=g).cuda()
        pre = torch.randint(0, 100, (bs,), generator=g).cuda()
        outs = [torch.empty(bs, dtype=torch.int32, device="cuda"), torch.empty(bs, dtype=torch.int32, device="cuda"),
                torch.empty(bs, dtype=torch.int64, device="cuda"), torch.empty((bs, B), dtype=torch.int64, device="cuda"),
                torch.empty(bs, dtype=torch.int64, device="cuda")]
        accept_block(cand, tgt, pre, *outs)
        ref = ref_accept(cand.cpu(), tgt.cpu())
        assert outs[0].cpu().tolist() == ref.accept_len.tolist()
        assert outs[2].cpu().tolist() == ref.bonus.tolist()
        assert (outs[4].cpu() == pre.cpu() + ref.commit_len).all()
        for r in range(bs):
            n = int(ref.commit_len[r])
            assert outs[3][r, :n].cpu().tolist() == ref.out_tokens[r, :n].tolist()

        req_to_token = torch.arange(20 * 400, device="cuda").view(20, 400)
        slots = torch.randperm(20, generator=g)[:bs % 20 + 1].cuda()
        n = slots.numel()
        bonus, lens = torch.randint(0, 99, (n,)).cuda(), torch.randint(0, 300, (n,)).cuda()
        blk, pos, loc = (torch.empty((n, B), dtype=torch.int64, device="cuda") for _ in range(3))
        prepare_block(bonus, lens, slots, req_to_token, 7, blk, pos, loc)
        for r in range(n):
            assert blk[r].tolist() == [int(bonus[r])] + [7] * (B - 1)
            assert pos[r].tolist() == list(range(int(lens[r]), int(lens[r]) + B))
            assert loc[r].tolist() == req_to_token[slots[r], lens[r]:lens[r] + B].tolist()


def test_greedy_lossless_fp32_block16():
    plugin = collect("plugin")
    ar = collect("ar")
    got, want = ids(plugin["greedy"]), ids(ar["greedy"])
    mismatches = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    verify = sum(r.spec_verify_ct for r in plugin["greedy"])
    tokens = sum(r.completion_tokens for r in plugin["greedy"])
    save("lossless_fp32.json", {
        "prompts": len(want), "new_tokens": NEW_TOKENS, "dtype": "float32", "block_size": 16,
        "mismatches": len(mismatches), "mismatch_prompts": mismatches[:20],
        "accept_length": tokens / max(verify, 1), "plugin_kv_after": plugin["loads_after"], "ar_kv_after": ar["loads_after"],
    })
    assert len(want) == N_PROMPTS and all(0 < len(w) <= NEW_TOKENS for w in want)  # EOS may end a request early
    assert not mismatches, f"{len(mismatches)} prompts differ, first {mismatches[:5]}"
    assert tokens / verify > 1.2  # the magnet drafts really get accepted in multi-token blocks


def test_stops_and_budgets_inside_blocks_fp32():
    plugin, ar = collect("plugin"), collect("ar")
    got, want = plugin["stops"], ar["stops"]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.ok and w.ok, (g.error, w.error)
        assert g.output_ids == w.output_ids, f"request {i}"
        assert g.text == w.text
        assert g.meta.get("finish_reason") == w.meta.get("finish_reason"), i


@pytest.mark.parametrize("block, extra", [(4, ()), (8, ("--disable-overlap-schedule",))])
def test_greedy_lossless_other_blocks_and_sync_scheduler(block, extra):
    plugin = collect("plugin", block=block, extra=extra, want=("greedy",))
    ar = collect("ar")
    got, want = ids(plugin["greedy"]), ids(ar["greedy"])
    mismatches = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    save(f"lossless_fp32_b{block}.json", {"block_size": block, "extra": list(extra), "mismatches": len(mismatches)})
    assert not mismatches


def test_temperature_sampling_follows_target_distribution():
    plugin, ar = collect("plugin"), collect("ar")
    tv = []
    for pos in range(1, 6):  # position 0 comes from prefill in both
        a = Counter(r.output_ids[pos] for r in ar["sampling"] if len(r.output_ids) > pos)
        b = Counter(r.output_ids[pos] for r in plugin["sampling"] if len(r.output_ids) > pos)
        na, nb = sum(a.values()), sum(b.values())
        tv.append(0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b)))
    save("sampling_tv.json", {"samples": 400, "temperature": 1.0, "tv_per_position": tv})
    assert max(tv) < 0.15, tv  # two 400-sample estimates of one distribution


def test_kv_pool_and_slots_back_to_idle():
    plugin, ar = collect("plugin"), collect("ar")
    for run in (plugin, ar):
        loads = run["loads_after"]
        assert loads.get("num_running_reqs") == 0
        assert loads.get("num_used_tokens") == 0, loads


def divergences(url, vocab, got, want):
    """First divergence per prompt, with the AR server's top-2 there (prefix re-run as a prefill)."""
    out = []
    for i, (p, a, b) in enumerate(zip(prompts(N_PROMPTS, vocab), got, want)):
        d = first_divergence(a, b)
        if d is None or d >= min(len(a), len(b)):
            continue
        probe = post_json(url + "/generate", {
            "input_ids": p + b[:d], "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        (lp1, tok1, _), (lp2, tok2, _) = probe["meta_info"]["output_top_logprobs"][0][:2]
        out.append({"prompt": i, "position": d, "ar_decode": b[d], "spec": a[d],
                    "margin_nats": lp1 - lp2, "top2": [tok1, tok2], "spec_in_top2": a[d] in (tok1, tok2)})
    return out


def test_bf16_divergences_sit_on_near_ties():
    """bf16 verify and decode kernels round differently: every divergence must be a near-tie."""
    _, _, vocab = tiny_pair()
    runs = {impl: ids(collect(impl, dtype="bfloat16", want=("greedy",))["greedy"]) for impl in ("plugin", "builtin")}
    with Server(server_spec("ar", "bfloat16"), log_path=os.path.join(RESULTS, "server-ar-bf16.log"), timeout_s=600) as ar:
        res, _ = run_requests(ar.url, [greedy(p) for p in prompts(N_PROMPTS, vocab)], 32)
        want = ids(res)
        report = {impl: divergences(ar.url, vocab, got, want) for impl, got in runs.items()}
    off = {impl: [r for r in rows if r["margin_nats"] > NEAR_TIE_NATS or not r["spec_in_top2"]]
           for impl, rows in report.items()}
    save("lossless_bf16.json", {
        "prompts": N_PROMPTS, "new_tokens": NEW_TOKENS, "near_tie_threshold_nats": NEAR_TIE_NATS,
        **{f"{impl}_divergences": len(rows) for impl, rows in report.items()},
        **{f"{impl}_off_near_tie": len(rows) for impl, rows in off.items()},
        "details": report,
    })
    assert not off["plugin"], off["plugin"][:5]
