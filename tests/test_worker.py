"""CPU checks of the worker's host-side bookkeeping (the GPU suite runs the worker itself)."""

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import draft_config_dict

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.reference import ReferenceDraft
from sglang_dflash.worker import DraftWindow, StepBuffers, extend_positions, mamba_track_steps


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


def test_scaling_penalties_reach_every_block_position():
    """A repetition penalty divides positive logits and multiplies negative ones (SGLang's
    apply_scaling_penalties); it must act on the logits, not on a zero bias added to them."""
    from sglang_dflash.worker import DFlashWorker

    def apply_logits_bias(logits):
        logits[:] = torch.where(logits < 0, logits * scale, logits / scale)

    bs, block, vocab = 2, 4, 8
    scale = torch.tensor([[2.0], [1.0]])
    info = SimpleNamespace(logit_bias=None, acc_additive_penalties=None, acc_scaling_penalties=scale,
                           penalizer_orchestrator=None, has_custom_logit_processor=False,
                           apply_logits_bias=apply_logits_bias)
    logits = torch.randn(bs * block, vocab)
    expected = logits.view(bs, block, vocab).clone()
    expected[0] = torch.where(expected[0] < 0, expected[0] * 2, expected[0] / 2)
    DFlashWorker._apply_logit_adjustments(logits, info, bs)
    torch.testing.assert_close(logits.view(bs, block, vocab), expected)
