"""Request parameters per verify position on the server path (``sampling.py`` and the worker's
accept step), against ``reference.RequestParams``, which plain decoding follows token by token."""

import random
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

from sglang_dflash import compat, sampling
from sglang_dflash.reference import RequestParams, TinyTarget, TinyTargetConfig, accept_block, target_generate
from sglang_dflash.sampling import OutputCounts, Penalties, penalize_block
from sglang_dflash.worker import DFlashWorker

torch.set_default_dtype(torch.float32)
V = 12


def fake_req(rid, output_ids=(), stops=(), finished=False, **params):
    sp = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0)
    sp.update(params)
    return SimpleNamespace(rid=rid, output_ids=list(output_ids), sampling_params=SimpleNamespace(**sp),
                           stop_ids=set(stops), finished=lambda: finished)


def request_params(req) -> RequestParams:
    sp = req.sampling_params
    return RequestParams(sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty, sp.min_new_tokens)


def random_requests(rng, n):
    reqs = []
    for i in range(n):
        kind = rng.choice(["none", "rep", "freq", "pres", "min_new", "all"])
        params = {
            "none": {}, "rep": dict(repetition_penalty=1.7), "freq": dict(frequency_penalty=0.8),
            "pres": dict(presence_penalty=1.5), "min_new": dict(min_new_tokens=rng.randrange(1, 12)),
            "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6, min_new_tokens=5),
        }[kind]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
        reqs.append(fake_req(f"r{i}", output, stops=rng.sample(range(V), 2), **params))
    return reqs


def test_every_position_gets_plain_decodings_logits():
    """Position k of a block equals RequestParams.adjust after the prior output and candidates
    0..k, for every parameter, with tokens repeated inside the block; a per-block state would not."""
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    bs, B = 24, 8
    reqs = random_requests(rng, bs)
    candidates = torch.randint(0, V, (bs, B), generator=g)  # V=12: repeats in most blocks
    raw = torch.randn(bs, B, V, generator=g) * 3
    counts = torch.stack([torch.bincount(torch.tensor(r.output_ids, dtype=torch.long), minlength=V).float()
                          for r in reqs])
    n_out = torch.tensor([len(r.output_ids) for r in reqs])
    sp = [r.sampling_params for r in reqs]
    stop_mask = torch.zeros(bs, V, dtype=torch.bool)
    for i, r in enumerate(reqs):
        stop_mask[i, list(r.stop_ids)] = True
    p = Penalties(torch.tensor([s.frequency_penalty for s in sp]), torch.tensor([s.presence_penalty for s in sp]),
                  torch.tensor([s.repetition_penalty for s in sp]), torch.tensor([s.min_new_tokens for s in sp]),
                  stop_mask)
    got = raw.clone()
    penalize_block(got, candidates, counts, n_out, p)
    stale = 0
    for i, r in enumerate(reqs):
        params = request_params(r)
        for k in range(B):
            generated = r.output_ids + candidates[i, : k + 1].tolist()
            want = params.adjust(raw[i, k], generated, sorted(r.stop_ids))
            torch.testing.assert_close(got[i, k], want, msg=f"request {i} ({params}), position {k}")
            block_start = params.adjust(raw[i, k], r.output_ids + candidates[i, :1].tolist(), sorted(r.stop_ids))
            stale += not torch.equal(block_start, want)
    assert stale > bs, stale  # most penalized positions differ from the state at the block's start


def test_output_counts_follow_each_request_through_prefill_steps_and_reuse():
    counts = OutputCounts(V, "cpu", stop_ids=lambda req: req.stop_ids)
    plain = fake_req("plain")
    counts.start([plain])
    assert counts.batch_rows([plain]) is None  # nobody penalized: the worker's fast path

    a = fake_req("a", output_ids=[3, 3, 5], frequency_penalty=0.5)  # resumed after a retraction
    b = fake_req("b", min_new_tokens=4, stops=[7])
    counts.start([a, plain, b])
    rows = counts.batch_rows([a, plain, b])
    assert rows[1] == 0 and rows[0] > 0 and rows[2] > 0 and rows[0] != rows[2]
    assert counts.counts[rows[0]].tolist() == torch.bincount(torch.tensor([3, 3, 5]), minlength=V).float().tolist()
    assert counts.n_out[rows[0]] == 3 and counts.stop_mask[rows[2], 7] and counts.min_new_tokens[rows[2]] == 4

    # A step commits the old bonus and the accepted drafts: candidates 0..commit_len-1.
    candidates = torch.tensor([[1, 2, 2, 9], [4, 4, 4, 4], [6, 0, 1, 2]])
    counts.commit(rows, candidates, torch.tensor([3, 4, 1]))
    committed = torch.tensor([3, 3, 5, 1, 2, 2])
    assert counts.counts[rows[0]].tolist() == torch.bincount(committed, minlength=V).float().tolist()
    assert counts.counts[rows[2]].tolist() == torch.bincount(torch.tensor([6]), minlength=V).float().tolist()
    assert counts.n_out.tolist()[: 1] == [0] and counts.counts[0].sum() == 0  # the neutral row stays neutral
    assert counts.n_out[rows[0]] == 6 and counts.n_out[rows[2]] == 1

    # A finished request's row goes to the next newcomer once it has left the batch; rows grow.
    a.finished = lambda: True
    newcomers = [fake_req(f"n{i}", presence_penalty=1.0) for i in range(12)]
    counts.start(newcomers)  # a prefill batch holds only prefilling requests (no mixed chunks with DFLASH)
    rows_now = counts.batch_rows([b] + newcomers)
    assert "a" not in counts.rows and int(rows[0]) in rows_now.tolist()
    assert len(set(rows_now.tolist())) == 13 and counts.capacity >= 14
    assert counts.counts[int(rows[0])].sum() == 0 and counts.n_out[rows_now[0]] == 1  # b kept its state


def test_a_request_the_worker_never_prefilled_starts_from_its_host_output():
    counts = OutputCounts(V, "cpu", stop_ids=lambda req: ())
    counts.start([fake_req("x", presence_penalty=1.0)])
    late = fake_req("late", output_ids=[2, 2], repetition_penalty=1.5)
    rows = counts.batch_rows([late])
    assert rows.tolist()[0] > 0 and counts.counts[rows[0], 2] == 2


def run_server_like(target, prompts, params, proposer, block_size, max_new, stop_ids, join_at):
    """The worker's steps on CPU: prefill (rows from the host output), then per step draft,
    verify logits, penalize from the GPU-side counts, greedy accept, commit; request i joins the
    batch at step join_at[i], so rows are shared, reused and batches change shape."""
    counts = OutputCounts(target.cfg.vocab_size, "cpu", stop_ids=lambda req: stop_ids)
    reqs = [SimpleNamespace(rid=f"q{i}", output_ids=[], sampling_params=SimpleNamespace(
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_new_tokens), done=False)
        for i, p in enumerate(params)]
    for r in reqs:
        r.finished = lambda r=r: r.done
    running, step = [], 0
    while any(not r.done for r in reqs):
        joining = [i for i, at in enumerate(join_at) if at == step]
        if joining:
            counts.start([reqs[i] for i in joining])
            for i in joining:  # SGLang's prefill samples the first token with fresh penalizers
                logits, _ = target(torch.tensor(prompts[i]))
                reqs[i].output_ids.append(int(params[i].adjust(logits[-1], [], stop_ids).argmax()))
                running.append(i)
        live = [i for i in running if not reqs[i].done]
        if live:
            batch = [reqs[i] for i in live]
            cands, logits = [], []
            for i in live:
                out = reqs[i].output_ids
                cand = [out[-1]] + proposer(i, len(out), block_size - 1)
                seq = torch.tensor(prompts[i] + out[:-1] + cand)
                logits.append(target(seq)[0][-block_size:])
                cands.append(cand)
            cands, logits = torch.tensor(cands), torch.stack(logits)
            rows = counts.batch_rows(batch)
            if rows is not None:
                counts.penalize(logits, cands, rows)
            acc = accept_block(cands, logits.argmax(-1))
            if rows is not None:
                counts.commit(rows, cands, acc.commit_len)
            for j, i in enumerate(live):
                r = reqs[i]
                r.output_ids += acc.out_tokens[j, : int(acc.commit_len[j])].tolist()
                hit = next((n for n, t in enumerate(r.output_ids) if t in stop_ids), None)
                if hit is not None or len(r.output_ids) >= max_new:
                    r.output_ids = r.output_ids[: min(max_new, hit + 1 if hit is not None else max_new)]
                    r.done = True
        step += 1
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("block_size,chunk_requests", [(4, None), (8, None), (8, 1), (4, 3)])
@torch.no_grad()
def test_server_path_gives_plain_decodings_tokens_with_every_penalty(block_size, chunk_requests, monkeypatch):
    """Seven requests with different parameters, joining at different steps, decoded through
    OutputCounts exactly as the worker drives it: each gets plain decoding's tokens (greedy,
    float32), while several drafts are accepted per step. The same a few requests at a time (a
    big vocabulary's batch is penalized in parts)."""
    if chunk_requests is not None:
        monkeypatch.setattr(sampling, "CHUNK_ENTRIES", chunk_requests * block_size * 64)
    target = TinyTarget(TinyTargetConfig(vocab_size=64, logit_scale=8.0), seed=0).eval()
    rng = random.Random(216)
    prompts = [[rng.randrange(60) for _ in range(rng.randrange(3, 10))] for _ in range(7)]
    params = [RequestParams(), RequestParams(repetition_penalty=1.6), RequestParams(frequency_penalty=0.9),
              RequestParams(presence_penalty=2.0), RequestParams(min_new_tokens=20),
              RequestParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5, min_new_tokens=6),
              RequestParams(frequency_penalty=0.3)]
    stop_ids, max_new = [7], 32
    truth = [target_generate(target, p, max_new, stop_ids=stop_ids, params=q) for p, q in zip(prompts, params)]
    unpenalized = [target_generate(target, p, max_new, stop_ids=stop_ids) for p in prompts]
    assert sum(t != u for t, u in zip(truth, unpenalized)) >= 4  # the parameters change the output

    flip = random.Random(1)

    def proposer(i, done, n):  # the true continuation with some corruptions
        return [(truth[i][done + j] if done + j < len(truth[i]) else 0) ^ (flip.random() < 0.15) for j in range(n)]

    joins = [0, 0, 1, 1, 2, 3, 3]
    got = run_server_like(target, prompts, params, proposer, block_size, max_new, stop_ids, join_at=joins)
    assert got == truth


# lab/request_params_matrix.py's "penalties_together" row.
TOGETHER = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.3, min_new_tokens=8,
                stop_token_ids={0})
TOGETHER_BIAS = {7: 1.5}
# The classes SGLang builds its orchestrator from, as a set (sampling_batch_info.py:276-285 in 0.5.23).
ADDITIVE_THEN_REPETITION = [penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
                            penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer]


class FakeScheduleBatch:  # what the orchestrator reads of a ScheduleBatch while it prepares its penalizers
    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def sglang_req(output_ids, **params):
    sp = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
              stop_token_ids=None)
    sp.update(params)
    tokenizer = SimpleNamespace(eos_token_id=11, additional_stop_token_ids={10})
    return SimpleNamespace(rid="r", output_ids=list(output_ids), sampling_params=SimpleNamespace(**sp),
                           eos_token_ids={9}, tokenizer=tokenizer, finished=lambda: False)


def sglang_sampling_info(req, logit_bias, penalizers=ADDITIVE_THEN_REPETITION) -> SamplingBatchInfo:
    """SGLang's own sampling info for one request about to decode after its ``output_ids``: the
    penalizers advance by one token per decode step, as ``prepare_for_decode`` advances them."""
    batch = FakeScheduleBatch([req])
    orchestrator = BatchedPenalizerOrchestrator(V, batch, penalizers)
    for token in req.output_ids:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    bias = torch.zeros(1, V)
    bias[0, list(logit_bias)] = torch.tensor(list(logit_bias.values()))
    one = torch.ones(1)
    return SamplingBatchInfo(
        temperatures=one[:, None], top_ps=one, top_ks=one.int(), min_ps=0 * one, is_all_greedy=True,
        is_any_greedy=True, need_top_p_sampling=False, need_top_k_sampling=False, need_min_p_sampling=False,
        vocab_size=V, penalizer_orchestrator=orchestrator, logit_bias=bias, device="cpu",
    )


# SGLang compiles its repetition scaling; eager is the same arithmetic and spares a compile.
@torch.compiler.set_stance("force_eager")
def test_combined_parameters_equal_sglangs_own_sampling_info_at_every_position():
    """The lab's combined row through the worker's apply_request_params, against SGLang's sampling
    info on the path its overlap scheduler and speculative workers take (copy_for_forward: the
    additive penalties accumulated in one tensor, then the repetition scaling, then the logit
    bias), bit for bit. Token 7 is both biased and repetition-scaled; the stop ids (stop_token_ids,
    the model's and the tokenizer's eos) are held back while the output is shorter than 8.
    Counts stay below 6: SGLang adds 0.3 once per occurrence, which differs from 0.3 * count in
    the last bit from there on."""
    release = compat.running()
    prior, candidates = [7, 3, 7, 5, 3], [3, 7, 2, 7, 4]  # position k follows 6 + k output tokens
    raw = torch.randn(len(candidates), V, generator=torch.Generator().manual_seed(0)) * 3
    req = sglang_req(prior, **TOGETHER)
    counts = OutputCounts(V, "cpu", release.min_new_tokens_stop_ids)
    counts.start([req])
    got = raw.clone()[None]
    DFlashWorker.apply_request_params(SimpleNamespace(output_counts=counts), got, torch.tensor([candidates]),
                                      sglang_sampling_info(req, TOGETHER_BIAS), counts.batch_rows([req]))
    params = RequestParams(1.2, 0.3, 0.3, 8, TOGETHER_BIAS)
    for k in range(len(candidates)):
        step = sglang_req(prior + candidates[: k + 1], **TOGETHER)
        want = raw[k : k + 1].clone()
        sglang_sampling_info(step, TOGETHER_BIAS).copy_for_forward().apply_logits_bias(want)
        assert torch.equal(got[0, k], want[0]), k
        stop_ids = sorted(release.min_new_tokens_stop_ids(step))
        assert torch.equal(params.adjust(raw[k], step.output_ids, stop_ids), want[0]), k
    stops = sorted(release.min_new_tokens_stop_ids(req))  # the model's eos 9 joins them from 0.5.19
    assert {0, 10, 11} <= set(stops)
    assert got[0, :2, stops].isneginf().all() and got[0, 2:, stops].isfinite().all()  # free from the 8th token


@torch.compiler.set_stance("force_eager")
def test_sglangs_sync_decoding_matches_only_with_repetition_applied_last():
    """Without the overlap scheduler SGLang's plain decoding applies each penalizer in place, in the
    order the orchestrator's dict takes from that set (orchestrator.py:23), which follows the
    classes' addresses: it changes from one server process to the next. Repetition applied last
    gives the accumulated order up to rounding; repetition first moves every seen token's logit."""
    req = sglang_req([7, 3, 7, 5, 3, 2], **TOGETHER)
    raw = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 3
    accumulated = raw.clone()
    sglang_sampling_info(req, TOGETHER_BIAS).copy_for_forward().apply_logits_bias(accumulated)
    repetition_last, repetition_first = raw.clone(), raw.clone()
    sglang_sampling_info(req, TOGETHER_BIAS).apply_logits_bias(repetition_last)
    sglang_sampling_info(req, TOGETHER_BIAS, ADDITIVE_THEN_REPETITION[-1:] + ADDITIVE_THEN_REPETITION[:-1]
                         ).apply_logits_bias(repetition_first)
    torch.testing.assert_close(repetition_last, accumulated)
    seen, unseen = [2, 3, 5, 7], [1, 4, 6, 8]
    assert torch.equal(repetition_first[0, unseen], accumulated[0, unseen])
    assert ((repetition_first[0, seen] - accumulated[0, seen]).abs() > 0.01).all()


class FakeLogitsProcessor:
    """SGLang's LogitsProcessor as far as the verify's lm_head goes: the GEMM in the model's dtype,
    then the float32 cast into the shared buffer (``_copy_logits_to_buffer``)."""

    def __init__(self, vocab_size, **attrs):
        self.vocab_size, self.logit_scale, self.final_logit_softcapping = vocab_size, None, None
        self.do_tensor_parallel_all_gather = self.use_fp32_lm_head = False
        self.calls = 0
        self.__dict__.update(attrs)

    def _get_logits(self, hidden_states, lm_head, logits_metadata, embedding_bias=None, use_logits_buffer=True):
        self.calls += 1
        logits = torch.mm(hidden_states, lm_head.weight.t())[:, : self.vocab_size]
        if self.logit_scale is not None:
            logits.mul_(self.logit_scale)
        buf = logits_metadata.next_token_logits_buffer if use_logits_buffer else None
        if buf is not None and buf.shape == logits.shape:
            return buf.copy_(logits)
        return logits.float()


def verify_metadata(rows, vocab, mode="TARGET_VERIFY", buffer=True):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    buf = torch.full((rows, vocab), float("nan")) if buffer else None
    return SimpleNamespace(forward_mode=getattr(ForwardMode, mode), next_token_logits_buffer=buf)


@pytest.mark.parametrize("padded_rows", [0, 24])
def test_half_verify_logits_are_the_lm_heads_output_in_the_shared_buffer_with_sglangs_argmax(padded_rows):
    """A TARGET_VERIFY forward's logits: the lm_head's bf16 output, written over the float32 buffer
    SGLang shares across graphs (no tensor of its own), scaled as SGLang scales them, cut to the
    vocabulary; their argmax is the argmax of SGLang's float32 logits, ties included (first index)."""
    from sglang_dflash.sampling import HalfVerifyLogits

    gen = torch.Generator().manual_seed(0)
    vocab, hidden, rows = 1000, 64, 48
    weight = torch.randn(vocab + padded_rows, hidden, generator=gen).to(torch.bfloat16)
    weight[7] = weight[900]  # two columns tie in every row
    h = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    h[:8] = weight[7] * 4  # ... and the tie is the maximum in these rows
    lm_head = SimpleNamespace(weight=weight)
    for scale in (None, 0.5):
        processor = FakeLogitsProcessor(vocab, logit_scale=scale)
        assert HalfVerifyLogits.unserved(processor, lm_head) is None
        sglang_logits = processor._get_logits(h, lm_head, verify_metadata(rows, vocab))
        half = HalfVerifyLogits(processor)
        half.install()
        meta = verify_metadata(rows, vocab)
        logits = processor._get_logits(h, lm_head, meta)
        assert logits.dtype == torch.bfloat16 and logits.shape == (rows, vocab) and half.verifies == 1
        assert logits.data_ptr() == meta.next_token_logits_buffer.data_ptr()
        assert torch.equal(logits.float(), sglang_logits)
        assert torch.equal(logits.argmax(-1), sglang_logits.argmax(-1))
        assert (logits.argmax(-1)[:8] == 7).all()
        for other in (verify_metadata(rows, vocab, mode="DECODE"), verify_metadata(rows, vocab, buffer=False)):
            calls = processor.calls
            out = processor._get_logits(h, lm_head, other)
            assert torch.equal(out.float(), sglang_logits)
            assert (processor.calls > calls) == (other.forward_mode.name == "DECODE")  # SGLang's path for DECODE
        fewer_rows = verify_metadata(rows - 1, vocab)  # a buffer of another shape is left alone
        assert processor._get_logits(h, lm_head, fewer_rows).dtype == torch.bfloat16
        assert fewer_rows.next_token_logits_buffer.isnan().all()


def test_half_verify_logits_leave_every_lm_head_they_would_change_to_sglang():
    from sglang_dflash.sampling import HalfVerifyLogits

    bf16 = SimpleNamespace(weight=torch.zeros(4, 2, dtype=torch.bfloat16))
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4), bf16) is None
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4, final_logit_softcapping=30.0), bf16) == "a soft-capped lm_head"
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4, do_tensor_parallel_all_gather=True), bf16) == \
        "logits gathered across ranks"
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4, use_fp32_lm_head_output=True), bf16) == "a float32 lm_head"
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4), SimpleNamespace(weight=torch.zeros(4, 2))) == \
        "a float32 model"
    quantised = SimpleNamespace(weight=bf16.weight, quant_method=SimpleNamespace())
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4), quantised) == "a quantised lm_head"
    lora = SimpleNamespace(weight=bf16.weight, set_lora=None, apply_lora=None)
    assert HalfVerifyLogits.unserved(FakeLogitsProcessor(4), lora) == "a LoRA lm_head"


def test_the_accept_reads_float32_logits_wherever_the_batch_asks_for_more_than_an_argmax():
    """What plain decoding applies in float32 (penalties, bias, processors, grammar, logprobs,
    sampling) gets float32 logits, equal to SGLang's cast; a plain greedy batch keeps the half ones."""
    from sglang_dflash.sampling import HalfVerifyLogits, argmax_only

    greedy = SimpleNamespace(is_all_greedy=True, logit_bias=None, has_custom_logit_processor=False)

    def batch(info=greedy, grammar=False, logprob=False):
        return SimpleNamespace(sampling_info=info, has_grammar=grammar, return_logprob=logprob)

    asks_more = [
        (batch(), torch.ones(2, dtype=torch.int64)),  # penalty rows
        (batch(SimpleNamespace(is_all_greedy=False, logit_bias=None, has_custom_logit_processor=False)), None),
        (batch(SimpleNamespace(is_all_greedy=True, logit_bias=torch.zeros(2, 4), has_custom_logit_processor=False)),
         None),
        (batch(SimpleNamespace(is_all_greedy=True, logit_bias=None, has_custom_logit_processor=True)), None),
        (batch(grammar=True), None),
        (batch(logprob=True), None),
    ]
    assert argmax_only(batch(), None) and argmax_only(batch(info=None), None)
    assert not any(argmax_only(b, rows) for b, rows in asks_more)
    half = torch.randn(6, 5).to(torch.bfloat16)
    assert HalfVerifyLogits.for_accept(half, True) is half
    cast = HalfVerifyLogits.for_accept(half, False)
    assert cast.dtype == torch.float32 and torch.equal(cast, half.float())
    full = torch.randn(6, 5)
    assert HalfVerifyLogits.for_accept(full, False) is full
