"""CPU checks of the worker's host-side bookkeeping (the GPU suite runs the worker itself)."""

import random
from collections import Counter
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import draft_config_dict

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.host_pauses import StepStalls
from sglang_dflash.reference import ReferenceDraft
from sglang_dflash.draft import DraftRing, DraftWindow, StepBuffers
from sglang_dflash.context import extend_positions
from sglang_dflash.worker import mamba_track_steps


def test_step_buffers_alternate_so_a_step_never_overwrites_the_previous_results():
    bufs = StepBuffers(block_size=4, device="cpu")
    first = bufs.take(3, torch.int64)
    second = bufs.take(3, torch.int64)
    third = bufs.take(3, torch.int64)
    for name in ("block_ids", "candidates", "out_tokens", "bonus", "commit_len", "new_seq_lens"):
        assert first[name].data_ptr() != second[name].data_ptr()  # step N+1 writes elsewhere
        assert first[name].data_ptr() == third[name].data_ptr()  # step N+2 reuses step N's set
    assert first["out_tokens"].shape == (3, 4) and first["accept_len"].dtype == torch.int32
    assert first["block_ids"].is_contiguous() and first["new_seq_lens"].dtype == torch.int64


def test_step_buffers_grow_with_the_batch_and_follow_the_seq_len_dtype():
    bufs = StepBuffers(block_size=2, device="cpu")
    small = bufs.take(2, torch.int64)
    bufs.take(2, torch.int64)
    big = bufs.take(40, torch.int64)
    assert big["positions"].shape == (40, 2) and big["positions"].data_ptr() != small["positions"].data_ptr()
    assert bufs.take(1, torch.int32)["new_seq_lens"].dtype == torch.int32


def test_a_width_one_plain_accept_commits_what_the_accept_kernel_would_without_launching_it(monkeypatch):
    """Width 1, greedy and nothing per position: ``accept_decoded`` commits the argmax (ties as
    the kernel's argmax breaks them) with the kernel's lengths; anything else keeps the kernel."""
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.draft import DraftBlock
    from sglang_dflash.worker import DFlashWorker

    bs, vocab = 5, 11
    worker = object.__new__(DFlashWorker)
    worker.stalls, worker.buffers = StepStalls(), StepBuffers(4, "cpu")
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(3))
    logits[2, 3] = logits[2, 7] = logits[2].max() + 1  # a tie
    batch = SimpleNamespace(sampling_info=None, seq_lens=torch.tensor([3, 9, 4, 100, 7]))
    block = lambda bufs: DraftBlock(bufs["candidates"].copy_(torch.arange(bs)[:, None] + 40), None, None, None)  # noqa: E731
    launched = []
    monkeypatch.setattr(worker_mod, "accept_block", lambda *args: launched.append(torch_accept_block(*args)))
    bufs = worker.buffers.take(bs, torch.int64, 1)
    kernel = DFlashWorker.accept_step(worker, batch, block(bufs), logits.clone(), bufs)
    assert len(launched) == 1
    bufs = worker.buffers.take(bs, torch.int64, 1)
    plain = DFlashWorker.accept_step(worker, batch, block(bufs), logits.clone(), bufs, plain=True)
    assert len(launched) == 1 and plain.out_tokens[2, 0] == 3
    for name in ("accept_len", "commit_len", "bonus", "out_tokens", "new_seq_lens"):
        assert torch.equal(getattr(plain, name), getattr(kernel, name)), name
    assert plain.commit_len.dtype == kernel.commit_len.dtype and plain.out_tokens.shape == (bs, 1)
    bufs = worker.buffers.take(bs, torch.int64, 2)  # two candidates: the kernel, plain or not
    DFlashWorker.accept_step(worker, batch, DraftBlock(bufs["candidates"].zero_(), None, None, None),
                             torch.randn(bs * 2, vocab), bufs, plain=True)
    assert len(launched) == 2


def test_a_narrower_verify_gets_dense_rows_and_the_block_keeps_its_width():
    bufs = StepBuffers(block_size=8, device="cpu")
    narrow = bufs.take(3, torch.int64, width=2)
    assert narrow["candidates"].shape == narrow["out_tokens"].shape == (3, 2)
    assert narrow["candidates"].is_contiguous() and narrow["out_tokens"].is_contiguous()  # kernels read rows of 2
    assert narrow["block_ids"].shape == narrow["positions"].shape == (3, 8)  # the draft still proposes 8
    assert bufs.take(3, torch.int64)["candidates"].shape == (3, 8)
    with pytest.raises(ValueError, match="outside 1..8"):
        bufs.take(3, torch.int64, width=9)


def test_prefill_positions_continue_each_requests_cached_prefix():
    got = extend_positions(prefix_lens=[0, 5, 2], extend_lens=[3, 2, 4], device="cpu")
    assert got.tolist() == [0, 1, 2, 5, 6, 2, 3, 4, 5]
    assert got.dtype == torch.int64
    assert extend_positions([7], [0], "cpu").numel() == 0


# ---- hybrid targets: which verify step's recurrent state becomes the radix checkpoint --------


def pre_verify_length_rule(seq_lens, commit_len, interval):
    """SGLang 0.5.17's built-in rule (upstream issue 37817): the crossing is judged on the length
    before the verify advanced it, so it never fires."""
    crossed = seq_lens // interval != seq_lens // interval
    step = torch.clamp(seq_lens // interval * interval - seq_lens - 1, min=0)
    return torch.where(crossed & (step < commit_len), step, torch.full_like(step, -1))


def checkpoints_of_a_decode(track_steps, interval=32, block=16, steps=300, seed=0):
    """Decode one request with random commit lengths. The recurrent state after verify step i is
    stood in for by its token count, ``seq_len + i + 1``; the track slot receives the state of the
    step that ``track_steps`` names. Returns, for every boundary the scheduler marks as
    checkpointed (its own test: the committed length crossed a multiple of the interval), the
    pair (checkpoint length, what the track slot holds)."""
    rng = random.Random(seed)
    seq_len, slot, marked = 37, None, []
    for _ in range(steps):
        commit = rng.randint(1, block)
        step = int(track_steps(torch.tensor([seq_len]), torch.tensor([commit], dtype=torch.int32), interval)[0])
        if step >= 0:
            assert step < commit, "a rejected step's state must never be checkpointed"
            slot = seq_len + step + 1
        new_len = seq_len + commit
        if seq_len // interval != new_len // interval:
            marked.append((new_len // interval * interval, slot))
        seq_len = new_len
    return marked


@pytest.mark.parametrize("interval, block", [(32, 16), (16, 16), (64, 8)])
def test_every_marked_checkpoint_holds_the_state_at_its_boundary(interval, block):
    marked = checkpoints_of_a_decode(mamba_track_steps, interval, block)
    assert len(marked) >= 15
    assert all(length == held for length, held in marked), marked[:5]


def test_the_pre_verify_length_rule_misses_the_checkpoints():
    """The same check fails on the built-in's rule: it is the test that catches issue 37817."""
    marked = checkpoints_of_a_decode(pre_verify_length_rule)
    assert marked and all(held != length for length, held in marked)


def test_a_one_token_commit_reaches_a_boundary_where_the_track_steps_name_step_zero():
    """The width-1 DECODE's track rule, (seq_len + 1) % interval == 0, is mamba_track_steps at commit length 1."""
    seq = torch.arange(0, 200)
    for interval in (1, 7, 32, 64):
        steps = mamba_track_steps(seq, torch.ones_like(seq, dtype=torch.int32), interval)
        assert set(steps.tolist()) <= {-1, 0}
        assert torch.equal(steps == 0, (seq + 1) % interval == 0)


def test_track_steps_batch_and_no_crossing():
    seq = torch.tensor([30, 32, 10, 63])
    commit = torch.tensor([5, 16, 3, 1], dtype=torch.int32)
    # 30 -> 35 crosses 32 at step 1; 32 -> 48 no; 10 -> 13 no; 63 -> 64 crosses at step 0
    assert mamba_track_steps(seq, commit, 32).tolist() == [1, -1, -1, 0]


# ---- --speculative-draft-window-size --------------------------------------------------------------


def test_draft_window_table_holds_the_last_w_context_slots_then_the_block():
    W, B = 6, 4
    shared = SimpleNamespace(size=5)
    window = DraftWindow(W, B, shared, "cpu")
    req_to_token = torch.arange(6 * 50, dtype=torch.int32).view(6, 50)
    rows, seq_lens = torch.tensor([2, 5, 1]), torch.tensor([20, 3, 6])
    ctx = window.fill(rows, seq_lens, req_to_token)
    assert ctx.tolist() == [6, 3, 6]
    table = window.pool.req_to_token
    for r, s, n in zip(rows.tolist(), seq_lens.tolist(), ctx.tolist()):
        # what the draft's attention reads: n context slots, then the B block slots
        assert table[r, : n + B].tolist() == req_to_token[r, s - n : s + B].tolist()
    assert table[3].eq(0).all()  # rows outside the batch are left alone


@torch.no_grad()
def test_a_compacted_context_equals_the_context_window_mask():
    """The window's premise: attending to only the last W context positions (what the compact
    table gives the kernels) is the reference draft under the ``context_window`` mask, for full
    and sliding layers alike."""
    cfg = DFlashDraftConfig.from_dict(draft_config_dict(
        hidden_size=64, vocab_size=128, layer_types=["full_attention", "sliding_attention"], sliding_window=5,
        dflash_config={"target_layer_ids": [1, 3, 4], "mask_token_id": 127, "block_size": 4},
    ))
    torch.manual_seed(0)
    draft = ReferenceDraft(cfg).eval()
    ctx_len, W = 23, 7
    feats, blk = torch.randn(ctx_len, 3 * 64), torch.randn(4, 64)
    pos = torch.arange(ctx_len, ctx_len + 4)
    masked = draft(blk, pos, feats, torch.arange(ctx_len), draft.layer_masks(torch.tensor([ctx_len]), ctx_len, W))
    recent = torch.arange(ctx_len - W, ctx_len)
    kept = [m[:, ctx_len - W:] for m in draft.layer_masks(torch.tensor([ctx_len]), ctx_len)]
    compact = draft(blk, pos, feats[recent], recent, kept)
    torch.testing.assert_close(compact, masked)
    unwindowed = draft(blk, pos, feats, torch.arange(ctx_len), draft.layer_masks(torch.tensor([ctx_len]), ctx_len))
    assert not torch.allclose(unwindowed, masked)  # the window does change what the draft sees


def test_draft_config_reads_sliding_window_from_the_checkpoint(tmp_path):
    """transformers' Qwen3Config drops ``sliding_window`` unless ``use_sliding_window`` is set;
    the layer types still name sliding layers, so the checkpoint's own file must win."""
    import json

    from transformers import Qwen3Config

    from sglang_dflash.model import _draft_config

    raw = draft_config_dict(layer_types=["sliding_attention", "full_attention"], sliding_window=256)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    hf._name_or_path = str(tmp_path)
    assert hf.to_dict().get("sliding_window") is None  # what SGLang hands the model
    cfg = _draft_config(hf)
    assert cfg.sliding_window == 256 and cfg.layer_types[0] == "sliding_attention"


def test_request_params_in_plain_decodings_order(monkeypatch):
    """Penalties, then logit bias, then custom processors, as SGLang's sampler orders them: a
    repetition penalty must not scale the bias, and a processor sees the biased logits."""
    import sglang.srt.layers.sampler as sampler
    from sglang_dflash.sampling import OutputCounts
    from sglang_dflash.worker import DFlashWorker

    bs, B, V = 2, 3, 6
    seen = []
    monkeypatch.setattr(sampler, "apply_custom_logit_processor",
                        lambda logits, info, num_tokens_in_batch: seen.append((logits.clone(), num_tokens_in_batch)))
    worker = SimpleNamespace(output_counts=OutputCounts(V, "cpu", stop_ids=lambda req: ()))
    req = SimpleNamespace(rid="a", output_ids=[4], finished=lambda: False, sampling_params=SimpleNamespace(
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=2.0, min_new_tokens=0))
    plain = SimpleNamespace(rid="b", output_ids=[], finished=lambda: False, sampling_params=SimpleNamespace(
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0))
    worker.output_counts.start([req, plain])
    rows = worker.output_counts.batch_rows([req, plain])
    bias = torch.zeros(bs, V)
    bias[:, 4] = 2.0
    info = SimpleNamespace(logit_bias=bias, has_custom_logit_processor=True)
    logits = torch.full((bs, B, V), 4.0)
    candidates = torch.tensor([[1, 2, 3], [1, 2, 3]])
    DFlashWorker.apply_request_params(worker, logits, candidates, info, rows)
    assert logits[0, :, 4].tolist() == [4.0] * B  # 4 / 2 + 2, not (4 + 2) / 2
    assert logits[1, :, 4].tolist() == [6.0] * B and logits[0, :, 0].tolist() == [4.0] * B
    assert len(seen) == 1 and seen[0][1] == B and torch.equal(seen[0][0], logits.view(bs * B, V))


@pytest.mark.parametrize("top_k", [False, True])
def test_each_verify_position_samples_with_its_requests_seed_and_its_position(monkeypatch, top_k):
    """Row k of request i is drawn with request i's seed at position seq_len + k, through the
    same SGLang function plain decoding would use: so a seeded request gets plain decoding's
    tokens. Without top-k/top-p/min-p SGLang draws from the probabilities directly."""
    import sglang_dflash.worker as worker

    calls = []
    monkeypatch.setattr(worker, "sampling_from_probs_torch",
                        lambda probs, sampling_seed, positions: calls.append(("simple", probs, sampling_seed, positions))
                        or probs.argmax(-1))
    monkeypatch.setattr(worker, "top_k_top_p_min_p_sampling_from_probs_torch",
                        lambda probs, ks, ps, mps, need_min_p, seed, positions:
                        calls.append(("top_k", probs, seed, positions, ks)) or probs.argmax(-1))
    bs, B, V = 2, 4, 5
    info = SimpleNamespace(temperatures=torch.tensor([[0.5], [2.0]]), sampling_seed=torch.tensor([11, 22]),
                           need_top_p_sampling=False, need_top_k_sampling=top_k, need_min_p_sampling=False,
                           top_ks=torch.tensor([3, 1]), top_ps=torch.ones(2), min_ps=torch.zeros(2))
    logits = torch.randn(bs * B, V)
    positions = torch.tensor([40, 41, 42, 43, 7, 8, 9, 10])
    worker.sample_per_position(logits, info, positions, B)
    (kind, probs, seed, pos, *rest), = calls
    assert kind == ("top_k" if top_k else "simple")
    assert seed.tolist() == [11] * B + [22] * B and torch.equal(pos, positions)
    temps = torch.tensor([0.5] * B + [2.0] * B)[:, None]
    torch.testing.assert_close(probs, torch.softmax(logits / temps, -1))
    if top_k:
        assert rest[0].tolist() == [3] * B + [1] * B


@pytest.mark.parametrize("seeded", [False, True])
def test_unseeded_verify_rows_sample_through_plain_decodings_kernels_and_seeded_ones_through_torch(monkeypatch, seeded):
    """On SGLang's flashinfer sampling backend plain decoding draws an unseeded top-k/top-p sample
    with FlashInfer's kernels; the verify rows go through the same ones, each position with its
    request's parameters, instead of a sort of the whole vocabulary per row (bs x B rows a step:
    SmolLM2 under a c64 load of mixed parameters read width 16 at 2.6x width 8's call time at bs 64).
    A seeded request keeps the torch path, the only one that draws plain decoding's seeded tokens."""
    import sglang_dflash.worker as worker
    from sglang_dflash.sampling import PlainDecodingKernels

    calls = []
    monkeypatch.setattr(worker, "top_k_top_p_min_p_sampling_from_probs_torch",
                        lambda probs, *args: calls.append(("torch",)) or probs.argmax(-1))

    def joint(probs, ks, ps, filter_apply_order):
        calls.append(("joint", probs, ks, ps, filter_apply_order))
        return probs.argmax(-1).to(torch.int32)

    kernels = PlainDecodingKernels(joint, None, None, None)
    bs, B, V = 2, 4, 5
    info = SimpleNamespace(temperatures=torch.tensor([[0.5], [2.0]]),
                           sampling_seed=torch.tensor([11, 22]) if seeded else None,
                           need_top_p_sampling=True, need_top_k_sampling=True, need_min_p_sampling=False,
                           top_ks=torch.tensor([3, 1]), top_ps=torch.tensor([0.9, 1.0]), min_ps=torch.zeros(2))
    logits = torch.randn(bs * B, V)
    tokens = worker.sample_per_position(logits, info, torch.arange(bs * B), B, kernels)
    assert tokens.dtype == torch.int64 and tokens.shape == (bs * B,)
    if seeded:
        assert calls == [("torch",)]
        return
    (kind, probs, ks, ps, order), = calls
    assert kind == "joint" and order == "joint"
    assert ks.tolist() == [3] * B + [1] * B and torch.equal(ps, torch.tensor([0.9] * B + [1.0] * B))
    temps = torch.tensor([0.5] * B + [2.0] * B)[:, None]
    torch.testing.assert_close(probs, torch.softmax(logits / temps, -1))


@pytest.mark.parametrize("chunk_rows", [1, 3, 8])
def test_verify_rows_are_drawn_a_few_thousand_at_a_time_each_with_its_own_seed_and_position(monkeypatch, chunk_rows):
    """A big vocabulary's verify block is drawn in parts, so its float32 probabilities never exist
    whole; a seeded row's token depends on its own seed and position only, so the parts give the
    whole block's tokens."""
    import sglang_dflash.sampling as sampling
    import sglang_dflash.worker as worker

    def seeded(probs, ks, ps, mps, need_min_p, seed, positions):  # a token from (row, seed, position)
        return (probs.argmax(-1) + 7 * seed + 3 * positions) % probs.shape[-1]

    monkeypatch.setattr(worker, "top_k_top_p_min_p_sampling_from_probs_torch", seeded)
    bs, B, V = 2, 4, 5
    info = SimpleNamespace(temperatures=torch.tensor([[0.5], [2.0]]), sampling_seed=torch.tensor([11, 22]),
                           need_top_p_sampling=True, need_top_k_sampling=False, need_min_p_sampling=False,
                           top_ks=torch.tensor([3, 1]), top_ps=torch.tensor([0.9, 1.0]), min_ps=torch.zeros(2))
    logits, positions = torch.randn(bs * B, V), torch.tensor([40, 41, 42, 43, 7, 8, 9, 10])
    whole = worker.sample_per_position(logits, info, positions, B)
    monkeypatch.setattr(sampling, "CHUNK_ENTRIES", chunk_rows * V)
    assert torch.equal(worker.sample_per_position(logits, info, positions, B), whole)


def test_plain_decodings_min_p_kernels_run_in_its_order_and_other_backends_keep_the_torch_path():
    from sglang_dflash.sampling import plain_decoding_kernels

    calls = []
    module = SimpleNamespace(
        top_k_top_p_sampling_from_probs=lambda *a, **k: calls.append("joint"),
        top_k_renorm_prob=lambda probs, ks: calls.append("top_k_renorm") or probs * 2,
        top_p_renorm_prob=lambda probs, ps: calls.append("top_p_renorm") or probs + 1,
        min_p_sampling_from_probs=lambda probs, mps: calls.append(("min_p", probs.tolist())) or probs)
    kernels = plain_decoding_kernels("flashinfer", module)
    kernels.sample(torch.ones(1, 2), torch.ones(1), torch.ones(1), torch.ones(1), need_min_p=True)
    assert calls == ["top_k_renorm", "top_p_renorm", ("min_p", [[3.0, 3.0]])]
    assert plain_decoding_kernels("pytorch", module) is None and plain_decoding_kernels(None, module) is None
    del module.min_p_sampling_from_probs  # a build whose sampler holds no FlashInfer (CPU)
    assert plain_decoding_kernels("flashinfer", module) is None


def test_logprobs_of_the_committed_tokens_come_from_their_own_verify_rows():
    """The worker fills logprobs through SGLang's own function (compute_spec_logprobs from 0.5.18,
    EAGLE's compute_spec_v2_logprobs on 0.5.17): token j of request i scores in row i*B + j of the
    adjusted logits, top-k and chosen ids included."""
    from sglang_dflash import compat

    release = compat.running()
    bs, B, V = 2, 4, 7
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(bs * B, V, generator=g)
    tokens = torch.randint(0, V, (bs, B), generator=g)
    batch = SimpleNamespace(seq_lens=torch.zeros(bs), return_logprob=True, top_logprobs_nums=[2, 0],
                            token_ids_logprobs=[None, [1, 5]],
                            sampling_info=SimpleNamespace(is_all_greedy=True, temperatures=torch.ones(bs, 1)))
    out = SimpleNamespace(next_token_logits=logits)
    release.fill_logprobs(batch, out, tokens, B)
    logprobs = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.next_token_logprobs, logprobs.gather(1, tokens.view(-1, 1)).view(bs, B))
    top_val, top_idx = out.next_token_top_logprobs_val, out.next_token_top_logprobs_idx
    best = logprobs[:B].topk(2)
    assert [list(map(int, row)) for row in top_idx[:B]] == best.indices.tolist()
    torch.testing.assert_close(torch.stack([torch.as_tensor(v) for v in top_val[:B]]), best.values)
    ids_val = out.next_token_token_ids_logprobs_val
    torch.testing.assert_close(torch.stack([torch.as_tensor(v) for v in ids_val[B:]]), logprobs[B:, [1, 5]])


# ---- adaptive width (SGLANG_DFLASH_WIDTHS): the worker's side on the CPU -------------------------


def narrow_worker(monkeypatch, B=8):
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.worker import DFlashWorker

    def prepare_block(bonus, prefix_lens, req_pool_indices, req_to_token, mask_id, block_ids, positions, cache_loc):
        offs = torch.arange(block_ids.shape[1])
        block_ids.fill_(mask_id)
        block_ids[:, 0] = bonus
        positions.copy_(prefix_lens[:, None] + offs)
        cache_loc.copy_(req_to_token[req_pool_indices[:, None], positions])

    monkeypatch.setattr(worker_mod, "prepare_block", prepare_block)
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.block_size, worker.mask_token_id, worker.window, worker.context_in_graph = B, 99, None, None
    worker.hybrid = False
    worker.model_runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(
        req_to_token=torch.arange(4 * 64).view(4, 64) + 1000))
    worker.draft_calls = 0

    def run_draft(batch, block_ids, positions, cache_loc, seq_lens_cpu):
        worker.draft_calls += 1
        return torch.arange(1, B).repeat(block_ids.shape[0]) + 10 * torch.arange(block_ids.shape[0]).repeat_interleave(B - 1)

    worker.run_draft = run_draft
    batch = SimpleNamespace(seq_lens=torch.tensor([5, 9]), seq_lens_cpu=torch.tensor([5, 9]),
                            req_pool_indices=torch.tensor([2, 0]),
                            spec_info=SimpleNamespace(bonus_tokens=torch.tensor([7, 8])))
    return worker, batch


@pytest.mark.parametrize("width", [8, 4, 1])
def test_a_narrower_step_verifies_the_first_candidates_at_their_own_positions_and_slots(monkeypatch, width):
    from sglang_dflash.worker import DFlashWorker

    worker, batch = narrow_worker(monkeypatch)
    block = DFlashWorker.draft_step(worker, batch, StepBuffers(8, "cpu").take(2, torch.int64, width), width)
    expected = [[7, 1, 2, 3, 4, 5, 6, 7], [8, 11, 12, 13, 14, 15, 16, 17]]
    assert block.candidates.tolist() == [row[:width] for row in expected]
    assert block.positions.tolist() == [5 + i for i in range(width)] + [9 + i for i in range(width)]
    assert block.cache_loc.tolist() == [[1000 + 2 * 64 + 5 + i for i in range(width)], [1000 + 9 + i for i in range(width)]]
    assert block.cache_loc.is_contiguous() and block.seq_lens_bound.tolist() == [13, 17]
    assert worker.draft_calls == (width > 1)  # width 1 is a plain decode step: no draft pass


def test_the_target_runs_a_narrower_block_on_that_widths_backend_and_graphs_then_its_own_again():
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.model_runner = SimpleNamespace(attn_backend="b16", decode_cuda_graph_runner="g16")
    worker.width_pairs = {4: ("b4", "g4")}
    with DFlashWorker.target_at_width(worker, 4):
        assert (worker.model_runner.attn_backend, worker.model_runner.decode_cuda_graph_runner) == ("b4", "g4")
    with pytest.raises(RuntimeError), DFlashWorker.target_at_width(worker, 4):
        raise RuntimeError("a failed verify")
    assert (worker.model_runner.attn_backend, worker.model_runner.decode_cuda_graph_runner) == ("b16", "g16")


def test_the_scheduler_is_shown_every_backend_a_step_runs_on_and_which_need_host_lengths(monkeypatch):
    from sglang_dflash import block_attention_route as route
    from sglang_dflash.worker import DFlashWorker

    class Backend:
        needs_cpu_seq_lens = True

        def __init__(self, unplanned):
            if unplanned is not None:
                self._dflash_replays_unplanned = lambda: unplanned

    target, draft, narrow, planning = Backend(True), Backend(True), Backend(True), Backend(False)
    worker = object.__new__(DFlashWorker)
    worker.model_runner = SimpleNamespace(attn_backend=target)
    worker.draft_model_runner = SimpleNamespace(attn_backend=draft)
    worker.width_pairs, worker.width_one_decodes = {16: (target, "g16"), 8: (narrow, "g8"), 4: (planning, "g4")}, False
    seen = DFlashWorker.spec_v2_attn_backends.fget(worker)
    assert [getattr(b, "backend", b) for b in seen] == [target, draft, narrow, planning]
    assert [b.needs_cpu_seq_lens for b in seen] == [False, False, False, True]
    assert DFlashWorker.host_lengths_copied(worker) == ["Backend"]  # /get_server_info: the one that plans
    worker.width_one_decodes = True  # a width-1 DECODE plans from the host's lengths
    assert DFlashWorker.spec_v2_attn_backends.fget(worker) == (target, draft, narrow, planning)
    assert len(DFlashWorker.host_lengths_copied(worker)) == 4
    worker.width_one_decodes = False
    monkeypatch.setenv("SGLANG_DFLASH_SKIP_HOST_LENGTHS", "0")  # the A/B switch
    assert DFlashWorker.spec_v2_attn_backends.fget(worker) == (target, draft, narrow, planning)
    assert route.as_the_scheduler_sees(Backend(None)).needs_cpu_seq_lens is True  # not routed


def test_the_width_policy_learns_each_step_when_its_accept_lengths_reach_the_host():
    from collections import deque

    from sglang_dflash.step_clock import StepClock
    from sglang_dflash.worker import DFlashWorker

    class Event:
        def __init__(self, t, done=True):
            self.t, self.done = t, done

        def query(self):
            return self.done

        def elapsed_time(self, end):  # as torch's: both ends reached, or RuntimeError
            if not (self.query() and end.query()):
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            return end.t - self.t

    seen = []
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.clock = StepClock()  # torch's reading
    def record_later(width, bs, accept_lens, timing):  # as the policy reads it when it next decides
        seen.append((width, bs, accept_lens, worker.clock.seconds(timing)))

    worker.width_policy = SimpleNamespace(record_later=record_later, steps=7, widths_used=lambda: {8: 5, 1: 2})
    worker.fallback, worker.widths_logged_at = None, 0
    ends = [Event(5.0), Event(17.0), Event(20.0, done=False)]
    worker.steps_in_flight = deque([(8, 2, (None, ends[0]), None), (8, 2, (ends[0], ends[1]), None),
                                    (1, 2, (ends[1], ends[2]), None)])
    DFlashWorker.on_verify_complete_cpu(worker, [1, 1], batch_size=2)  # the first after a prefill: not timed
    DFlashWorker.on_verify_complete_cpu(worker, [3, 0], batch_size=2)  # from the step before's end to its own
    DFlashWorker.on_verify_complete_cpu(worker, [0, 0], batch_size=2)  # its end not reached: no time
    DFlashWorker.on_verify_complete_cpu(worker, [0, 0], batch_size=2)  # nothing in flight (a prefill's)
    assert seen == [(8, 2, [1, 1], None), (8, 2, [3, 0], 0.012), (1, 2, [0, 0], None)]
    assert not worker.steps_in_flight
    assert worker.clock.spare == ends[:2]  # each start event, once read, is recorded again later


def test_a_sleeping_buckets_step_reads_no_request_and_is_not_timed_but_keeps_its_place():
    """A step of a bucket that sleeps (``WidthPolicy.sleeping``) takes full width without reading
    the batch's request ids or asking the fallback, breaks the timing chain, and, in flight, teaches
    its acceptance alone; the awake step after it is timed and learned with its own accept lengths."""
    from collections import deque

    from sglang_dflash.adaptive import ASLEEP, WidthPolicy
    from sglang_dflash.fallback import DraftHealth
    from sglang_dflash.step_clock import StepClock
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.block_size, worker.ragged, worker.widths_logged_at = 16, False, 0
    worker.fallback, worker.width_policy = DraftHealth(), WidthPolicy(16)
    worker.width_policy.asleep[4] = (16, 2, (4, 16, "asleep"), 2.0)  # the policy's step 1 sleeps, step 2 wakes
    learned = []
    worker.width_policy.record_later = lambda *step: learned.append(step)
    worker.clock, worker.steps_in_flight = StepClock(), deque()
    worker.clock.last_end = "the end of the step before"
    worker.clock.stamp = lambda stream: ("start", "end")  # no CUDA here

    assert DFlashWorker.choose_widths(worker, SimpleNamespace(), 4) == (16, ASLEEP)  # no reqs to read
    DFlashWorker.time_step(worker, 16, 4, ASLEEP)
    assert worker.clock.last_end is None and worker.fallback.steps == 0
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid=r) for r in "abcd"])
    width, request_widths = DFlashWorker.choose_widths(worker, batch, 4)  # awake: the fallback is asked
    assert request_widths == (list("abcd"), [width] * 4) and worker.fallback.steps == 1
    DFlashWorker.time_step(worker, width, 4, request_widths)
    DFlashWorker.on_verify_complete_cpu(worker, [3, 0, 1, 2], batch_size=4)
    DFlashWorker.on_verify_complete_cpu(worker, [0, 0, 5, 1], batch_size=4)
    assert learned == [(16, 4, [3, 0, 1, 2], None), (width, 4, [0, 0, 5, 1], ("start", "end"))]
    assert worker.fallback.misses == {"a": 1, "b": 1} and worker.width_policy.choices()["16@4"]["asleep"] == 1
    # the step after a sleeping one is not timed (the chain broke): it holds, and probes nothing
    assert worker.width_policy.choices()["16@4"]["untimed"] == 1 and worker.width_policy.steps == 1


def test_a_step_is_timed_from_the_end_of_the_decode_step_before_and_a_prefill_breaks_the_chain(monkeypatch):
    from collections import deque

    import sglang_dflash.step_clock as clock_mod
    from sglang_dflash.step_clock import StepClock
    from sglang_dflash.worker import DFlashWorker

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream=None):
            self.stream = stream

    monkeypatch.setattr(clock_mod.torch.cuda, "Event", Event)
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.steps_in_flight, worker.clock = deque(), StepClock()
    DFlashWorker.time_step(worker, 16, 4)
    DFlashWorker.time_step(worker, 1, 4)
    (_, _, (start0, end0), _), (_, _, (start1, end1), _) = worker.steps_in_flight
    assert start0 is None and start1 is end0 and worker.clock.last_end is end1
    spare = Event(True)
    worker.clock.spare.append(spare)
    DFlashWorker.time_step(worker, 16, 4)
    assert worker.steps_in_flight[-1][2][1] is spare and not worker.clock.spare  # reused, not made anew
    DFlashWorker.time_step(worker, 16, 4, None, "the step's stream")
    assert worker.clock.last_end.stream == "the step's stream"  # recorded where the step ran
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), is_extend_in_batch=True)
    worker.prefill_step = lambda batch, on_publish: "prefilled"
    worker.pauses = SimpleNamespace(serving=False, mark_serving=lambda: setattr(worker.pauses, "serving", True))
    assert DFlashWorker.forward_batch_generation(worker, batch) == "prefilled" and worker.clock.last_end is None
    assert worker.pauses.serving  # from the first request on, full collections count as serving ones


def test_prefills_replayed_from_sglangs_prefill_graphs_are_counted():
    """SGLang's breakable prefill graphs are on by default (0.5.17-0.5.23); /get_server_info says how
    many of the target's prefills, which the draft context is written from, ran from them."""
    from sglang_dflash.worker import DFlashWorker

    written = []
    worker = object.__new__(DFlashWorker)
    worker.device, worker.prefills, worker.prefills_in_graphs, worker.window = "cpu", 0, 0, None
    worker.output_counts = SimpleNamespace(start=lambda reqs: None)
    worker.draft_head = SimpleNamespace(observe=lambda ids, checked: None)
    worker.write_context_kv = lambda hidden, positions, loc: written.append(positions.tolist())
    batch = SimpleNamespace(reqs=[], input_ids=None, seq_lens=torch.tensor([5, 2]), prefix_lens=[2, 0],
                            extend_lens=[3, 2], out_cache_loc=torch.arange(5))
    for in_graph in (True, False, True):
        out = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=torch.zeros(5, 4)),
                              next_token_ids=torch.tensor([7, 8]), can_run_cuda_graph=in_graph)
        worker._target_worker = SimpleNamespace(forward_batch_generation=lambda batch, capture_hidden_mode: out)
        assert DFlashWorker.prefill_step(worker, batch, None) is out and out.logits_output.hidden_states is None
    assert (worker.prefills, worker.prefills_in_graphs) == (3, 2)
    assert written[-1] == [2, 3, 4, 0, 1]  # each request's new tokens after its cached prefix


def test_an_admission_times_the_targets_prefill_and_the_draft_context_apart(monkeypatch):
    """What a draft costs outside the decode step: the draft context an admission writes, beside the
    target's prefill, in /get_server_info's ``admission_host`` (host time, summed since start)."""
    import sglang_dflash.host_pauses as host_pauses
    from sglang_dflash.worker import DFlashWorker

    clock = iter([0.0, 0.030, 0.031, 0.036] * 2)  # target 30 ms, then the draft context 5 ms; twice
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))
    worker = object.__new__(DFlashWorker)
    worker.device, worker.prefills, worker.prefills_in_graphs, worker.window = "cpu", 0, 0, None
    worker.stalls = StepStalls()
    worker.output_counts = SimpleNamespace(start=lambda reqs: None)
    worker.draft_head = SimpleNamespace(observe=lambda ids, checked: None)
    worker.write_context_kv = lambda hidden, positions, loc: None
    batch = SimpleNamespace(reqs=[], input_ids=None, seq_lens=torch.tensor([5, 2]), prefix_lens=[2, 0],
                            extend_lens=[3, 2], out_cache_loc=torch.arange(5))
    out = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=torch.zeros(5, 4)),
                          next_token_ids=torch.tensor([7, 8]))
    worker._target_worker = SimpleNamespace(forward_batch_generation=lambda batch, capture_hidden_mode: out)
    for _ in range(2):
        out.logits_output.hidden_states = torch.zeros(5, 4)
        DFlashWorker.prefill_step(worker, batch, None)
    assert worker.stalls.report()["admission_host"] == {"phases_ms": {"draft context": 10.0, "target": 60.0}}


@pytest.mark.parametrize("tp_size, hybrid", [(2, False), (1, True)])
def test_where_adaptive_width_cannot_serve_the_default_fixes_the_block_and_a_named_auto_stops(
        monkeypatch, caplog, tp_size, hybrid):
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.config import DFlashConfigError
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(worker_mod, "get_parallel", lambda: SimpleNamespace(tp_size=tp_size, tp_rank=0))
    worker = object.__new__(DFlashWorker)
    worker.block_size, worker.widths, worker.hybrid, worker.hybrid_gdn = 16, (16, 8, 4, 2, 1), hybrid, False
    worker.release = SimpleNamespace(dp_attention=lambda args: False, resolving=lambda args: args)
    why = DFlashWorker._adaptive_width_unserved(worker, SimpleNamespace())
    assert why is not None
    monkeypatch.delenv("SGLANG_DFLASH_WIDTHS", raising=False)
    with caplog.at_level("INFO", logger="sglang_dflash"):
        DFlashWorker._fix_the_block(worker, why)
    assert worker.widths == (16,) and worker.width_policy is None and worker.fallback is None
    assert caplog.records[-1].getMessage().startswith("DFLASH verify width fixed at 16 (SGLANG_DFLASH_WIDTHS=auto ")
    monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", "auto")
    with pytest.raises(DFlashConfigError, match="^SGLANG_DFLASH_WIDTHS: "):
        DFlashWorker._fix_the_block(worker, why)
    worker.hybrid = False
    monkeypatch.setattr(worker_mod, "get_parallel", lambda: SimpleNamespace(tp_size=1, tp_rank=0))
    assert DFlashWorker._adaptive_width_unserved(worker, SimpleNamespace()) is None


@pytest.mark.parametrize("capture, fa3, widths", [
    (True, True, (16, 8, 4, 2, 1)),  # every width served: each one's accept kernel built
    (False, True, (16,)),  # fa3 without decode graphs fixes the block: its width alone
])
def test_the_accept_kernel_of_every_width_served_is_built_with_the_cuda_graphs(monkeypatch, capture, fa3, widths):
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.adaptive import WidthPolicy
    from sglang_dflash.worker import DFlashWorker

    built = []
    monkeypatch.setattr(worker_mod, "load_accept_block", lambda ws, device: built.append(tuple(ws)))
    monkeypatch.setattr(worker_mod, "GreedyDraftHead", lambda *a, **k: SimpleNamespace(rows_read=None, capture_hook=None))
    monkeypatch.setattr(worker_mod, "draft_weights_fp8", lambda model: False)
    monkeypatch.setattr(worker_mod, "get_parallel", lambda: SimpleNamespace(tp_size=1, tp_rank=0))
    decode = SimpleNamespace(bs=[1, 2], backend="full" if capture else worker_mod.Backend.DISABLED)
    monkeypatch.setattr(worker_mod, "get_exec", lambda: SimpleNamespace(
        graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=decode))))
    monkeypatch.delenv("SGLANG_DFLASH_WIDTHS", raising=False)
    backend = type("FlashAttentionBackend" if fa3 else "TritonAttnBackend", (), {})()
    worker = object.__new__(DFlashWorker)
    worker.block_size, worker.widths, worker.ragged, worker.device = 16, (16, 8, 4, 2, 1), False, "cpu"
    worker.width_policy = WidthPolicy(16, worker.widths)
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(4, 2))),
                                          model_config=SimpleNamespace(vocab_size=4), attn_backend=backend)
    worker.draft_model_runner = SimpleNamespace(capture_tail_hooks=[])
    worker.draft_model = None
    worker._draft_worker = SimpleNamespace(init_cuda_graphs=lambda capture_decode_cuda_graph: None)
    worker._build_width_pairs = lambda capture: None
    worker._capture_draft_graphs = lambda capture, sizes: (None, "not under test")
    DFlashWorker.init_cuda_graphs(worker)
    assert built == [widths] and worker.widths == widths


def test_the_log_says_which_widths_were_used_how_often(monkeypatch, caplog):
    from collections import deque

    import sglang_dflash.worker as worker_mod
    from sglang_dflash.adaptive import CyclingWidths
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(worker_mod, "WIDTHS_LOG_EVERY", 4)
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.width_policy, worker.steps_in_flight = CyclingWidths((16, 4, 1)), deque()
    worker.fallback, worker.widths_logged_at = None, 0
    with caplog.at_level("INFO", logger="sglang_dflash"):
        for _ in range(8):
            worker.steps_in_flight.append((worker.width_policy.choose(2), 2, (None, None), None))
            DFlashWorker.on_verify_complete_cpu(worker, [0, 0], batch_size=2)
    assert [r.getMessage() for r in caplog.records] == [
        "DFLASH verify widths used in 4 decode steps: 16: 2, 4: 1, 1: 1",
        "DFLASH verify widths used in 8 decode steps: 16: 3, 4: 3, 1: 2"]


def test_server_info_reports_the_widths_used_under_dflash(monkeypatch):
    """/get_server_info: the hook on SGLang's own Scheduler.get_internal_state adds the worker's
    figures; a server the plugin does not serve (EAGLE, the built-in) is left as SGLang made it."""
    from collections import Counter

    from sglang.srt.managers.scheduler import Scheduler

    import sglang_dflash.integration as integration
    from sglang_dflash.adaptive import CyclingWidths
    from sglang_dflash.host_pauses import process_pauses
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.block_size, worker.widths = 16, (16, 4, 1)
    worker.width_policy, worker.fallback = CyclingWidths(worker.widths), None
    worker.eager_verifies, worker.decode_steps, worker.eager_drafts = Counter({1: 2}), 4, 1
    worker.prefills, worker.prefills_in_graphs = 3, 2
    worker.hybrid, worker.decode_track, worker.verify_track = True, Counter(skipped=5, prepared=1), Counter(skipped=3)
    worker.width_one_step = "a DECODE"
    worker.pauses = process_pauses()
    worker.draft_head = SimpleNamespace(rows_read=32768, vocab=SimpleNamespace(rebuilds=3))
    worker.half_logits = SimpleNamespace(verifies=7)
    worker.window = None
    worker.draft_model_runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(size=123456))
    for _ in range(4):
        worker.width_policy.choose(2)
    assert Scheduler.get_internal_state.__name__ == "get_internal_state"  # the method the hook wraps

    def sglang_state(scheduler, req):
        return SimpleNamespace(internal_state={"avg_spec_accept_length": 1.5})

    scheduler = SimpleNamespace(draft_worker=worker)
    monkeypatch.setattr(integration, "_serving", True)
    state = integration.server_info_hook(sglang_state, scheduler, None).internal_state
    pauses = state["dflash"].pop("host_pauses")
    assert {"gc_full_collections", "gc_longest_ms", "gc_total_ms"} <= set(pauses)
    assert state["dflash"].pop("stalls") == {"calls": 0, "over_ms": 50.0, "stalls": 0, "stall_ms": 0.0, "recent": [],
                                             "host_ms_by_width": {}, "decode_host": {"calls": 0, "call_ms": 0.0,
                                                                                     "gap_ms": 0.0, "policy_ms": 0.0, "phases_ms": {}},
                                             "admission_host": {"phases_ms": {}}, "by_mode": {}, "by_transition": {}}
    from sglang_dflash.draft_input import bulk_prepare_serves

    assert state["dflash"].pop("bulk_prepare") is bulk_prepare_serves()
    if bulk_prepare_serves():
        assert set(state["dflash"].pop("length_sets")) == {"taken", "made", "replaced"}
    assert set(state["dflash"].pop("block_attention")) == {"backends", "routed_calls", "declined_calls", "plans_skipped",
                                                           "served_whole", "refused_tiles"}
    assert state["dflash"].pop("host_lengths") == []  # no backends built here
    assert state["dflash"].pop("draft_kv") == {"layout": "every position", "tokens": 123456, "window": None}
    assert state["dflash"].pop("draft_graphs") is None  # neither graphs nor a reason: this worker never set them up
    assert state["dflash"] == {"block_size": 16, "widths": [16, 4, 1], "width_policy": "CyclingWidths",
                               "widths_used": {"16": 2, "4": 1, "1": 1}, "step_ms": {}, "eager_verifies": {"1": 2},
                               "decode_steps": 4, "eager_drafts": 1, "runner_drafts": 0, "prefills": 3,
                               "prefills_in_graphs": 2, "draft_vocab": {"rows": 32768, "rebuilds": 3},
                               "half_verify_logits": 7,
                               "decode_track": {"skipped": 5, "prepared": 1}, "verify_track": {"skipped": 3},
                               "width_one_step": "a DECODE", "gdn_state": "commit"}
    assert state["avg_spec_accept_length"] == 1.5
    worker.width_policy, worker.widths = None, (16,)
    worker.draft_head.rows_read = worker.draft_head.vocab = worker.half_logits = None
    fixed = integration.server_info_hook(sglang_state, scheduler, None).internal_state["dflash"]
    fixed.pop("bulk_prepare"), fixed.pop("block_attention"), fixed.pop("host_lengths"), fixed.pop("draft_kv")
    fixed.pop("length_sets", None)
    worker.draft_graphs_off = "no decode CUDA graphs"
    assert integration.server_info_hook(sglang_state, scheduler, None).internal_state["dflash"]["draft_graphs"] == \
        "no decode CUDA graphs"
    fixed.pop("draft_graphs")
    assert fixed.pop("decode_track") == {"skipped": 5, "prepared": 1} and fixed.pop("width_one_step") == "a DECODE"
    assert fixed.pop("verify_track") == {"skipped": 3} and fixed.pop("gdn_state") == "commit"
    assert fixed.pop("host_pauses") and fixed.pop("stalls") and fixed == {"block_size": 16, "widths": [16], "decode_steps": 4,
                                                  "eager_drafts": 1, "runner_drafts": 0, "eager_verifies": {"1": 2},
                                                  "prefills": 3, "prefills_in_graphs": 2,
                                                  "half_verify_logits": None}
    monkeypatch.setattr(integration, "_serving", False)
    assert "dflash" not in integration.server_info_hook(sglang_state, scheduler, None).internal_state


def test_host_pauses_count_full_collections_and_time_the_longest():
    import gc
    import time

    from sglang_dflash.host_pauses import HostPauses

    pauses = HostPauses()
    try:
        gc.collect(0)  # a young collection is not a full one
        assert pauses.report()["gc_full_collections"] == 0
        pauses._on_gc("start", {"generation": 2})
        time.sleep(0.02)
        pauses._on_gc("stop", {"generation": 2})
        gc.collect()
        report = pauses.report()
        assert report["gc_full_collections"] == 2
        assert 20 <= report["gc_longest_ms"] <= report["gc_total_ms"]
        assert report["gc_full_collections_serving"] == 0  # start-up's collections stay out of the serving count
        pauses.mark_serving()
        gc.collect()
        report = pauses.report()
        assert report["gc_full_collections"] == 3 and report["gc_full_collections_serving"] == 1
        assert 0 < report["gc_total_ms_serving"] < report["gc_total_ms"]
    finally:
        gc.callbacks.remove(pauses._on_gc)


def test_step_stalls_name_long_calls_and_gaps_but_not_the_pause_between_waves(monkeypatch):
    import sglang_dflash.host_pauses as host_pauses

    clock = iter([0.000, 0.010,   # decode: 10 ms call
                  0.020, 0.220,   # extend: 200 ms call (a compile)
                  0.230, 0.240,   # decode after 10 ms
                  0.400, 0.410,   # decode after a 160 ms gap
                  # server_info read here: the idle time after it is not a gap
                  5.000, 5.010])
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))
    stalls = host_pauses.StepStalls(threshold_ms=50)
    for mode, bs, tokens in [("decode", 8, 0), ("extend", 3, 384), ("decode", 8, 0), ("decode", 8, 0)]:
        stalls.begin()
        stalls.end(mode, bs, tokens)
    report = stalls.report()
    assert report["calls"] == 4 and report["stalls"] == 2 and report["stall_ms"] == 360.0
    assert report["recent"] == [[2, "decode>extend", 3, 384, 200.0, 10.0, {}], [4, "decode>decode", 8, 0, 10.0, 160.0, {}]]
    stalls.begin()
    stalls.end("extend", 8, 1024)
    assert stalls.report()["stalls"] == 2


def test_a_stalled_call_names_the_host_time_of_its_own_parts(monkeypatch):
    """An admission that stalls says how much of it was the target's prefill and the draft context
    (and a decode step its phases): the parts of earlier calls and the policy's learning in the gap
    before it are not counted in it."""
    import sglang_dflash.host_pauses as host_pauses

    clock = iter([0.000, 0.004, 0.006, 0.010,  # decode: draft 2 ms
                  0.011, 0.012,  # the policy learning between the calls
                  0.020, 0.030, 0.090, 0.091, 0.092, 0.100])  # extend: target 60 ms, draft context 1 ms
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))

    class Worker:
        def __init__(self):
            self.stalls = StepStalls(threshold_ms=50)

        @host_pauses.host_phase("draft")
        def draft(self):
            pass

        @host_pauses.policy_time
        def learn(self):
            pass

        @host_pauses.admission_phase("target")
        def target(self):
            pass

        @host_pauses.admission_phase("draft context")
        def context(self):
            pass

    worker = Worker()
    worker.stalls.begin()
    worker.draft()
    worker.stalls.end("decode", 8, 0, width=16)
    worker.learn()
    worker.stalls.begin()
    worker.target()
    worker.context()
    worker.stalls.end("extend", 1, 1)
    report = worker.stalls.report()
    assert report["recent"] == [[2, "decode>extend", 1, 1, 80.0, 10.0, {"draft context": 1.0, "target": 60.0}]]
    assert report["decode_host"]["phases_ms"] == {"draft": 2.0} and report["decode_host"]["policy_ms"] == 1.0
    assert report["admission_host"]["phases_ms"] == {"draft context": 1.0, "target": 60.0}


def test_decode_calls_are_kept_by_verify_width(monkeypatch):
    """Host time per width@bucket (medians of the call and of the gap before it): whether a width
    whose steps cost more spent it in the worker or waiting before it."""
    import sglang_dflash.host_pauses as host_pauses

    clock = iter([0.000, 0.003,   # width 16, bs 12: the first call has no gap, so it is not kept
                  0.004, 0.007,   # width 16: 3 ms call after 1 ms
                  0.008, 0.013,   # width 8: 5 ms call after 1 ms
                  0.016, 0.019,   # width 16: 3 ms call after 3 ms
                  0.020, 0.030])  # a prefill: not kept by width
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))
    stalls = host_pauses.StepStalls()
    for mode, bs, width in [("decode", 12, 16), ("decode", 12, 16), ("decode", 9, 8), ("decode", 16, 16),
                            ("extend", 4, None)]:
        stalls.begin()
        stalls.end(mode, bs, 0, width)
    report = stalls.report()
    assert report["host_ms_by_width"] == {"16@16": {"call": 3.0, "gap": 2.0, "n": 2}, "8@16": {"call": 5.0, "gap": 1.0, "n": 1}}
    # Summed since start too, so two reads give a wave's mean host time per decode step.
    assert report["decode_host"] == {"calls": 3, "call_ms": 11.0, "gap_ms": 5.0, "policy_ms": 0.0, "phases_ms": {}}


def test_the_width_policys_own_calls_are_summed_as_host_time(monkeypatch):
    """The default's share of a step's host time: what its choice, its step timing and its learning
    took (the worker's methods under ``policy_time``), beside the decode calls' totals."""
    import sglang_dflash.host_pauses as host_pauses

    clock = iter([1.000, 1.0002, 2.000, 2.0005])
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls, worker.width_policy, worker.block_size = host_pauses.StepStalls(), None, 16
    assert worker.choose_widths(None, 4) == (16, None)  # 0.2 ms
    worker.on_verify_complete_cpu([1, 2])  # 0.5 ms
    assert worker.stalls.report()["decode_host"]["policy_ms"] == 0.7


def test_a_decode_steps_named_parts_are_summed_as_host_time(monkeypatch):
    """Where a host-bound step spends its worker call: each named part's host time (the worker's
    methods under ``host_phase``) summed since start, the two state commits under one name, and a
    part that raised counted too."""
    import sglang_dflash.host_pauses as host_pauses

    clock = iter([1.0, 1.0003, 2.0, 2.0001, 3.0, 3.0004, 4.0, 4.0002])
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls, worker.hybrid = host_pauses.StepStalls(), True
    worker.release = SimpleNamespace(track_decoded_state=lambda *args: None)
    DFlashWorker.track_decoded_state(worker, SimpleNamespace(mamba_track_indices=None))  # 0.3 ms
    DFlashWorker.track_decoded_state(worker, SimpleNamespace(mamba_track_indices=None))  # 0.1 ms
    with pytest.raises(AttributeError):
        DFlashWorker.commit_recurrent_state(worker, SimpleNamespace(), None, 1)  # 0.4 ms, then raised
    with pytest.raises(AttributeError):
        DFlashWorker.accept_step(worker, SimpleNamespace(), SimpleNamespace(), None, {})  # 0.2 ms
    assert worker.stalls.report()["decode_host"]["phases_ms"] == {"accept": 0.2, "state": 0.8}


def test_worker_calls_are_named_by_the_mode_they_came_in():
    """A verify leaves the batch in TARGET_VERIFY, which SGLang counts as an extend mode: the stall
    record names the call by the mode the scheduler handed over."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls(threshold_ms=-1)  # every call recorded

    def step(batch, mode, on_publish, grammar_barrier):
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        return "result"

    worker._step = step
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, seq_lens=torch.zeros(3))
    prefill = SimpleNamespace(forward_mode=ForwardMode.EXTEND, is_extend_in_batch=True, seq_lens=torch.zeros(2),
                              extend_num_tokens=256)
    assert worker.forward_batch_generation(decode) == "result"
    worker.forward_batch_generation(prefill)
    assert [entry[1:4] for entry in worker.stalls.recent] == [["->decode", 3, 0], ["decode>extend", 2, 256]]


# ---- width 1 as a plain DECODE forward of the target ----------------------------------------------


V = 32  # the fake target's vocabulary: it answers token t with (3t + 1) % V


def fake_target_forward(forward_batch, pair, seen):
    """The target's forward over ``forward_batch.input_ids``: logits and tapped hidden states of one
    row per token, and whether a graph ran (what the width's runner says), as SGLang returns them."""
    seen.append(pair)
    tokens = forward_batch.input_ids
    logits = torch.nn.functional.one_hot((3 * tokens + 1) % V, V).float()
    hidden = tokens[:, None].float().expand(-1, 6).clone()  # three tapped layers of width 2
    runner = pair[1]
    ran_graph = runner is not None and runner.can_run_graph(forward_batch)
    return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
                           can_run_cuda_graph=ran_graph)


def width_one_worker(monkeypatch, runner: str, decodes: bool = True):
    """narrow_worker's worker and batch at width 1, with the width-1 target pair (a backend that
    plans eagerly and, unless ``runner`` is "none", a graph runner that takes batches up to a
    ``runner`` of "graph"), a recording ForwardBatch.init_new and the target's forward."""
    import sglang_dflash.worker as worker_mod
    from sglang.srt.model_executor.forward_batch_info import clamp_position

    worker, batch = narrow_worker(monkeypatch)
    log = SimpleNamespace(init_new=[], planned=[], loaded=[], forwards=[], pairs=[])
    backend = SimpleNamespace(init_forward_metadata=log.planned.append)
    graphs = None if runner == "none" else SimpleNamespace(can_run_graph=lambda fb: runner == "graph",
                                                          load_batch=log.loaded.append)
    mr = worker.model_runner
    mr.attn_backend, mr.decode_cuda_graph_runner = "b8", "g8"
    worker.width_pairs, worker.width_one_decodes = {1: (backend, graphs)}, decodes

    def init_new(batch, model_runner, *, capture_hidden_mode, return_hidden_states_before_norm):
        assert model_runner is mr and not return_hidden_states_before_norm
        fields = ("input_ids", "forward_mode", "spec_info", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc")
        log.init_new.append({**{f: getattr(batch, f) for f in fields}, "capture_hidden_mode": capture_hidden_mode})
        # DECODE positions as SGLang derives them: the last of the lengths
        return SimpleNamespace(input_ids=batch.input_ids, positions=clamp_position(batch.seq_lens))

    monkeypatch.setattr(worker_mod, "ForwardBatch", SimpleNamespace(init_new=init_new))

    def forward_batch_generation(batch, forward_batch, is_verify, skip_attn_backend_init=None):
        assert batch is None and is_verify
        # A verify is planned beforehand (prepare_for_verify). A DECODE forward is planned by the
        # model runner, as for plain decoding: by the graph runner in place if it takes the batch.
        planned_before = getattr(forward_batch, "verify_planned", False)
        assert skip_attn_backend_init == (True if planned_before else None)
        if not planned_before:
            now = mr.decode_cuda_graph_runner
            if now is not None and now.can_run_graph(forward_batch):
                now.load_batch(forward_batch)
            else:
                mr.attn_backend.init_forward_metadata(forward_batch)
        log.forwards.append(forward_batch)
        return fake_target_forward(forward_batch, (mr.attn_backend, mr.decode_cuda_graph_runner), log.pairs)

    worker._target_worker = SimpleNamespace(forward_batch_generation=forward_batch_generation)
    batch.seq_lens_sum, batch.forward_mode, batch.input_ids, batch.out_cache_loc = 14, ForwardMode.DECODE, None, None
    return worker, batch, log, (backend, graphs)


@pytest.mark.parametrize("runner", ["graph", "eager", "none"])
def test_width_one_decodes_the_bonus_token_at_its_slot_with_the_tapped_hidden_states(monkeypatch, runner):
    """The DECODE batch: the bonus tokens, lengths counting them (so positions are the committed
    lengths), the width-1 KV slot, no spec input, the tapped hidden states; planned by the width-1
    graph runner when it takes the batch, else by the width-1 backend; the batch fields the accept
    step reads are the committed ones again afterwards."""
    from sglang_dflash.worker import DFlashWorker

    worker, batch, log, pair = width_one_worker(monkeypatch, runner)
    block = DFlashWorker.draft_step(worker, batch, StepBuffers(8, "cpu").take(2, torch.int64, 1), 1)
    committed, spec_info = batch.seq_lens, batch.spec_info
    logits_output, ran_graph, context_written = DFlashWorker.verify_step(worker, batch, block)

    (seen,) = log.init_new
    assert seen["forward_mode"] == ForwardMode.DECODE and seen["spec_info"] is None
    assert seen["capture_hidden_mode"] == CaptureHiddenMode.FULL
    assert seen["input_ids"].tolist() == [7, 8]
    assert seen["seq_lens"].tolist() == [6, 10]
    assert seen["out_cache_loc"].tolist() == [1000 + 2 * 64 + 5, 1000 + 9]
    # host lengths: the block's upper bound (committed + B), never below the decode lengths
    assert seen["seq_lens_cpu"].tolist() == [13, 17] and seen["seq_lens_sum"] == 30
    (forward_batch,) = log.forwards
    assert forward_batch.positions.tolist() == [5, 9] == block.positions.tolist()
    assert log.loaded == ([forward_batch] if runner == "graph" else [])
    assert log.planned == ([] if runner == "graph" else [forward_batch])
    assert log.pairs == [pair] and ran_graph == (runner == "graph")  # eager outside graphs
    assert not context_written  # a DECODE graph holds no context write: the step commits it
    assert (worker.model_runner.attn_backend, worker.model_runner.decode_cuda_graph_runner) == ("b8", "g8")
    assert batch.seq_lens is committed and batch.seq_lens_cpu.tolist() == [5, 9] and batch.seq_lens_sum == 14
    assert batch.spec_info is spec_info
    assert logits_output.next_token_logits.shape == (2, V) and logits_output.hidden_states.shape == (2, 6)


# What a whole step asks of the greedy head besides its tokens (drafted here by a stand-in).
HEAD_WITHOUT_GRAPHS = SimpleNamespace(maybe_rebuild=lambda: None, observe=lambda tokens, checked=False: None)


def torch_accept_block(candidates, target_tokens, seq_lens, accept_len, commit_len, bonus, out_tokens, new_seq_lens):
    from sglang_dflash.reference import accept_block

    ref = accept_block(candidates, target_tokens)
    for out, value in ((accept_len, ref.accept_len), (commit_len, ref.commit_len), (bonus, ref.bonus),
                       (out_tokens, ref.out_tokens), (new_seq_lens, seq_lens + ref.commit_len)):
        out.copy_(value)


def whole_step_worker(monkeypatch, runner: str, decodes: bool):
    """width_one_worker's worker and batch, ready for a whole ``forward_batch_generation`` at width
    1: SGLang's stream, verify input and accept kernel stood in for, and every draft-context write
    recorded (hidden, positions, KV slots[, commit lengths]) in the list returned last."""
    from collections import Counter, deque

    import sglang_dflash.worker as worker_mod
    from sglang_dflash.step_clock import StepClock

    class Lens(torch.Tensor):
        def record_stream(self, stream):
            pass

    class VerifyInput:  # SGLang's DFlashVerifyInput, as far as the 1-token verify uses it
        def __init__(self, draft_token, positions, draft_token_num, capture_hidden_mode):
            self.draft_token, self.positions = draft_token, positions

        def prepare_for_verify(self, batch, target_worker):
            batch.spec_info = self  # as SGLang's does: the draft input (and its host lengths) leave the batch
            return SimpleNamespace(input_ids=self.draft_token, positions=self.positions, verify_planned=True), None

    monkeypatch.setattr(worker_mod.torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(worker_mod, "accept_block", torch_accept_block)
    monkeypatch.setattr(worker_mod, "DFlashVerifyInput", VerifyInput)
    worker, batch, log, pair = width_one_worker(monkeypatch, runner, decodes)
    written = []
    worker.hybrid, worker.device, worker.buffers = False, "cpu", StepBuffers(8, "cpu")
    worker.width_policy = SimpleNamespace(choose=lambda bs, timed=True: 1, sleeping=lambda bs: None)
    worker.eager_verifies, worker.steps_in_flight, worker.decode_steps = Counter(), deque(), 0
    worker.decode_track = Counter()
    worker.output_counts = SimpleNamespace(batch_rows=lambda reqs: None)
    worker.time_step = lambda width, bs, request_widths=None, stream=None: None
    worker.clock = StepClock()  # no decode step before: this one is not timed
    worker.fallback, worker.ragged = None, False
    worker.draft_head = HEAD_WITHOUT_GRAPHS
    worker.write_context_kv = lambda *args: written.append([a.tolist() for a in args])
    batch.seq_lens = batch.seq_lens.as_subclass(Lens)
    batch.reqs, batch.has_grammar, batch.return_logprob, batch.sampling_info = [None, None], False, False, None
    batch.is_extend_in_batch = False
    return worker, batch, log, pair, written


@pytest.mark.parametrize("runner", ["graph", "eager"])
def test_a_width_one_decode_step_commits_what_the_one_token_verify_commits(monkeypatch, runner):
    """The whole step at width 1, as a DECODE forward and as the 1-token verify (the backends that
    keep it): the same token committed after the committed lengths, the same draft K/V written
    from the tapped hidden states, and a step outside graphs counted as eager."""
    from sglang_dflash.worker import DFlashWorker

    steps = {}
    for decodes in (True, False):
        worker, batch, log, _, written = whole_step_worker(monkeypatch, runner, decodes)
        result = DFlashWorker.forward_batch_generation(worker, batch)
        assert log.init_new if decodes else not log.init_new  # the path taken
        steps[decodes] = (result.next_token_ids.tolist(), result.accept_lens.tolist(),
                          result.new_seq_lens.tolist(), result.next_draft_input.bonus_tokens.tolist(),
                          result.speculative_num_draft_tokens, written, dict(worker.eager_verifies))
    tokens, accept_lens, new_lens, bonus, stride, written, eager = steps[True]
    assert steps[True] == steps[False]
    assert tokens == bonus == [22, 25] and accept_lens == [1, 1] and new_lens == [6, 10] and stride == 1
    slots = [[1000 + 2 * 64 + 5], [1000 + 9]]
    assert written == [[[[7.0] * 6, [8.0] * 6], [5, 9], slots, [1, 1]]]  # hidden, positions, KV slots, commit
    assert eager == ({} if runner == "graph" else {1: 1}) and worker.decode_steps == 1


@pytest.mark.parametrize("decodes", [True, False])
def test_a_hybrid_width_one_decode_commits_nothing_and_tracks_the_live_state_at_a_crossed_boundary(monkeypatch, decodes):
    """On a hybrid target a width-1 DECODE advanced the recurrent state in place: the verify's
    commit, which copies a scratch step over the slot, must not run after it. The track slots are
    refreshed and the extend-time track mask cleared before the forward is built (no tracking
    inside it); afterwards the live state goes to the track slot of each request whose token
    reached a boundary (lengths 5 and 9 grow to 6 and 10: interval 10 marks the second), never to
    a freed one. The 1-token verify (SGLANG_DFLASH_HYBRID_DECODE=0) commits as before."""
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.worker import DFlashWorker

    worker, batch, log, (backend, _), _ = whole_step_worker(monkeypatch, "graph", decodes)
    seen, prepared, held = [], [], {"slots": torch.tensor([3, 4])}  # the track slots the requests hold

    def prepare_track(b):
        assert len(log.init_new) == len(prepared), "the track slots are refreshed before the forward is built"
        prepared.append(b)
        seen.append("prepare")
        b.mamba_track_indices, b.mamba_track_mask = held["slots"], None

    monkeypatch.setattr(worker_mod, "prepare_mamba_track_for_verify", prepare_track)
    worker.hybrid, worker.width_pairs[1] = True, (backend, worker.width_pairs[1][1])
    worker.release = SimpleNamespace(
        has=lambda change: True, mamba_track_interval=lambda b: 10,
        track_decoded_state=lambda on, mask, track: seen.append(("track", on, mask.tolist(), track.tolist())))
    worker.commit_recurrent_state = lambda b, accepted, width, committed_cpu=None: seen.append(("commit", width))
    batch.mamba_track_mask = torch.tensor([True, True])  # left by the prefill
    batch.mamba_track_indices = torch.tensor([3, 4])
    result = DFlashWorker.forward_batch_generation(worker, batch)
    assert result.new_seq_lens.tolist() == [6, 10]
    if decodes:
        assert seen == ["prepare", ("track", backend, [False, True], [3, 4])] and batch.mamba_track_mask is None
        held["slots"] = torch.tensor([3, -1])  # the second request's track slot was freed
        seen.clear()
        DFlashWorker.forward_batch_generation(worker, batch)
        assert seen[-1] == ("track", backend, [False, False], [3, -1])
    else:
        assert seen == [("commit", 1)]


def test_a_decode_may_reach_a_track_boundary_exactly_where_one_lies_within_two_blocks_of_the_host_length():
    """The host check against every decoded length the device may hold (committed, up to two
    steps of B behind): true exactly where one of them is a multiple of the interval."""
    from sglang_dflash.worker import decode_may_reach_track

    for interval, block in ((256, 16), (64, 8), (32, 16), (16, 1)):
        for committed in range(0, 3 * interval):
            lengths = range(committed + 1, committed + 2 * block + 2)
            expected = any(length % interval == 0 for length in lengths)
            assert decode_may_reach_track(torch.tensor([committed]), interval, block) == expected
            assert decode_may_reach_track(torch.tensor([interval + 1, committed], dtype=torch.int32),
                                          interval, block) == (expected or 2 * block + 2 >= interval)


@pytest.mark.parametrize("case", ["far", "far, lengths on the draft input", "near", "lazy plan", "no host lengths"])
def test_a_hybrid_width_one_decode_far_from_every_track_boundary_neither_rebuilds_nor_copies_track_slots(
        monkeypatch, case):
    """A width-1 step is host-bound: where no request's token can reach a track boundary (lengths
    5 and 9, block 8, interval 64), the track slots are not rebuilt and no copy is launched; the
    extend-time track fields are cleared all the same, so nothing tracks inside the forward. The
    host lengths are the batch's or, where the overlap schedule dropped those (backends asking for
    none, as on the H200 rigs), the committed lengths the draft input read when it reserved the
    step. Near one (interval 16), with a lazy track plan on the batch, or without any host
    lengths, both run."""
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.compat import SGLangRelease
    from sglang_dflash.worker import DFlashWorker

    worker, batch, log, (backend, _), _ = whole_step_worker(monkeypatch, "graph", True)
    seen = []

    def prepare_track(b):
        seen.append("prepare")
        b.mamba_track_indices, b.mamba_track_mask = torch.tensor([3, 4]), None

    monkeypatch.setattr(worker_mod, "prepare_mamba_track_for_verify", prepare_track)
    worker.hybrid, worker.width_pairs[1] = True, (backend, worker.width_pairs[1][1])
    worker.release = SimpleNamespace(
        has=lambda change: True, mamba_track_interval=lambda b: 16 if case == "near" else 64,
        track_decoded_state=lambda on, mask, track: seen.append("track"), reserved_seq_lens_cpu=lambda spec: None,
        committed_lens_cpu=SGLangRelease("0.5.23").committed_lens_cpu)
    batch.mamba_track_mask, batch.mamba_track_indices = torch.tensor([True, True]), torch.tensor([3, 4])
    batch.mamba_track_seqlens = batch.mamba_prefill_track_mask_cpu = batch.mamba_track_seqlens_cpu = [128, 128]
    batch.mamba_lazy_spec_track_positions_cpu = [0, 1] if case == "lazy plan" else None
    if case in ("no host lengths", "far, lengths on the draft input"):
        batch.seq_lens_cpu = None
    if case == "far, lengths on the draft input":  # a buffer grown past the batch, as SGLang grows it
        batch.spec_info._prepare_batch_seq_lens_cpu_buf = torch.tensor([5, 9, 250, 250])
    far = case.startswith("far")
    result = DFlashWorker.forward_batch_generation(worker, batch)
    assert result.new_seq_lens.tolist() == [6, 10] and batch.mamba_track_mask is None
    assert worker.decode_track == {"skipped" if far else "prepared": 1}
    if far:
        assert seen == [] and batch.mamba_track_indices is None
        assert batch.mamba_track_seqlens is batch.mamba_prefill_track_mask_cpu is batch.mamba_track_seqlens_cpu is None
    else:
        assert seen == ["prepare", "track"]


def test_the_targets_verify_and_width_one_decode_graphs_write_the_draft_context_of_every_row():
    """The capture-tail hook writes the tapped hidden states of every row at its position and
    slot, in the target's TARGET_VERIFY graphs and its DECODE graphs (width 1) but not in the
    draft's, and marks the runners whose graphs hold it."""
    from sglang_dflash.context import ContextInVerifyGraph

    written = []
    hook = ContextInVerifyGraph(lambda *args: written.append([a.tolist() for a in args]))
    target = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=False))
    draft = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=True))
    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, positions=torch.tensor([5, 6, 9, 10]),
                             out_cache_loc=torch.tensor([40, 41, 70, 71]))
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, positions=torch.tensor([5, 9]),
                             out_cache_loc=torch.tensor([40, 70]))
    hidden = torch.arange(8.0).view(4, 2)
    width_one = SimpleNamespace(model_runner=target.model_runner)
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, positions=torch.tensor([5, 6]),
                             out_cache_loc=torch.tensor([40, 41]))
    hook.capture_hook(draft, SimpleNamespace(hidden_states=hidden), verify, 4)  # the draft's own graphs
    hook.capture_hook(target, SimpleNamespace(hidden_states=hidden[:2]), extend, 2)  # a prefill graph
    hook.capture_hook(target, SimpleNamespace(hidden_states=None), verify, 4)  # no tapped states captured
    assert written == [] and not hook.wrote(target, True)
    hook.capture_hook(target, SimpleNamespace(hidden_states=hidden), verify, 4)
    assert written == [[hidden.tolist(), [5, 6, 9, 10], [40, 41, 70, 71]]]  # all rows: no accept yet
    assert hook.wrote(target, True) and not hook.wrote(target, False) and not hook.wrote(draft, True)
    assert not hook.wrote(width_one, True)
    hook.capture_hook(width_one, SimpleNamespace(hidden_states=hidden[:2]), decode, 2)  # width 1 as a decode
    assert written[1:] == [[hidden[:2].tolist(), [5, 9], [40, 70]]] and hook.wrote(width_one, True)


@pytest.mark.parametrize("decodes", [True, False])
@pytest.mark.parametrize("runner", ["graph", "eager"])
def test_a_step_whose_verify_graph_wrote_the_context_does_not_write_it_again(monkeypatch, runner, decodes):
    """The step commits the draft context itself only when its verify (or width-1 decode) did not
    replay a graph holding the write (eager, or a runner captured without it); the tokens are the same."""
    from sglang_dflash.context import ContextInVerifyGraph
    from sglang_dflash.worker import DFlashWorker

    worker, batch, log, (_, graphs), written = whole_step_worker(monkeypatch, runner, decodes)
    worker.context_in_graph = ContextInVerifyGraph(worker.write_context_kv)
    worker.context_in_graph.runners.add(id(graphs))  # the width-1 runner's graphs were captured with it
    result = DFlashWorker.forward_batch_generation(worker, batch)
    assert result.next_token_ids.tolist() == [22, 25] and result.new_seq_lens.tolist() == [6, 10]
    slots = [[1000 + 2 * 64 + 5], [1000 + 9]]
    assert written == ([] if runner == "graph" else [[[[7.0] * 6, [8.0] * 6], [5, 9], slots, [1, 1]]])


@pytest.mark.parametrize("backend, widths, decodes", [
    ("TritonAttnBackend", (16, 8, 4, 2, 1), True), ("FlashAttentionBackend", (16, 4, 1), True),
    ("FlashInferAttnBackend", (16, 8, 4, 2, 1), False), ("HybridAttnBackend", (16, 4, 1), False),
    ("TritonAttnBackend", (16, 4), False)])
def test_width_one_decodes_where_the_targets_decode_planning_takes_the_device_lengths(
        monkeypatch, backend, widths, decodes):
    """Triton and FA3 plan a decode from the device lengths; FlashInfer plans its KV split from the
    host's (an upper bound under the overlap schedule), and a backend pair is not judged: those
    keep the 1-token verify. The width-1 runner is built for the path the step takes."""
    from sglang_dflash import compat
    from sglang_dflash.worker import DFlashWorker

    built = []
    monkeypatch.setattr(compat.SGLangRelease, "build_width_runners",
                        lambda self, mr, widths, capture, decode_width_one, on_backend:
                        built.append((decode_width_one, on_backend)) or {})
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.release, worker.block_size, worker.widths = compat.running(), 16, widths
    worker.width_policy, worker.hybrid = SimpleNamespace(), False
    worker.model_runner = SimpleNamespace(attn_backend=type(backend, (), {})(), decode_cuda_graph_runner="g16")
    DFlashWorker._build_width_pairs(worker, capture=True)
    from sglang_dflash.block_attention_route import route_block_attention

    # Every narrower width's backend is offered to the block-attention route before its graphs.
    assert worker.width_one_decodes is decodes and built == [(decodes, route_block_attention)]


def hybrid_wrapper(full_attention_class: str, conv_pools: int = 1, short_conv: bool = False):
    """A hybrid target's attention backend as SGLang wraps it: the full-attention backend and the
    linear one, whose request pool holds the recurrent-state pool (one conv pool per kind)."""
    cache = SimpleNamespace(temporal=torch.zeros(2, 5, 3), conv=[torch.zeros(2, 5, 2)] * conv_pools)
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache),
                           short_conv_pool=SimpleNamespace(conv_state=torch.zeros(1) if short_conv else None))
    linear = SimpleNamespace(req_to_token_pool=pool)
    return type("HybridLinearAttnBackend", (), {})(), type(full_attention_class, (), {})(), linear


@pytest.mark.parametrize("full, env, conv_pools, short_conv, decodes", [
    ("TritonAttnBackend", None, 1, False, True), ("FlashAttentionBackend", "1", 1, False, True),
    ("FlashInferAttnBackend", None, 1, False, False),  # plans its decode from the host's lengths
    ("TritonAttnBackend", "0", 1, False, False),  # SGLANG_DFLASH_HYBRID_DECODE=0: the 1-token verify (A/B)
    ("TritonAttnBackend", None, 2, False, False),  # the track kernel copies one conv pool
    ("TritonAttnBackend", None, 1, True, False)])  # a side state only the verify's commit rolls
def test_a_hybrid_decodes_width_one_where_its_state_pool_can_be_tracked_after_the_decode(
        monkeypatch, caplog, full, env, conv_pools, short_conv, decodes):
    """On a hybrid target width 1 is a DECODE when the full-attention backend inside SGLang's
    wrapper plans decodes from the device lengths and the recurrent state sits in the one pool
    SGLang's track kernel copies from; else a 1-token verify, said in the log."""
    import sglang_dflash.worker as worker_mod
    from sglang_dflash import compat
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(compat.SGLangRelease, "build_width_runners",
                        lambda self, mr, widths, capture, decode_width_one, on_backend: {})
    monkeypatch.setattr(worker_mod, "get_parallel", lambda: SimpleNamespace(tp_size=1, tp_rank=0))
    if env is None:
        monkeypatch.delenv("SGLANG_DFLASH_HYBRID_DECODE", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DFLASH_HYBRID_DECODE", env)
    wrapper, full_backend, linear = hybrid_wrapper(full, conv_pools, short_conv)
    wrapper.full_attn_backend, wrapper.linear_attn_backend = full_backend, linear
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.release, worker.block_size, worker.widths = compat.running(), 16, (16, 8, 4, 2, 1)
    worker.width_policy, worker.hybrid = SimpleNamespace(), True
    worker.model_runner = SimpleNamespace(attn_backend=wrapper, decode_cuda_graph_runner="g16")
    with caplog.at_level("INFO", logger="sglang_dflash"):
        DFlashWorker._build_width_pairs(worker, capture=True)
    assert worker.width_one_decodes is decodes
    said = [r.getMessage() for r in caplog.records if "width 1 on this hybrid" in r.getMessage()]
    if full == "FlashInferAttnBackend":
        assert said == []
    elif decodes:
        assert said == ["DFLASH width 1 on this hybrid target: a DECODE"]
    else:
        assert len(said) == 1 and "a 1-token verify" in said[0], said


GDN_SERVED = None


@pytest.mark.parametrize("gdn, named, replay_ring, why", [
    (True, "16,8,4,2,1", False, GDN_SERVED),
    (True, "auto", False, GDN_SERVED),
    (True, None, False, GDN_SERVED),  # on by default: lossless switching on both tiny hybrids, 0.5.17 and 0.5.23
    (False, "16,8,4,2,1", False, "gated-delta-net"),  # Mamba2, KDA and others commit another way
    (True, "16,8,4,2,1", True, "--enable-linear-replayssm"),
])
def test_a_gated_delta_net_hybrid_switches_widths_by_default_and_other_hybrids_keep_the_block(monkeypatch, gdn, named, replay_ring, why):
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(worker_mod, "get_parallel", lambda: SimpleNamespace(tp_size=1, tp_rank=0))
    if named is None:
        monkeypatch.delenv("SGLANG_DFLASH_WIDTHS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", named)
    worker = object.__new__(DFlashWorker)
    worker.hybrid, worker.hybrid_gdn = True, gdn
    worker.release = SimpleNamespace(dp_attention=lambda args: False, resolving=lambda args: args)
    got = DFlashWorker._adaptive_width_unserved(worker, SimpleNamespace(enable_linear_replayssm=replay_ring))
    assert got is None if why is None else why in got


class FakeHybridBackend:
    """A HybridLinearAttnBackend's commit: the state slots come from the batch it last ran."""

    def __init__(self, name, slots, flashinfer_verify=False):
        self.name, self.slots, self.commits = name, slots, []
        self.full_attn_backend = type("FlashAttentionBackend", (), {})()
        self.linear_attn_backend = SimpleNamespace(
            kernel_dispatcher=SimpleNamespace(verify_kernel_is_flashinfer=flashinfer_verify))

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model, req_pool_indices):
        self.commits.append((self.slots, last_correct_step_indices.tolist(),
                             None if mamba_steps_to_track is None else mamba_steps_to_track.tolist()))


@pytest.mark.parametrize("width, committed_by", [(4, "w4"), (16, "w16"), (2, "w2")])
def test_the_recurrent_state_is_committed_through_the_backend_that_ran_the_verify(width, committed_by):
    """Each width's backend keeps the state slots of the last batch it verified: the commit after a
    verify at w must read w's, never the block's (another batch's slots: a silent corruption)."""
    from sglang_dflash.worker import Accepted, DFlashWorker

    backends = {w: FakeHybridBackend(f"w{w}", slots=f"slots of the batch w{w} ran") for w in (16, 4, 2)}
    worker = object.__new__(DFlashWorker)
    worker.width_pairs = {w: (b, f"graphs {w}") for w, b in backends.items()}
    worker.model_runner = SimpleNamespace(attn_backend=backends[16], model="target")
    worker.release = SimpleNamespace(mamba_track_interval=lambda batch: 8)
    worker.block_size, worker.verify_track = 16, Counter()
    batch = SimpleNamespace(seq_lens=torch.tensor([7, 20]), seq_lens_cpu=torch.tensor([7, 20]),
                            mamba_track_indices=torch.tensor([3, 5]), req_pool_indices=torch.tensor([0, 1]))
    commit_len = torch.tensor([min(width, 2), 1])
    accepted = Accepted(accept_len=commit_len - 1, commit_len=commit_len, bonus=None, out_tokens=None,
                        new_seq_lens=batch.seq_lens + commit_len)
    DFlashWorker.commit_recurrent_state(worker, batch, accepted, width)
    done = {name: b.commits for name, b in ((b.name, b) for b in backends.values()) if b.commits}
    assert list(done) == [committed_by]
    slots, last_steps, tracked = done[committed_by][0]
    assert slots == f"slots of the batch {committed_by} ran" and last_steps == (commit_len - 1).tolist()
    assert tracked == mamba_track_steps(batch.seq_lens, commit_len, 8).tolist()
    # A fixed block builds no pairs: the target's own backend ran the verify.
    worker.width_pairs = {}
    DFlashWorker.commit_recurrent_state(worker, batch, accepted, 16)
    assert len(backends[16].commits) == 1 + (committed_by == "w16")


@pytest.mark.parametrize("case", ["far", "far, lengths on the draft input", "near", "lazy plan", "no host lengths"])
def test_a_verify_commit_far_from_every_track_boundary_scatters_no_track_slot(case):
    """The commit's track scatter (and the steps to track it needs) runs only where some request's
    commit may end on a track boundary: host lengths 5 and 9, block 8, interval 64 cannot reach one
    (a commit ends at most two blocks past the host's length); interval 16 can. With a lazy track
    plan, or without host lengths, it always runs. The accepted step is committed either way."""
    from sglang_dflash.compat import SGLangRelease
    from sglang_dflash.worker import Accepted, DFlashWorker

    backend = FakeHybridBackend("w8", slots="slots")
    worker = object.__new__(DFlashWorker)
    worker.width_pairs, worker.model_runner = {}, SimpleNamespace(attn_backend=backend, model="target")
    worker.block_size, worker.verify_track = 8, Counter()
    interval = 16 if case == "near" else 64
    worker.release = SimpleNamespace(mamba_track_interval=lambda b: interval,
                                     committed_lens_cpu=SGLangRelease("0.5.23").committed_lens_cpu)
    host = torch.tensor([5, 9])
    batch = SimpleNamespace(seq_lens=torch.tensor([5, 9]), seq_lens_cpu=host, mamba_track_indices=torch.tensor([3, 4]),
                            req_pool_indices=torch.tensor([0, 1]), spec_info=SimpleNamespace())
    if case == "far, lengths on the draft input":  # the overlap schedule's resolve dropped seq_lens_cpu
        batch.seq_lens_cpu, batch.spec_info._prepare_batch_seq_lens_cpu_buf = None, host
    if case == "lazy plan":
        batch.mamba_lazy_spec_track_positions_cpu = [[], []]
    if case == "no host lengths":
        batch.seq_lens_cpu = None
    commit_len = torch.tensor([3, 8])
    accepted = Accepted(accept_len=commit_len - 1, commit_len=commit_len, bonus=None, out_tokens=None,
                        new_seq_lens=batch.seq_lens + commit_len)
    DFlashWorker.commit_recurrent_state(worker, batch, accepted, 8, DFlashWorker.host_committed_lens(worker, batch))
    (_, last_steps, tracked), = backend.commits
    assert last_steps == [2, 7]
    far = case.startswith("far")
    assert tracked == (None if far else mamba_track_steps(batch.seq_lens, commit_len, interval).tolist())
    assert worker.verify_track == {"skipped" if far else "scattered": 1}


@pytest.mark.parametrize("interval", [64, 16])
def test_a_hybrid_verify_step_reads_the_track_reach_before_the_verify_takes_the_batchs_spec_input(monkeypatch, interval):
    """Whole step, hybrid, a verify (not a DECODE), host lengths only on the draft input (the
    overlap schedule's case on the H200 rigs). SGLang's prepare_for_verify puts the verify input
    in ``batch.spec_info``: read after it, the reach found no host lengths and every commit
    scattered (2026-12-05, 0 of 1,311 c1 steps skipped). Lengths 5 and 9, block 8: interval 64 is
    out of reach, 16 within it."""
    from sglang_dflash.compat import SGLangRelease
    from sglang_dflash.worker import DFlashWorker

    worker, batch, _, _, _ = whole_step_worker(monkeypatch, "graph", False)
    seen = []
    worker.hybrid = True
    worker.release = SimpleNamespace(has=lambda change: True, mamba_track_interval=lambda b: interval,
                                     reserved_seq_lens_cpu=lambda spec: None,
                                     committed_lens_cpu=SGLangRelease("0.5.23").committed_lens_cpu)
    worker.commit_recurrent_state = lambda b, accepted, width, committed_cpu=None: seen.append(
        DFlashWorker.may_reach_track(worker, b, committed_cpu))
    batch.mamba_lazy_spec_track_positions_cpu = None
    batch.seq_lens_cpu, batch.spec_info._prepare_batch_seq_lens_cpu_buf = None, torch.tensor([5, 9])
    DFlashWorker.forward_batch_generation(worker, batch)
    assert seen == [interval == 16]


def test_the_schedulers_time_is_summed_by_mode_apart_from_the_pauses_between_reads(monkeypatch):
    """``stalls.by_mode``: each worker call's time and the gap before it, by mode, since start;
    a report forgets the last call's end, so a pause between a benchmark's waves counts nowhere."""
    import sglang_dflash.host_pauses as host_pauses

    clock = iter([0.0, 0.002, 0.003, 0.008, 0.010, 0.012, 5.0, 5.004])
    monkeypatch.setattr(host_pauses.time, "perf_counter", lambda: next(clock))
    stalls = StepStalls()
    for mode, tokens, width in (("extend", 300, None), ("decode", 0, 16), ("decode", 0, 4)):
        stalls.begin()
        stalls.end(mode, 2, tokens, width)
    stalls.report()  # between waves
    stalls.begin()
    stalls.end("decode", 2, 0, 16)
    report = stalls.report()
    assert report["by_mode"] == {
        "decode": {"calls": 3, "tokens": 0, "call_ms": 11.0, "gap_ms": 3.0},
        "extend": {"calls": 1, "tokens": 300, "call_ms": 2.0, "gap_ms": 0.0}}
    # the same time by what came before: a decode step after an admission apart from the steady ones
    assert report["by_transition"] == {
        "-" + ">extend": {"calls": 1, "call_ms": 2.0, "gap_ms": 0.0},
        "extend>decode": {"calls": 1, "call_ms": 5.0, "gap_ms": 1.0},
        "decode>decode": {"calls": 2, "call_ms": 6.0, "gap_ms": 2.0}}


def test_a_hybrid_whose_linear_layers_verify_on_flashinfer_keeps_the_block(monkeypatch, caplog):
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.worker import DFlashWorker, flashinfer_linear_verify, full_attention

    triton_verify, flashinfer = FakeHybridBackend("t", None), FakeHybridBackend("f", None, flashinfer_verify=True)
    assert not flashinfer_linear_verify(triton_verify) and flashinfer_linear_verify(flashinfer)
    assert not flashinfer_linear_verify(type("TritonAttnBackend", (), {})())  # attention-only target
    assert type(full_attention(flashinfer)).__name__ == "FlashAttentionBackend"
    plain = type("TritonAttnBackend", (), {})()
    assert full_attention(plain) is plain

    monkeypatch.setattr(worker_mod, "get_parallel", lambda: SimpleNamespace(tp_size=1, tp_rank=0))
    monkeypatch.setattr(worker_mod, "route_block_attention", lambda backend: False)
    monkeypatch.delenv("SGLANG_DFLASH_WIDTHS", raising=False)
    for backend, widths in ((triton_verify, (16, 8, 4, 2, 1)), (flashinfer, (16,))):
        worker = object.__new__(DFlashWorker)
        worker.hybrid, worker.hybrid_gdn, worker.ragged, worker.block_size = True, True, False, 16
        worker.widths, worker.width_policy, worker.fallback = (16, 8, 4, 2, 1), SimpleNamespace(), None
        worker.model_runner = SimpleNamespace(attn_backend=backend)
        worker.draft_model_runner = SimpleNamespace(attn_backend=None)
        worker._draft_worker = SimpleNamespace(init_attention_backends=lambda: None)
        with caplog.at_level("INFO", logger="sglang_dflash"):
            DFlashWorker.init_attention_backends(worker)
        assert worker.widths == widths
    assert "FlashInfer's gated-delta-net verify" in caplog.records[-1].getMessage()


def fallback_worker(fallback, choose):
    from collections import deque

    from sglang_dflash.adaptive import WidthPolicy
    from sglang_dflash.step_clock import StepClock
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.block_size, worker.fallback, worker.widths_logged_at, worker.ragged = 16, fallback, 0, False
    worker.width_policy = WidthPolicy(16, (16, 4, 1))
    if choose is not None:
        worker.width_policy.choose = lambda bs, timed=True: choose(bs)
    worker.clock = StepClock()
    worker.steps_in_flight, worker.draft_head, worker.half_logits = deque(), None, None
    return worker


def test_a_batch_all_in_fallback_decodes_plainly_and_a_mixed_one_verifies_fallback_requests_narrower_only_when_ragged():
    from sglang_dflash.fallback import ForcedFallback
    from sglang_dflash.worker import DFlashWorker

    chosen = []
    worker = fallback_worker(ForcedFallback(), lambda bs: chosen.append(bs) or 4)
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")])
    worker.ragged = True
    assert DFlashWorker.choose_widths(worker, batch, 2) == (4, (["a", "b"], [1, 4]))
    worker.ragged = False  # padded: each request is checked at the batch's width anyway, and keeps what it accepts
    assert DFlashWorker.choose_widths(worker, batch, 2) == (4, (["a", "b"], [4, 4]))
    assert DFlashWorker.choose_widths(worker, batch, 2) == (1, (["a", "b"], [1, 1]))  # the policy not asked
    assert chosen == [2, 2]
    assert worker.width_policy.widths_used() == {1: 1}  # the policy's own choices went through its choose
    worker.width_policy.fallback_width = lambda bs, fallen_tokens=1.0, timed=True: 16  # a host-bound pair: width 1 saves too little
    for _ in range(3):
        last = DFlashWorker.choose_widths(worker, batch, 2)
    assert last == (16, (["a", "b"], [16, 16])) and chosen == [2, 2, 2, 2]
    worker.ragged = True  # a ragged verify gives each request its own lane: width 1 is cheaper
    for _ in range(3):
        last = DFlashWorker.choose_widths(worker, batch, 2)
    assert last == (1, (["a", "b"], [1, 1]))
    worker.fallback = None
    assert DFlashWorker.choose_widths(worker, batch, 2) == (4, None)


def test_fallback_learns_every_requests_accepts_and_the_policy_only_those_verified_at_the_batch_width():
    from sglang_dflash.worker import DFlashWorker

    observed, recorded = [], []
    fallback = SimpleNamespace(observe=lambda *a: observed.append(a))
    worker = fallback_worker(fallback, None)
    worker.width_policy.record = lambda *a: recorded.append(a)
    worker.width_policy.read_timing = lambda timing: None
    worker.steps_in_flight.append((8, 3, (None, None), (["a", "b", "c"], [8, 1, 8])))
    worker.steps_in_flight.append((1, 3, (None, None), (["a", "b", "c"], [1, 1, 1])))
    DFlashWorker.on_verify_complete_cpu(worker, [5, 0, 2], batch_size=3)
    DFlashWorker.on_verify_complete_cpu(worker, [0, 0, 0], batch_size=3)
    assert observed == [(["a", "b", "c"], [8, 1, 8], [5, 0, 2]), (["a", "b", "c"], [1, 1, 1], [0, 0, 0])]
    assert recorded == []  # the policy learns when it next decides
    worker.width_policy.step_ms()
    assert recorded == [(8, 3, [5, 2], None, 0), (1, 3, [0, 0, 0], None, 0)]  # width 1 judges no draft


@pytest.mark.parametrize("per_position", [False, True])
def test_a_ragged_step_records_and_keeps_the_width_each_request_was_verified_at(monkeypatch, per_position):
    """Request b is in fallback. A greedy, plain batch gives it a lane of width 1: its step records
    width 1 (so the policy leaves it out). With per-position parameters (here penalties) every lane is
    verified at the batch's width, so b keeps every draft it accepts and its step records width 4."""
    from collections import Counter, deque

    import sglang_dflash.worker as worker_mod
    from sglang_dflash.fallback import DraftHealth
    from sglang_dflash.draft import DraftBlock
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(worker_mod.torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(worker_mod, "accept_block", torch_accept_block)
    B, vocab = 4, 11
    candidates = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    choices = torch.tensor([[4, 5, 6, 2], [8, 9, 10, 1]])  # the target agrees with every draft
    worker = fallback_worker(DraftHealth(misses=1, retry_every=1000), lambda bs: B)
    worker.fallback.observe(["b"], [B], [0])  # b's drafts failed: it is in fallback
    worker.block_size, worker.ragged, worker.hybrid = B, True, False
    worker.buffers, worker.device = StepBuffers(B, "cpu"), "cpu"
    worker.eager_verifies, worker.decode_steps = Counter(), 0
    worker.draft_head = HEAD_WITHOUT_GRAPHS
    worker.draft_step = lambda batch, bufs, width: DraftBlock(candidates.clone(), torch.arange(2 * B),
                                                              torch.arange(2 * B), torch.tensor([14, 24]))
    rows = torch.tensor([0, 1]) if per_position else None
    worker.output_counts = SimpleNamespace(batch_rows=lambda reqs: rows, commit=lambda *a: None)
    lanes_seen, timed = [], []

    def verify_step(batch, block, lane_widths):
        lanes_seen.append(lane_widths)
        if lane_widths != [B, B]:  # b's one lane: its bonus row only
            block.lanes = worker_mod.RaggedLanes.from_widths(lane_widths, "cpu")
            picked = torch.cat([choices[0], choices[1, :1]])
            return SimpleNamespace(next_token_logits=torch.nn.functional.one_hot(picked, vocab).float(),
                                   hidden_states=None), True, True
        logits = torch.nn.functional.one_hot(choices, vocab).float().view(2 * B, vocab)
        return SimpleNamespace(next_token_logits=logits, hidden_states=None), True, True

    worker.verify_step = verify_step
    worker.time_step = lambda width, bs, request_widths, stream: timed.append((width, request_widths))

    class Lens(torch.Tensor):
        def record_stream(self, stream):
            pass

    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")], sampling_info=None,
                            has_grammar=False, return_logprob=False, spec_info=object(),
                            seq_lens=torch.tensor([10, 20]).as_subclass(Lens), forward_mode=ForwardMode.DECODE,
                            is_extend_in_batch=False)
    result = DFlashWorker.forward_batch_generation(worker, batch)
    verified = [B, B] if per_position else [B, 1]
    assert lanes_seen == [verified] and timed == [(B, (["a", "b"], verified))]
    assert result.accept_lens.tolist() == ([4, 4] if per_position else [4, 1])
    assert result.next_draft_input.bonus_tokens.tolist() == ([2, 1] if per_position else [2, 8])
    assert result.new_seq_lens.tolist() == ([14, 24] if per_position else [14, 21])


def test_server_info_counts_the_requests_that_fell_back(monkeypatch):
    from collections import Counter

    from sglang_dflash.fallback import ForcedFallback
    from sglang_dflash.host_pauses import process_pauses
    from sglang_dflash.worker import DFlashWorker

    worker = fallback_worker(ForcedFallback(), lambda bs: 16)
    worker.widths, worker.pauses = (16, 4, 1), process_pauses()
    worker.eager_verifies, worker.decode_steps, worker.eager_drafts = Counter(), 3, 0
    worker.prefills = worker.prefills_in_graphs = 0
    worker.hybrid = False  # a dense target reports no track slots
    worker.window = DraftRing(64, 16, SimpleNamespace(size=7), "cpu")
    worker.draft_model_runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(size=8 * 80))
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid=r) for r in "abc"])
    for _ in range(3):
        DFlashWorker.choose_widths(worker, batch, 3)
    info = DFlashWorker.server_info(worker)
    assert info["fallback"] == {"policy": "ForcedFallback", "requests": 3, "in_fallback": 3}
    assert info["widths_used"] == {"1": 1}
    assert info["draft_kv"] == {"layout": "ring", "tokens": 640, "window": 64, "ring_slots_per_request": 80}
    # /get_server_info on an idle server: the scheduler runs no request, so none is in fallback
    import sglang_dflash.integration as integration

    worker.server_info = partial(DFlashWorker.server_info, worker)
    idle = SimpleNamespace(draft_worker=worker, running_batch=SimpleNamespace(reqs=[]))
    monkeypatch.setattr(integration, "_serving", True)
    state = integration.server_info_hook(lambda s, r: SimpleNamespace(internal_state={}), idle, None).internal_state
    assert state["dflash"]["fallback"]["in_fallback"] == 0


def test_a_whole_step_with_every_request_in_fallback_is_a_plain_decode_where_width_one_saves_time(monkeypatch):
    from sglang_dflash.fallback import ForcedFallback
    from sglang_dflash.worker import DFlashWorker

    def never(bs):
        raise AssertionError("the policy's own choice is not asked for where width 1 saves time")

    worker, batch, _, _, written = whole_step_worker(monkeypatch, "graph", decodes=True)
    worker.fallback, counted = ForcedFallback(), []
    worker.fallback.steps = 2  # the next step is one of the pattern's all-fallback steps
    worker.width_policy = SimpleNamespace(choose=never, sleeping=lambda bs: None,
                                          fallback_width=lambda bs, fallen_tokens=1.0, timed=True: counted.append((bs, 1)) or 1)
    batch.reqs = [SimpleNamespace(rid="a"), SimpleNamespace(rid="b")]
    result = DFlashWorker.forward_batch_generation(worker, batch)
    assert result.speculative_num_draft_tokens == 1 and result.next_token_ids.tolist() == [22, 25]
    assert result.accept_lens.tolist() == [1, 1] and counted == [(2, 1)]
    assert worker.fallback.fallback_requests == 2 and len(written) == 1


def test_a_ragged_verify_asks_each_request_for_its_own_width_only_where_nothing_is_asked_per_position():
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    greedy = SimpleNamespace(is_all_greedy=True, logit_bias=None, has_custom_logit_processor=False)
    batch = SimpleNamespace(sampling_info=greedy, has_grammar=False, return_logprob=False,
                            seq_lens=torch.tensor([5, 9, 7]))
    mixed = (["a", "b", "c"], [8, 1, 8])
    assert DFlashWorker.ragged_lane_widths(worker, batch, 8, mixed, None) == [8, 1, 8]
    assert DFlashWorker.ragged_lane_widths(worker, batch, 8, None, None) == [8, 8, 8]  # compact: a layout always
    assert DFlashWorker.ragged_lane_widths(worker, batch, 8, mixed, torch.tensor([0, 1, 2])) == [8, 8, 8]
    for asks in ({"has_grammar": True}, {"return_logprob": True},
                 {"sampling_info": SimpleNamespace(**{**vars(greedy), "is_all_greedy": False})},
                 {"sampling_info": SimpleNamespace(**{**vars(greedy), "logit_bias": torch.zeros(3, 4)})},
                 {"sampling_info": SimpleNamespace(**{**vars(greedy), "has_custom_logit_processor": True})}):
        asking = SimpleNamespace(**{**vars(batch), **asks})
        assert DFlashWorker.ragged_lane_widths(worker, asking, 8, mixed, None) == [8, 8, 8]


@torch.no_grad()
def test_a_ragged_verify_packs_each_requests_lanes_and_accepts_what_each_would_accept_at_its_own_width(monkeypatch):
    """The target sees only each request's first w_i candidates, packed and padded to the tier; the
    accept from its packed rows equals each request's accept alone at its width."""
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.reference import accept_block as reference_accept
    from sglang_dflash.draft import DraftBlock
    from sglang_dflash.worker import Accepted, DFlashWorker

    monkeypatch.setattr(worker_mod, "accept_block", torch_accept_block)
    bs, B, vocab, tier = 3, 4, 9, 16
    candidates = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [2, 3, 4, 5]])
    choices = torch.tensor([[2, 3, 4, 0], [6, 7, 8, 1], [3, 4, 1, 2]])  # the target's choice after each candidate
    seen = {}

    def fake_verify(batch, block, layout):
        seen.update(ids=block.candidates.tolist(), positions=block.positions.tolist(),
                    slots=block.cache_loc.tolist(), layout=layout)
        rows = torch.zeros(tier, vocab)
        for lane, (r, c) in enumerate(zip(lanes_req, lanes_col)):
            rows[lane, choices[r, c]] = 1.0
        rows[sum(widths):, 0] = 5.0  # pad lanes: whatever the target says there is never read
        return SimpleNamespace(next_token_logits=rows, hidden_states=torch.arange(tier * 2.0).view(tier, 2)), True, False

    widths = [4, 1, 3]
    lanes_req = [0, 0, 0, 0, 1, 2, 2, 2]
    lanes_col = [0, 1, 2, 3, 0, 0, 1, 2]
    worker = object.__new__(DFlashWorker)
    worker.stalls = StepStalls()
    worker.device, worker.block_size = "cpu", B
    worker.model_runner = SimpleNamespace(decode_cuda_graph_runner=SimpleNamespace(capture_num_tokens=[4, 16]))
    worker.release = SimpleNamespace(ragged_layout=lambda w, device, tiers: SimpleNamespace(
        graph_num_tokens=next(t for t in tiers if t >= sum(w)), widths=list(w)))
    worker._verify = fake_verify
    positions = torch.arange(bs * B) + 100
    block = DraftBlock(candidates, positions, torch.arange(bs * B) + 1000, torch.tensor([9, 9, 9]))
    logits_output, _, written = DFlashWorker.verify_step(worker, SimpleNamespace(), block, widths)
    assert seen["layout"].graph_num_tokens == 16 and seen["layout"].widths == widths  # 8 lanes, 8 pads
    assert seen["ids"] == [1, 2, 3, 4, 5, 2, 3, 4] + [0] * 8  # pad lanes: id, position and slot 0
    assert seen["positions"] == [100, 101, 102, 103, 104, 108, 109, 110] + [0] * 8
    assert seen["slots"] == [1000, 1001, 1002, 1003, 1004, 1008, 1009, 1010] + [0] * 8
    assert logits_output.hidden_states.shape == (bs * B, 2)  # dense again, for a context written after
    assert logits_output.hidden_states[4].tolist() == [8.0, 9.0] and logits_output.hidden_states[5].eq(0).all()
    bufs = {k: torch.zeros(bs, dtype=torch.int64) for k in Accepted.__dataclass_fields__}
    bufs["out_tokens"] = torch.zeros(bs, B, dtype=torch.int64)
    batch = SimpleNamespace(sampling_info=None, seq_lens=torch.tensor([10, 20, 30]))
    got = DFlashWorker.accept_step(worker, batch, block, logits_output.next_token_logits, bufs)
    for i, w in enumerate(widths):
        alone = reference_accept(candidates[i:i + 1, :w], choices[i:i + 1, :w])
        assert got.commit_len[i] == alone.commit_len[0] and got.bonus[i] == alone.bonus[0]
    assert got.commit_len.tolist() == [4, 1, 3] and got.bonus.tolist() == [0, 6, 1]

    block = DraftBlock(candidates, positions, torch.arange(bs * B) + 1000, torch.tensor([9, 9, 9]))
    lanes_req, lanes_col = [r for r in range(bs) for _ in range(B)], [c for _ in range(bs) for c in range(B)]
    widths = [B] * bs  # a uniform block: the first bs * B rows are the dense block
    logits_output, _, _ = DFlashWorker.verify_step(worker, SimpleNamespace(), block, widths)
    assert block.lanes is None and logits_output.next_token_logits.shape == (bs * B, vocab)


def test_the_width_policy_hears_of_each_prefills_requests_at_the_next_decode_step():
    from sglang_dflash.worker import DFlashWorker

    heard = []
    policy = SimpleNamespace(admitted=lambda joined, bs: heard.append((joined, bs)), sleeping=lambda bs: None,
                             choose=lambda bs, timed=True: 16)
    worker = object.__new__(DFlashWorker)
    worker.width_policy, worker.fallback, worker.ragged, worker.block_size = policy, None, False, 16
    worker.clock, worker.stalls = SimpleNamespace(times_next=True), StepStalls()
    worker.prefills = worker.prefills_in_graphs = 0
    worker._target_worker = SimpleNamespace(forward_batch_generation=lambda batch, capture_hidden_mode: SimpleNamespace(
        logits_output=SimpleNamespace(hidden_states=torch.zeros(5, 4)),
        next_token_ids=torch.zeros(len(batch.reqs), dtype=torch.int64)))
    worker.output_counts = SimpleNamespace(start=lambda reqs: None)
    worker.draft_head = SimpleNamespace(observe=lambda ids, checked: None)
    worker.write_prefill_context = lambda batch, hidden: None
    for reqs in (["a", "b"], ["c"]):  # two prefills before a decode step
        batch = SimpleNamespace(reqs=reqs, input_ids=None, seq_lens=torch.full((len(reqs),), 7))
        DFlashWorker.prefill_step(worker, batch, None)
    assert DFlashWorker.choose_widths(worker, None, 4) == (16, None) and heard == [(3, 4)]
    DFlashWorker.choose_widths(worker, None, 4)
    assert heard == [(3, 4)]  # once
