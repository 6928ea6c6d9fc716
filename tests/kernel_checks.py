"""Checks of the Triton kernels against the pure-torch reference, on any device.

``tests/test_ops.py`` runs them on CPU through Triton's interpreter; the GPU suite on CUDA.
"""

import torch
from conftest import draft_config_dict

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.adaptive import candidate_widths
from sglang_dflash.ops import accept_block, load_accept_block, norm_rope_split, prepare_block
from sglang_dflash.reference import ReferenceDraft
from sglang_dflash.reference import accept_block as ref_accept


def check_accept(cand: torch.Tensor, tgt: torch.Tensor, pre: torch.Tensor, device: str) -> None:
    """accept_block on ``device`` against reference.accept_block, for one block of candidates."""
    bs, B = cand.shape
    outs = [torch.empty(bs, dtype=torch.int32, device=device), torch.empty(bs, dtype=torch.int32, device=device),
            torch.empty(bs, dtype=torch.int64, device=device), torch.empty((bs, B), dtype=torch.int64, device=device),
            torch.empty(bs, dtype=torch.int64, device=device)]
    accept_block(cand.to(device), tgt.to(device), pre.to(device), *outs)
    accept_len, _, bonus, out_tokens, new_lens = (t.cpu() for t in outs)
    ref = ref_accept(cand, tgt)
    assert accept_len.tolist() == ref.accept_len.tolist()
    assert bonus.tolist() == ref.bonus.tolist()
    assert (new_lens == pre + ref.commit_len).all()
    # Every position holds a valid token (logprobs are gathered at all of them); the first
    # commit_len are the accepted drafts, then the bonus.
    assert out_tokens.tolist() == ref.out_tokens.tolist()
    for r in range(bs):
        n = int(ref.commit_len[r])
        assert out_tokens[r, :n].tolist() == cand[r, 1:n].tolist() + [int(ref.bonus[r])]


def check_block_kernels(device: str) -> None:
    """prepare_block and accept_block against reference.accept_block and the request table."""
    g = torch.Generator().manual_seed(0)
    for B in (1, 4, 8, 16):  # 1: a width-1 step's block, its one position
        bs = 9
        cand, tgt = (torch.randint(0, 3, (bs, B), generator=g) for _ in range(2))
        check_accept(cand, tgt, torch.randint(0, 100, (bs,), generator=g), device)

        req_to_token = torch.arange(20 * 400).view(20, 400)
        slots = torch.randperm(20, generator=g)[:bs]
        bonus_in, lens = torch.randint(0, 99, (bs,), generator=g), torch.randint(0, 300, (bs,), generator=g)
        blk, pos, loc = (torch.empty((bs, B), dtype=torch.int64, device=device) for _ in range(3))
        prepare_block(bonus_in.to(device), lens.to(device), slots.to(device), req_to_token.to(device), 7, blk, pos, loc)
        blk, pos, loc = blk.cpu(), pos.cpu(), loc.cpu()
        for r in range(bs):
            assert blk[r].tolist() == [int(bonus_in[r])] + [7] * (B - 1)
            assert pos[r].tolist() == list(range(int(lens[r]), int(lens[r]) + B))
            assert loc[r].tolist() == req_to_token[slots[r], lens[r]:lens[r] + B].tolist()


def check_accept_block_at_every_verify_width(device: str) -> None:
    """load_accept_block builds every verify width's kernel, width 1 (a plain step) included, and
    each then accepts as reference.accept_block does."""
    widths = candidate_widths(16)
    load_accept_block(widths, device)
    g = torch.Generator().manual_seed(1)
    for width in widths:
        cand, tgt = (torch.randint(0, 2, (5, width), generator=g) for _ in range(2))
        check_accept(cand, tgt, torch.randint(0, 100, (5,), generator=g), device)


@torch.no_grad()
def check_context_kv(device: str) -> None:
    """One stacked GEMM + norm_rope_split equals ReferenceDraft.context_kv (k_proj, k_norm, RoPE; v_proj)."""
    torch.manual_seed(0)
    heads, kv_heads, hd, layers = 6, 3, 16, 3
    cfg = DFlashDraftConfig.from_dict(draft_config_dict(
        hidden_size=96, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hd, attention_bias=True,
        dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 1, "block_size": 4}))
    draft = ReferenceDraft(cfg)
    for layer in draft.layers:  # non-trivial norm weights
        layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    ctx = torch.randn(13, cfg.hidden_size)
    positions = torch.tensor([0, 1, 2, 7, 8, 9, 100, 101, 4095, 3, 5, 6, 30])
    attns = [layer.self_attn for layer in draft.layers]
    stacked = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attns])
    bias = torch.cat([torch.cat([a.k_proj.bias, a.v_proj.bias]) for a in attns])
    # The cache SGLang's RotaryEmbedding keeps: one row per position, [cos x hd/2, sin x hd/2].
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    angles = torch.arange(4096, dtype=torch.float)[:, None] * inv_freq
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    norm_w = torch.stack([a.k_norm.weight for a in attns])

    def fused(pos):
        kv = torch.nn.functional.linear(ctx, stacked, bias)
        args = (kv, pos, norm_w, cos_sin)
        k, v = norm_rope_split(*(t.to(device) for t in args), cfg.rms_norm_eps, layers, kv_heads, hd)
        return k.cpu(), v.cpu()

    k, v = fused(positions)
    assert k.shape == v.shape == (layers, 13, kv_heads, hd) and k[1].is_contiguous() and v[2].is_contiguous()
    ref = draft.context_kv(ctx, positions)
    for i, (ref_k, ref_v) in enumerate(ref):
        torch.testing.assert_close(k[i], ref_k, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(v[i], ref_v, atol=1e-5, rtol=1e-5)
    # A wrong position must show: the comparison can fail.
    shifted, _ = fused(positions + 1)
    assert not torch.allclose(shifted[0], ref[0][0], atol=1e-2)


def check_worker_steps_follow_plain_decoding(device: str) -> None:
    """The worker's own accept step (request parameters per position, then the acceptance kernel)
    and its output counts, step after step on the tiny target, for requests with different
    penalties and min_new_tokens in one batch: each gets plain decoding's tokens."""
    worker_steps_follow_plain_decoding(device, widths=None)


def check_worker_steps_at_changing_widths_follow_plain_decoding(device: str) -> None:
    """The same with the verify width drawn anew every step from 8, 4, 2 and 1 (1: a plain decode
    step, the last token alone): the accept step, the per-position penalties and the output counts
    take any width, and a switch between two steps changes no token (adaptive width)."""
    worker_steps_follow_plain_decoding(device, widths=(8, 4, 2, 1))


def worker_steps_follow_plain_decoding(device: str, widths) -> None:
    import random
    from types import SimpleNamespace

    from sglang_dflash.reference import RequestParams, TinyTarget, TinyTargetConfig, target_generate
    from sglang_dflash.sampling import OutputCounts
    from sglang_dflash.draft import DraftBlock, StepBuffers
    from sglang_dflash.worker import DFlashWorker

    target = TinyTarget(TinyTargetConfig(vocab_size=64, logit_scale=8.0), seed=0).eval()
    rng, B, stops, max_new = random.Random(216), 8, [7], 28
    params = [RequestParams(), RequestParams(repetition_penalty=1.6), RequestParams(frequency_penalty=0.9),
              RequestParams(presence_penalty=2.0, min_new_tokens=16),
              RequestParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5, min_new_tokens=6)]
    prompts = [[rng.randrange(60) for _ in range(rng.randrange(3, 10))] for _ in params]
    with torch.no_grad():
        truth = [target_generate(target, p, max_new, stop_ids=stops, params=q) for p, q in zip(prompts, params)]
    worker = object.__new__(DFlashWorker)
    worker.output_counts = OutputCounts(64, device, stop_ids=lambda req: stops)
    reqs = [SimpleNamespace(rid=i, output_ids=[], finished=lambda: False, sampling_params=SimpleNamespace(
        frequency_penalty=q.frequency_penalty, presence_penalty=q.presence_penalty,
        repetition_penalty=q.repetition_penalty, min_new_tokens=q.min_new_tokens)) for i, q in enumerate(params)]
    worker.output_counts.start(reqs)
    for r, t in zip(reqs, truth):
        r.output_ids.append(t[0])  # the prefill's token (SGLang's sampler, fresh penalizers)
    bufs_pool, multi, used = StepBuffers(B, device), 0, set()
    info = SimpleNamespace(logit_bias=None, has_custom_logit_processor=False, is_all_greedy=True)
    def done(r):
        return stops[0] in r.output_ids or len(r.output_ids) >= max_new

    while not all(done(r) for r in reqs):
        live = [i for i, r in enumerate(reqs) if not done(r)]
        batch = SimpleNamespace(reqs=[reqs[i] for i in live], sampling_info=info,
                                seq_lens=torch.tensor([len(prompts[i]) + len(reqs[i].output_ids) - 1 for i in live],
                                                      device=device))
        w = rng.choice(widths) if widths else B
        used.add(w)
        cands, logits = [], []
        for i in live:
            out, k = reqs[i].output_ids, len(reqs[i].output_ids)
            cand = [out[-1]] + [truth[i][k + j] if k + j < len(truth[i]) and rng.random() > 0.15 else 1
                                for j in range(w - 1)]
            with torch.no_grad():
                logits.append(target(torch.tensor(prompts[i] + out[:-1] + cand))[0][-w:])
            cands.append(cand)
        bufs = bufs_pool.take(len(live), batch.seq_lens.dtype, width=w)
        bufs["candidates"].copy_(torch.tensor(cands))
        block = DraftBlock(bufs["candidates"], None, None, None)
        rows = worker.output_counts.batch_rows(batch.reqs)
        acc = DFlashWorker.accept_step(worker, batch, block, torch.cat(logits).to(device), bufs, rows)
        worker.output_counts.commit(rows, block.candidates, acc.commit_len)
        for j, i in enumerate(live):
            n = int(acc.commit_len[j])
            multi += n > 2
            out = reqs[i].output_ids + acc.out_tokens[j, :n].tolist()
            end = out.index(stops[0]) + 1 if stops[0] in out else len(out)
            reqs[i].output_ids = out[: min(end, max_new)]
    for r, t in zip(reqs, truth):
        assert r.output_ids == t
    assert multi > 5 and used == set(widths or [B])


def _block_problem(g: torch.Generator, prefix: torch.Tensor, block: int, q_heads: int, kv_heads: int, dim: int,
                   spare: int = 0):
    """One verify's attention problem: a block of queries and keys per request, and each request's
    prefix in shuffled cache slots (``spare`` of them left unused). Float32, on the CPU."""
    kv_indptr = torch.zeros(len(prefix) + 1, dtype=torch.int32)
    kv_indptr[1:] = prefix.cumsum(0)
    slots = int(prefix.sum()) + spare
    kv_indices = torch.randperm(slots, generator=g)[: int(prefix.sum())]
    tokens = len(prefix) * block
    q = torch.randn(tokens, q_heads, dim, generator=g)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=g) for _ in range(2))
    kc, vc = (torch.randn(slots, kv_heads, dim, generator=g) for _ in range(2))
    return q, k, v, kc, vc, kv_indptr, kv_indices


def check_refused_tile(device: str) -> None:
    """A float32 64 x 256 query tile (the Qwen3.5-4B's block 16) needs 256 KB of shared memory a
    program: a Hopper GPU (227 KB) refuses it as TileTooLarge before writing anything, the tile is
    then declined (``fits``), and the bf16 tile of the same shape still runs and matches. Where the
    device has room (the interpreter), the float32 tile must match the reference instead."""
    from sglang_dflash.ops import block_attention
    from sglang_dflash.ops.block_attention import _REFUSED, TileTooLarge, fits
    from sglang_dflash.reference import block_attention as ref_block_attention

    block, q_heads, kv_heads, dim = 16, 16, 4, 256
    q, k, v, kc, vc, kv_indptr, kv_indices = _block_problem(
        torch.Generator().manual_seed(1), torch.tensor([40, 7]), block, q_heads, kv_heads, dim)
    tokens = q.shape[0]
    room = (torch.cuda.get_device_properties(device).shared_memory_per_block_optin
            if device == "cuda" else None)
    _REFUSED.clear()
    for dtype in (torch.float32, torch.bfloat16 if device == "cuda" else torch.float16):
        args = [t.to(device, dtype) for t in (q, k, v)]
        o = torch.full((tokens, q_heads, dim), 7.0, device=device, dtype=dtype)
        cache = [t.to(device, dtype) for t in (kc, vc)]
        try:
            block_attention(*args, o, *cache, kv_indptr.to(device), kv_indices.to(device), block, dim ** -0.5, True)
        except TileTooLarge:
            assert dtype == torch.float32 and room is not None, (dtype, room)
            assert not fits(block, q_heads // kv_heads, dim, dtype) and fits(block, q_heads // kv_heads, dim, torch.bfloat16)
            assert bool((o == 7.0).all()), "a refused launch wrote its output"
            print(f"float32 64 x 256 tile refused ({room // 1024} KB of shared memory a block)")
            continue
        assert dtype != torch.float32 or room is None or room >= 256 * 1024, f"not refused with {room} bytes"
        want = ref_block_attention(q.to(dtype), k.to(dtype), v.to(dtype), kc.to(dtype), vc.to(dtype),
                                   kv_indptr, kv_indices, block, dim ** -0.5, True)
        err = (o.double().cpu() - want).abs().max().item()
        assert err < (1e-5 if dtype == torch.float32 else 3e-2), (dtype, err)
    _REFUSED.clear()


def check_fp8_head(device: str) -> None:
    """The fp8 draft head's logits are the GEMM of its fp8 operands, and its argmax that of the
    16-bit head up to fp8's near-ties."""
    from sglang_dflash.ops.fp8 import Fp8RowwiseLinear, quantize_rows

    torch.manual_seed(0)
    weight = torch.randn(4096, 256, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(45, 256, device=device, dtype=torch.bfloat16)  # bs 3 x 15: not a multiple of 16
    assert Fp8RowwiseLinear.eligible(weight) is None
    head = Fp8RowwiseLinear(weight)
    logits = head(hidden)
    qw, sw = quantize_rows(weight)
    qx, sx = quantize_rows(hidden)
    ref = (qx.float() * sx) @ (qw.float() * sw).T
    torch.testing.assert_close(logits.float(), ref, atol=0.05, rtol=0.02)
    exact = hidden.float() @ weight.float().T
    agree = (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    # A wrong scale must show: the comparison can fail.
    assert not torch.allclose(logits.float() * 1.1, ref, atol=0.05, rtol=0.02)


def check_draft_vocab_head_in_graph(device: str) -> None:
    """The greedy head over part of the vocabulary inside a CUDA graph: a rebuild between replays
    changes the rows and ids the replay reads (16-bit and fp8 heads alike)."""
    from types import SimpleNamespace

    from sglang_dflash import draft as draft_mod

    saved = draft_mod.get_tp_group, draft_mod.get_parallel
    draft_mod.get_tp_group = lambda: SimpleNamespace(world_size=1)  # one rank, no process group
    draft_mod.get_parallel = lambda: SimpleNamespace(tp_rank=0)
    try:
        _check_draft_vocab_head_in_graph(draft_mod, device)
    finally:
        draft_mod.get_tp_group, draft_mod.get_parallel = saved


def _check_draft_vocab_head_in_graph(draft_mod, device: str) -> None:
    from types import SimpleNamespace

    torch.manual_seed(0)
    weight = torch.randn(8192, 256, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(3 * 16, 256, device=device, dtype=torch.bfloat16)
    slots = hidden.view(3, 16, -1)[:, 1:].reshape(45, -1)
    for fp8 in (False, True):
        head = draft_mod.GreedyDraftHead(SimpleNamespace(weight=weight), 16, max_bs=3, fp8=fp8, vocab_rows=1024)
        assert head.vocab is not None and (head.fp8 is not None) == fp8
        out = torch.zeros(45, dtype=torch.int64, device=device)
        head(hidden)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(head(hidden))
        graph.replay()
        first = out.clone()
        assert first.max() < 1024 and torch.equal(first, head(hidden))
        head.observe(torch.arange(4096, 8192, 4, device=device).repeat(2))  # 2,048 counted: due
        head.maybe_rebuild()
        ids = head.vocab.ids
        assert head.vocab.rebuilds == 1 and ids.min() == 4096
        graph.replay()
        assert out.min() >= 4096 and torch.equal(out, head(hidden))
        if fp8:  # the fp8 copy was refilled from the new rows: its argmax is theirs up to near-ties
            exact = ids[(slots.float() @ weight[ids].float().T).argmax(-1)]
            assert (out == exact).float().mean().item() >= 0.8
        else:
            assert torch.equal(out, ids[(slots @ weight[ids].T).argmax(-1)])


def check_block_attention(device: str) -> None:
    """ops.block_attention against reference.block_attention: GQA groups of 1, 2, 4 and 8 (heads of 64,
    and of 256 for a 128 x 256 tile at 8 warps), blocks of 16, 5 and 2, causal and not, 1 to 4 prefix
    splits, empty and short prefixes, shuffled slots,
    float32 and a half type (bfloat16 on CUDA; float16 in the interpreter, which has no bfloat16 dot)."""
    from sglang_dflash.ops import block_attention, block_attention_by_table
    from sglang_dflash.reference import block_attention as ref_block_attention

    g = torch.Generator().manual_seed(0)
    half = torch.bfloat16 if device == "cuda" else torch.float16
    cases = [(16, 8, 2, True, 1, torch.float32, 64), (16, 8, 2, False, 3, torch.float32, 64),
             (5, 4, 1, True, 2, torch.float32, 64), (2, 4, 4, True, 4, torch.float32, 64),
             (16, 8, 2, True, 2, half, 64), (16, 8, 2, False, 1, half, 64),
             (16, 8, 1, True, 2, half, 256)]  # a 128 x 256 query tile: 8 warps (ops.block_attention.warps_for)
    for block, q_heads, kv_heads, causal, splits, dtype, dim in cases:
        prefix = torch.tensor([0, 1, 70, 33])
        q, k, v, kc, vc, kv_indptr, kv_indices = _block_problem(g, prefix, block, q_heads, kv_heads, dim, spare=10)
        tokens, slots = q.shape[0], kc.shape[0]
        o = torch.zeros(tokens, q_heads, dim)
        args = [t.to(device, dtype) for t in (q, k, v, o, kc, vc)]
        block_attention(*args, kv_indptr.to(device), kv_indices.to(device), block, dim ** -0.5, causal, splits=splits)
        want = ref_block_attention(*(t.to(dtype) for t in (q, k, v, kc, vc)), kv_indptr, kv_indices, block,
                                   dim ** -0.5, causal)
        err = (args[3].double().cpu() - want).abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert err < tol, (block, q_heads, kv_heads, causal, splits, dtype, dim, err)

        # The same keys through the request table, the block's K/V written to the cache after each prefix.
        width = int(prefix.max()) + block + 3
        table = torch.randperm(20 * width, generator=g).view(20, width) % (slots + tokens)
        pool_rows = torch.randperm(20, generator=g)[: len(prefix)]
        kc2, vc2 = torch.cat([kc, torch.zeros(tokens, kv_heads, dim)]), torch.cat([vc, torch.zeros(tokens, kv_heads, dim)])
        for b, n in enumerate(prefix.tolist()):
            table[pool_rows[b], :n] = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
            table[pool_rows[b], n:n + block] = slots + b * block + torch.arange(block)
        kc2[slots:], vc2[slots:] = k, v
        o2 = torch.zeros(tokens, q_heads, dim, device=device, dtype=dtype)
        block_attention_by_table(q.to(device, dtype), o2, kc2.to(device, dtype), vc2.to(device, dtype),
                                 table.to(device), pool_rows.to(device), prefix.to(device), block, dim ** -0.5, causal,
                                 splits=splits)
        err = (o2.double().cpu() - want).abs().max().item()
        assert err < tol, ("by table", block, q_heads, kv_heads, causal, splits, dtype, dim, err)
        # The same products in the same order: the route may switch between the two without a token changing.
        assert torch.equal(o2, args[3]), ("by table differs", block, causal, splits, dtype)
