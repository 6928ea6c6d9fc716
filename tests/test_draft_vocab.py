"""The draft's greedy head over part of the vocabulary (``SGLANG_DFLASH_DRAFT_VOCAB``): it proposes
the best token among the rows it reads, by that token's own id, the rows follow the tokens served,
and plain decoding's tokens come out whatever it proposes."""

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash import draft as draft_mod
from sglang_dflash.config import DRAFT_VOCAB_ENV, DFlashConfigError, draft_vocab_rows
from sglang_dflash.reference import TinyTarget, TinyTargetConfig, speculative_generate, target_generate


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.setattr(draft_mod, "get_tp_group", lambda: SimpleNamespace(world_size=1))
    monkeypatch.setattr(draft_mod, "get_parallel", lambda: SimpleNamespace(tp_rank=0))


def head_over(weight: torch.Tensor, rows, block_size: int = 4) -> draft_mod.GreedyDraftHead:
    return draft_mod.GreedyDraftHead(SimpleNamespace(weight=weight), block_size=block_size, max_bs=4, vocab_rows=rows)


def test_the_head_proposes_the_best_row_it_reads_by_that_rows_token_id():
    torch.manual_seed(0)
    lm_head = torch.randn(200, 32)
    head = head_over(lm_head, 64)
    served = torch.cat([torch.arange(2, 40), torch.arange(150, 200)] * 5)  # 88 tokens for 64 rows
    head.observe(served[torch.randperm(len(served))])
    head.observe(torch.tensor([199, 3, 160] * 20))
    head.maybe_rebuild()
    ids = head.vocab.ids
    assert {199, 3, 160} <= set(ids.tolist()) and ids.tolist() == sorted(ids.tolist()) and ids[-1] == 199
    hidden = torch.randn(4 * 4, 32) * 3
    logits = hidden.view(4, 4, 32)[:, 1:].reshape(-1, 32) @ lm_head.T
    got = head(hidden)
    assert got.tolist() == ids[logits[:, ids].argmax(-1)].tolist()
    full = logits.argmax(-1)
    inside = torch.isin(full, ids)
    assert (got[inside] == full[inside]).all()
    assert (~inside).any() and torch.isin(got, ids).all()  # a best token outside is never proposed


def test_tied_rows_go_to_the_lower_id_as_a_full_argmax_does():
    torch.manual_seed(1)
    lm_head = torch.randn(100, 16)
    lm_head[40] = lm_head[5]
    head = head_over(lm_head, 48)
    hidden = lm_head[5].repeat(4 * 4, 1)
    full = (hidden.view(4, 4, 16)[:, 1:].reshape(-1, 16) @ lm_head.T).argmax(-1)
    assert set(full.tolist()) == {5} and head(hidden).tolist() == full.tolist()


def test_the_rows_follow_the_tokens_served_and_keep_their_buffers():
    torch.manual_seed(2)
    lm_head = torch.randn(500, 16)
    head = head_over(lm_head, 32)
    vocab = head.vocab
    assert vocab.ids.tolist() == list(range(32))  # nothing counted yet: the lowest ids
    where = (vocab.ids.data_ptr(), vocab.weight.data_ptr())
    head.observe(torch.tensor([[480, 481, 482, 483]] * 63))  # 252 counted: not yet due
    head.maybe_rebuild()
    assert vocab.rebuilds == 0
    head.observe(torch.tensor([499, 480, 480, 3]))
    head.maybe_rebuild()
    assert vocab.rebuilds == 1 and vocab.due == 2 * vocab.REFRESH_FIRST
    assert vocab.ids.tolist() == list(range(27)) + [480, 481, 482, 483, 499]  # then the lowest unseen ids
    torch.testing.assert_close(vocab.weight, lm_head[vocab.ids])
    assert (vocab.ids.data_ptr(), vocab.weight.data_ptr()) == where  # CUDA graphs read these
    # A prompt's placeholder ids beyond the vocabulary are not counted.
    before = vocab.counts.clone()
    head.observe(torch.tensor([10**9, -5, 499]), checked=True)
    assert (vocab.counts - before).tolist() == [0.0] * 499 + [1.0]


def test_once_rebuilds_are_rare_old_counts_fade():
    head = head_over(torch.randn(300, 16), 16)
    vocab = head.vocab
    rebuilds = 0
    while vocab.due < vocab.REFRESH_CAP:
        head.observe(torch.full((vocab.due,), 250))
        head.maybe_rebuild()
        rebuilds += 1
    assert rebuilds == 8 and vocab.counts[250] == sum(256 << k for k in range(8))  # kept whole so far
    head.observe(torch.full((vocab.REFRESH_CAP - 16,), 260))
    head.observe(torch.full((16,), 270))
    head.maybe_rebuild()
    assert 250 in vocab.ids.tolist() and vocab.counts[250] == sum(256 << k for k in range(8)) / 2
    for _ in range(4):  # the traffic moved on: 250 drops out of the set
        head.observe(torch.tensor(list(range(260, 276)) * (vocab.REFRESH_CAP // 16)))
        head.maybe_rebuild()
    assert vocab.ids.tolist() == list(range(260, 276))


@torch.no_grad()
def test_plain_decodings_tokens_whatever_rows_the_head_reads():
    """The tiny target with a head that proposes its own next tokens as far as its rows allow:
    the same tokens as plain decoding with the lowest ids, rows learnt from the traffic, and every
    row; more drafts accepted once the rows follow the traffic."""
    target = TinyTarget(TinyTargetConfig(vocab_size=256, logit_scale=8.0), seed=3).eval()
    prompts = [[int(t) for t in torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(i))]
               for i in range(4)]
    truths = [target_generate(target, p, 40) for p in prompts]
    block = 4

    def run(head):
        accepted = []
        for prompt, truth in zip(prompts, truths):
            def propose(features, block_ids, start, prompt=prompt, truth=truth):
                k = start - len(prompt) + 1  # the draft that knows the answer, seen through the head
                want = [truth[min(k + j, len(truth) - 1)] for j in range(block)]
                return head(target.lm_head[want])

            got = speculative_generate(target, propose, prompt, 40, block, 255, (0, 1))
            assert got.tokens == truth
            accepted += got.accept_lengths
        return sum(accepted) / len(accepted)

    every_row = head_over(target.lm_head, None, block)
    assert every_row.vocab is None and every_row.rows_read is None
    full = run(every_row)
    lowest = head_over(target.lm_head, 32, block)
    assert lowest.vocab is not None and lowest.rows_read == 32
    at_lowest = run(lowest)
    for truth in truths:
        lowest.observe(torch.tensor(truth * 8))
    lowest.maybe_rebuild()
    learnt = run(lowest)
    assert at_lowest < learnt <= full and learnt > 0.9 * full, (at_lowest, learnt, full)


def test_which_rows_the_switch_asks_for(monkeypatch):
    monkeypatch.delenv(DRAFT_VOCAB_ENV, raising=False)
    assert draft_vocab_rows(151936) == 32768 and draft_vocab_rows(49152) is None  # auto: large vocabularies
    monkeypatch.setenv(DRAFT_VOCAB_ENV, "full")
    assert draft_vocab_rows(151936) is None
    monkeypatch.setenv(DRAFT_VOCAB_ENV, "8192")
    assert draft_vocab_rows(49152) == 8192 and draft_vocab_rows(4096) is None
    for bad in ("lots", "100", "0"):
        monkeypatch.setenv(DRAFT_VOCAB_ENV, bad)
        with pytest.raises(DFlashConfigError, match=DRAFT_VOCAB_ENV):
            draft_vocab_rows(49152)


def test_a_ranks_rows_come_from_its_own_vocabulary_shard():
    """TP: this rank holds ids 100..199; tokens of other shards are not counted, and the ids it
    returns are local rows (the head adds the shard's start)."""
    shard = torch.randn(100, 8)
    vocab = draft_mod.DraftVocab(shard, 16, vocab_start=100, sharded=True)
    vocab.observe(torch.tensor([5, 99, 250, 180, 180, 150] * 60))
    assert vocab.counts.round().tolist() == [0.0] * 50 + [60.0] + [0.0] * 29 + [120.0] + [0.0] * 19
    vocab.rebuild()
    assert vocab.ids.tolist() == list(range(14)) + [50, 80]
    torch.testing.assert_close(vocab.weight, shard[vocab.ids])
