"""The plugin's draft input reserves the same KV as SGLang's, with its host lengths written in bulk."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

import sglang.srt.mem_cache.allocation as allocation  # noqa: E402
import sglang.srt.runtime_context as runtime_context  # noqa: E402
import sglang.srt.speculative.dflash_info_v2 as dflash_info_v2  # noqa: E402

from sglang_dflash import draft_input  # noqa: E402
from sglang_dflash.compat import source_digest  # noqa: E402
from sglang_dflash.draft_input import DraftInput, draft_input_class, make_draft_input  # noqa: E402

needs_repeated_source = pytest.mark.skipif(
    source_digest(dflash_info_v2.DFlashDraftInputV2.prepare_for_decode) not in draft_input.PREPARE_FOR_DECODE_SOURCES,
    reason="this SGLang's prepare_for_decode is not the one DraftInput repeats")


def fake_batch(committed, allocated, top_ks, page_size):
    reqs = [SimpleNamespace(kv=SimpleNamespace(kv_committed_len=c, kv_allocated_len=a),
                            sampling_params=SimpleNamespace(top_k=k), decode_batch_idx=3)
            for c, a, k in zip(committed, allocated, top_ks)]
    return SimpleNamespace(
        reqs=reqs, device="cpu", batch_size=lambda: len(reqs), maybe_evict_swa=lambda: None,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=page_size), tree_cache="tree",
        req_to_token_pool="pool", req_pool_indices=torch.arange(len(reqs)), seq_lens_cpu=None, seq_lens_sum=None,
    )


@pytest.fixture
def cpu_prepare(monkeypatch):
    """SGLang's spec settings, plan stream and allocator replaced by stand-ins; the allocator's
    calls are recorded."""
    calls = []

    def record_alloc(tree_cache, req_to_token_pool, **kw):
        calls.append({k: v.tolist() if isinstance(v, torch.Tensor) else v
                      for k, v in kw.items() if k not in ("reqs", "batch")})

    spec = SimpleNamespace(speculative_num_draft_tokens=16)
    for module in (dflash_info_v2, runtime_context):
        monkeypatch.setattr(module, "get_spec", lambda: spec)
    for module in (dflash_info_v2, allocation):
        monkeypatch.setattr(module, "alloc_for_spec_decode", record_alloc)
    monkeypatch.setattr(dflash_info_v2, "_get_overlap_plan_stream", lambda device: (None, contextlib.nullcontext()))
    return calls


def after_prepare(cls, batch, calls):
    info = cls(topk_p=torch.empty(0), topk_index=torch.empty(0), bonus_tokens=torch.zeros(len(batch.reqs)),
               new_seq_lens=torch.zeros(len(batch.reqs)), hidden_states=torch.empty(0))
    for _ in range(2):  # the second step reuses the host buffers
        info.prepare_for_decode(batch)
    return {"alloc": calls[-2:], "seq_lens_cpu": batch.seq_lens_cpu.tolist(), "seq_lens_sum": batch.seq_lens_sum,
            "nxt": info.nxt_kv_lens_cpu.tolist(), "nxt_sum": info.nxt_kv_lens_sum, "max_top_k": info.max_top_k,
            "uniform_top_k": info.uniform_top_k_value, "decode_batch_idx": [r.decode_batch_idx for r in batch.reqs]}


@needs_repeated_source
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("top_ks", [[-1] * 5, [20, 20, 5, 20, 1]])
def test_bulk_prepare_reserves_what_sglang_reserves(cpu_prepare, page_size, top_ks):
    committed, allocated = [130, 7, 300, 64, 33], [162, 7, 310, 100, 90]
    ours = after_prepare(DraftInput, fake_batch(committed, allocated, top_ks, page_size), cpu_prepare)
    sglang = after_prepare(dflash_info_v2.DFlashDraftInputV2, fake_batch(committed, allocated, top_ks, page_size),
                           cpu_prepare)
    assert ours == sglang
    assert ours["decode_batch_idx"] == [5] * 5 and ours["seq_lens_cpu"] == committed


@needs_repeated_source
def test_draft_inputs_are_the_bulk_class_where_it_repeats_sglang(monkeypatch):
    draft_input_class.cache_clear()
    try:
        made = make_draft_input(torch.tensor([5, 6]), torch.tensor([10, 11], dtype=torch.int32))
        assert type(made) is DraftInput and made.new_seq_lens.dtype == torch.int64
        assert type(draft_input_class().create_idle_input(torch.device("cpu"))) is DraftInput
        monkeypatch.setenv("SGLANG_DFLASH_BULK_PREPARE", "0")
        draft_input_class.cache_clear()
        assert draft_input_class() is dflash_info_v2.DFlashDraftInputV2
    finally:
        draft_input_class.cache_clear()


def test_another_prepare_for_decode_keeps_sglangs_class(monkeypatch):
    monkeypatch.setattr(draft_input, "PREPARE_FOR_DECODE_SOURCES", ("0" * 16,))
    draft_input_class.cache_clear()
    try:
        assert draft_input_class() is dflash_info_v2.DFlashDraftInputV2
        assert type(make_draft_input(torch.tensor([1]), torch.tensor([2]))) is dflash_info_v2.DFlashDraftInputV2
    finally:
        draft_input_class.cache_clear()


def test_draft_inputs_of_one_batch_size_share_their_empty_fields_and_filter_and_merge_leave_them_alone():
    """The EAGLE-shaped fields are ``[bs, 0]``, made once a batch size: SGLang's filter and merge
    build new tensors from them, so one draft input's never changes another's."""
    first = make_draft_input(torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]))
    second = make_draft_input(torch.tensor([1, 2, 3]), torch.tensor([20, 21, 22]))
    assert first.topk_p is second.topk_p and first.hidden_states.shape == (3, 0)
    assert first.topk_index.dtype == torch.int64 and first.hidden_states.dtype == torch.float16
    first.filter_batch(torch.tensor([0, 2]), [0, 2])
    assert first.topk_p.shape == (2, 0) and second.topk_p.shape == (3, 0)
    assert first.bonus_tokens.tolist() == [5, 7] and second.bonus_tokens.tolist() == [1, 2, 3]
    second.merge_batch(make_draft_input(torch.tensor([4]), torch.tensor([30])))
    assert second.topk_p.shape == (4, 0) and make_draft_input(torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1])).topk_p.shape == (3, 0)


@needs_repeated_source
def test_length_buffers_are_kept_across_draft_inputs_and_a_set_still_in_use_is_replaced(cpu_prepare):
    """A new draft input every step takes the next of DEPTH kept sets, not five new buffers; a set
    whose GPU work has not completed when its turn comes is replaced, never waited for."""
    ring = draft_input.length_buffers("cpu")
    ring.sets, ring.turn, ring.taken, ring.made, ring.replaced = [None] * ring.DEPTH, 0, 0, 0, 0
    batch = fake_batch([130, 7, 300], [162, 7, 310], [-1] * 3, 1)

    def step():
        info = make_draft_input(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
        info.prepare_for_decode(batch)
        return info._prepare_cur_kv_lens_cpu_buf.data_ptr(), batch.seq_lens_cpu.tolist()

    first = [step() for _ in range(ring.DEPTH)]
    assert len({ptr for ptr, _ in first}) == ring.DEPTH and all(lens == [130, 7, 300] for _, lens in first)
    assert step()[0] == first[0][0]  # the first set's turn again
    ring.sets[(ring.turn + 1) % ring.DEPTH].used = SimpleNamespace(query=lambda: False)  # its copies not done
    assert step()[0] not in {ptr for ptr, _ in first} and ring.replaced == 1
    assert draft_input.length_sets_report() == {"taken": ring.DEPTH + 2, "made": ring.DEPTH + 1, "replaced": 1}
    batch = fake_batch([5] * 40, [5] * 40, [-1] * 40, 1)
    info = make_draft_input(torch.zeros(40, dtype=torch.int64), torch.zeros(40, dtype=torch.int64))
    info.prepare_for_decode(batch)  # a larger batch: a larger set
    assert info._prepare_nxt_kv_lens_gpu_buf.numel() >= 40 and batch.seq_lens_cpu.tolist() == [5] * 40
