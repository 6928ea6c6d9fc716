"""The pure-torch reference: the speculative loop is lossless, and the draft math is what DFlash says."""

import random

import pytest
import torch
from conftest import draft_config_dict

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.reference import (
    ReferenceDraft,
    TinyTarget,
    TinyTargetConfig,
    accept_block,
    draft_attention_mask,
    RequestParams,
    draft_proposer,
    speculative_generate,
    tapped_features,
    target_generate,
    truncate_at_stop,
)

torch.set_default_dtype(torch.float32)
LAYER_IDS = (1, 3, 4)
MASK_ID = 127


@pytest.fixture(scope="module")
def target():
    # Peaky logits, so greedy decoding is far from ties and the test decides.
    return TinyTarget(TinyTargetConfig(vocab_size=128, logit_scale=8.0), seed=0).eval()


def make_draft(block_size, seed=1, **overrides):
    raw = draft_config_dict(
        hidden_size=64, vocab_size=128,
        dflash_config={"target_layer_ids": list(LAYER_IDS), "mask_token_id": MASK_ID, "block_size": block_size},
        **overrides,
    )
    torch.manual_seed(seed)
    return ReferenceDraft(DFlashDraftConfig.from_dict(raw)).eval()


def oracle_proposer(target, prompt, truth, error_rate, seed):
    """Drafts the true continuation with random corruptions, so blocks are accepted partly."""
    rng = random.Random(seed)

    def propose(features, block, start):
        k = start - len(prompt) + 1  # index in `truth` of the first drafted token
        out = []
        for i in range(block.shape[0] - 1):
            tok = truth[k + i] if k + i < len(truth) else 0
            out.append((tok + 1) % 128 if rng.random() < error_rate else tok)
        return torch.tensor(out)

    return propose


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(120) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@torch.no_grad()
def test_reference_draft_loop_matches_target_greedy(target, block_size):
    draft = make_draft(block_size)
    for prompt in prompts(3, seed=block_size):
        truth = target_generate(target, prompt, 24)
        got = speculative_generate(target, draft_proposer(draft, target), prompt, 24, block_size, MASK_ID, LAYER_IDS)
        assert got.tokens == truth
        assert 1 + sum(got.accept_lengths) >= len(truth)  # the prefill token, then one per step


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@torch.no_grad()
def test_stop_tokens_and_max_tokens_mid_block(target, block_size):
    """High-acceptance drafts: stops and budgets land inside accepted blocks, output still exact."""
    mid_block_stops = 0
    for i, prompt in enumerate(prompts(6, seed=100 + block_size)):
        full = target_generate(target, prompt, 40)
        stop = full[len(full) // 2 + i % 3]  # a token the target really emits
        max_new = 17 + i
        truth = target_generate(target, prompt, max_new, stop_ids=[stop])
        propose = oracle_proposer(target, prompt, full, error_rate=0.1, seed=i)
        got = speculative_generate(target, propose, prompt, max_new, block_size, MASK_ID, LAYER_IDS, stop_ids=[stop])
        assert got.tokens == truth, (block_size, i)
        # The last step committed more than was kept: the stop/budget fell inside its block.
        committed = len(got.accept_lengths) and 1 + sum(got.accept_lengths)
        mid_block_stops += committed > len(truth)
    if block_size > 2:
        assert mid_block_stops > 0


PARAMS = {
    "repetition_penalty": RequestParams(repetition_penalty=1.6),
    "frequency_penalty": RequestParams(frequency_penalty=0.9),
    "presence_penalty": RequestParams(presence_penalty=2.0),
    "min_new_tokens": RequestParams(min_new_tokens=12),
    "logit_bias": RequestParams(logit_bias={5: 6.0, 7: -50.0}),
    "all_together": RequestParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5,
                                  min_new_tokens=6, logit_bias={9: 3.0}),
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(PARAMS))
@torch.no_grad()
def test_every_sampling_parameter_acts_per_verify_position(target, name, block_size):
    """Greedy with penalties, min_new_tokens and logit bias: verify position k sees the state after
    the block's tokens before it, so the loop gives plain decoding's tokens, while the drafts are
    accepted several at a time (the parameters change the output, so the test decides)."""
    params, changed, multi = PARAMS[name], 0, 0
    for i, prompt in enumerate(prompts(4, seed=216)):  # prompts whose outputs repeat tokens before the stop
        plain = target_generate(target, prompt, 40)
        stop = plain[len(plain) // 3]
        truth = target_generate(target, prompt, 40, stop_ids=[stop], params=params)
        changed += truth != target_generate(target, prompt, 40, stop_ids=[stop])
        propose = oracle_proposer(target, prompt, truth, error_rate=0.15, seed=i)
        got = speculative_generate(target, propose, prompt, 40, block_size, MASK_ID, LAYER_IDS, stop_ids=[stop],
                                   params=params)
        assert got.tokens == truth, (name, block_size, i)
        multi += any(n > 2 for n in got.accept_lengths)
    assert changed > 0 and multi > 0, (changed, multi)


@torch.no_grad()
def test_sampling_with_penalties_is_exact():
    """With temperature and penalties, the loop's first two tokens follow plain decoding's law."""
    target = TinyTarget(TinyTargetConfig(vocab_size=6, hidden_size=32, num_layers=5, logit_scale=2.0), seed=3)
    params = RequestParams(repetition_penalty=2.0, presence_penalty=0.7, logit_bias={4: 1.0})
    prompt = [1, 2, 3]
    logits, _ = target(torch.tensor(prompt))
    p1 = torch.softmax(params.adjust(logits[-1], [], ()).double(), -1)
    exact = torch.zeros(6, 6, dtype=torch.float64)
    for a in range(6):
        l2, _ = target(torch.tensor(prompt + [a]))
        exact[a] = p1[a] * torch.softmax(params.adjust(l2[-1], [a], ()).double(), -1)
    g = torch.Generator().manual_seed(1)
    n = 3000
    counts = torch.zeros(6, 6, dtype=torch.float64)
    for i in range(n):
        drafts = lambda feats, block, start, tok=i % 6: torch.full((block.shape[0] - 1,), tok)  # noqa: E731
        out = speculative_generate(target, drafts, prompt, 2, 4, 5, (1, 2), temperature=1.0, generator=g,
                                   params=params)
        counts[out.tokens[0], out.tokens[1]] += 1
    tv = 0.5 * (counts / n - exact).abs().sum()
    assert tv < 0.06, tv


def test_accept_block_rule():
    cand = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 9, 2, 3], [5, 1, 2, 3]])
    tgt = torch.tensor([[1, 2, 3, 4], [1, 2, 7, 4], [1, 2, 3, 4], [1, 2, 3, 8]])
    acc = accept_block(cand, tgt)
    assert acc.accept_len.tolist() == [3, 2, 0, 3]
    assert acc.bonus.tolist() == [4, 7, 1, 8]
    assert acc.commit_len.tolist() == [4, 3, 1, 4]
    committed = [acc.out_tokens[i, : n].tolist() for i, n in enumerate(acc.commit_len.tolist())]
    assert committed == [[1, 2, 3, 4], [1, 2, 7], [1], [1, 2, 3, 8]]


def test_accept_stops_at_first_mismatch_even_if_later_drafts_match():
    acc = accept_block(torch.tensor([[0, 1, 9, 3, 4]]), torch.tensor([[1, 2, 3, 4, 5]]))
    assert acc.accept_len.tolist() == [1] and acc.bonus.tolist() == [2]


def test_truncate_at_stop():
    assert truncate_at_stop([1, 2, 3, 4], [3], 10) == ([1, 2, 3], True)
    assert truncate_at_stop([1, 2, 3, 4], [9], 2) == ([1, 2], True)
    assert truncate_at_stop([1, 2], [9], 5) == ([1, 2], False)


@torch.no_grad()
def test_cached_context_kv_equals_full_forward():
    """Writing ctx K/V once per token (as the server does) equals recomputing from features."""
    draft = make_draft(8)
    feats = torch.randn(11, 3 * 64)
    blk = torch.randn(8, 64)
    pos = torch.arange(11, 19)
    full = draft(blk, pos, feats, torch.arange(11))
    ctx = draft.project_context(feats)
    kv_a = draft.context_kv(ctx[:6], torch.arange(6))
    kv_b = draft.context_kv(ctx[6:], torch.arange(6, 11))
    kv = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(kv_a, kv_b)]
    torch.testing.assert_close(draft.forward_with_context_kv(blk, pos, kv), full)


@torch.no_grad()
def test_block_is_bidirectional_in_full_layers_and_causal_in_sliding_layers():
    feats, pos = torch.randn(5, 3 * 64), torch.arange(5, 13)
    blk = torch.randn(8, 64)
    changed = blk.clone()
    changed[6] += 1.0  # perturb a late slot
    full = make_draft(8)
    a, b = full(blk, pos, feats, torch.arange(5)), full(changed, pos, feats, torch.arange(5))
    assert not torch.allclose(a[1], b[1])  # an earlier slot sees the later one
    sliding = make_draft(8, layer_types=["sliding_attention"] * 2, sliding_window=4)
    masks = sliding.layer_masks(torch.tensor([5]), 5)
    a = sliding(blk, pos, feats, torch.arange(5), masks)
    b = sliding(changed, pos, feats, torch.arange(5), masks)
    torch.testing.assert_close(a[:6], b[:6])  # causal: slots before 6 do not see it
    assert not torch.allclose(a[6], b[6])


def test_mask_rules_for_training_layout():
    m = draft_attention_mask(torch.tensor([2, 5]), block_size=3, context_len=8)
    # query 0 (block anchored at 2) sees ctx 0,1 only; its own block only
    assert m[0, :8].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert m[0, 8:].tolist() == [1, 1, 1, 0, 0, 0]
    assert m[4, :8].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert m[4, 8:].tolist() == [0, 0, 0, 1, 1, 1]
    s = draft_attention_mask(torch.tensor([5]), block_size=3, context_len=5, causal=True, sliding_window=3)
    # slot 1 at position 6: window of 3 keys = positions 4, 5, 6
    assert s[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    w = draft_attention_mask(torch.tensor([5]), block_size=2, context_len=5, context_window=2)
    assert w[0, :5].tolist() == [0, 0, 0, 1, 1]


@torch.no_grad()
def test_temperature_sampling_is_exact():
    """With temperature, the loop's first two tokens follow the target's distribution."""
    target = TinyTarget(TinyTargetConfig(vocab_size=6, hidden_size=32, num_layers=5, logit_scale=2.0), seed=3)
    prompt = [1, 2, 3]
    logits, _ = target(torch.tensor(prompt))
    p1 = torch.softmax(logits[-1].double(), -1)
    exact = torch.zeros(6, 6, dtype=torch.float64)
    for a in range(6):
        l2, _ = target(torch.tensor(prompt + [a]))
        exact[a] = p1[a] * torch.softmax(l2[-1].double(), -1)

    def always(tok):  # a deterministic draft that is right about as often as chance
        return lambda feats, block, start: torch.full((block.shape[0] - 1,), tok)

    g = torch.Generator().manual_seed(0)
    n = 3000
    counts = torch.zeros(6, 6, dtype=torch.float64)
    for i in range(n):
        out = speculative_generate(target, always(i % 6), prompt, 2, 4, 5, (1, 2), temperature=1.0, generator=g)
        counts[out.tokens[0], out.tokens[1]] += 1
    tv = 0.5 * (counts / n - exact).abs().sum()
    assert tv < 0.06, tv  # sampling noise at n=3000 is ~0.03; a biased rule is far off


@torch.no_grad()
def test_tapped_features_use_layer_outputs():
    target = TinyTarget(TinyTargetConfig(), seed=0)
    _, hidden = target(torch.tensor([1, 2, 3]))
    f = tapped_features(hidden, [0, 2])
    torch.testing.assert_close(f, torch.cat([hidden[1], hidden[3]], -1))
