"""SGLANG_DFLASH_DRAFT_RING: draft K/V in a ring of W + B slots per request row (draft.DraftRing)."""

import dataclasses
import os
import random
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.draft import DraftRing, DraftWindow


def ring(W=6, B=4, rows=5):
    return DraftRing(W, B, SimpleNamespace(size=rows), "cpu")


def position_of(r, slot, R):
    """The residue a ring slot stands for: slot = r * R + p % R."""
    assert r * R <= slot < (r + 1) * R, (r, slot)
    return slot - r * R


def test_the_ring_table_holds_the_last_w_positions_then_the_block_in_the_rows_own_slots():
    rg = ring()
    R = rg.ring
    assert (R, rg.rows, rg.tokens) == (10, 6, 60)  # dummy row 0 included
    rows, seq_lens = torch.tensor([2, 5, 1]), torch.tensor([20, 3, 6])
    ctx = rg.fill(rows, seq_lens)
    assert ctx.tolist() == [6, 3, 6] and ctx.dtype == seq_lens.dtype
    table = rg.pool.req_to_token
    for r, s, n in zip(rows.tolist(), seq_lens.tolist(), ctx.tolist()):
        got = [position_of(r, int(slot), R) for slot in table[r, : n + 4]]
        assert got == [p % R for p in range(s - n, s + 4)]
        assert len(set(got)) == n + 4  # window and block never share a slot
    assert table[3].eq(0).all()  # rows outside the batch are left alone


def test_the_ring_reads_the_positions_the_window_reads():
    """Same positions as DraftWindow (which reads them by target slot), whatever s, W and B."""
    rnd = random.Random(3)
    for _ in range(50):
        W, B = rnd.randrange(2, 40), rnd.randrange(2, 17)
        rg, win = ring(W, B, rows=4), DraftWindow(W, B, SimpleNamespace(size=4), "cpu")
        req_to_token = torch.arange(5 * 300, dtype=torch.int32).view(5, 300)  # slot = r * 300 + p
        rows = torch.tensor([1, 3, 4])
        seq_lens = torch.tensor([rnd.randrange(0, 280) for _ in range(3)])
        ctx_ring, ctx_win = rg.fill(rows, seq_lens), win.fill(rows, seq_lens, req_to_token)
        assert ctx_ring.tolist() == ctx_win.tolist()
        for i, r in enumerate(rows.tolist()):
            n = int(ctx_ring[i]) + B
            by_window = [int(x) - r * 300 for x in win.pool.req_to_token[r, :n]]
            by_ring = [position_of(r, int(x), rg.ring) for x in rg.pool.req_to_token[r, :n]]
            assert by_ring == [p % rg.ring for p in by_window]
            assert all(0 <= int(x) < rg.tokens for x in rg.pool.req_to_token[r, :n])


def test_a_row_with_a_new_owner_starts_cold_at_its_prefix_and_a_chunk_continuation_keeps_going():
    rg = ring(W=6, B=4)
    rg.start_extend([2, 3], [("a", 1), ("b", 1)], [0, 40])  # b hit 40 cached tokens
    assert rg.lo[2] == 0 and rg.lo[3] == 40
    assert rg.fill(torch.tensor([2, 3]), torch.tensor([8, 43])).tolist() == [6, 3]  # b sees its own 3 only
    rg.start_extend([3], [("b", 1)], [43])  # b's next chunk: same owner, nothing forgotten
    assert rg.lo[3] == 40 and rg.fill(torch.tensor([3]), torch.tensor([45])).tolist() == [5]
    rg.start_extend([3], [("b", 2)], [30])  # b retracted, back on the row with a new generation
    assert rg.lo[3] == 30
    rg.start_extend([2], [("c", 1)], [0])  # a finished; c takes its row
    assert rg.lo[2] == 0 and rg.owners[2] == ("c", 1)


def test_a_prefill_keeps_each_requests_last_w_tokens():
    rg = ring(W=3, B=2)
    assert rg.kept([5, 2, 0, 3]) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert rg.kept([]) == []


def test_slots_take_rows_per_position_or_per_request():
    rg = ring(W=6, B=4)
    positions = torch.tensor([18, 19, 20, 5, 6, 7])
    per_request = rg.slots(torch.tensor([2, 4]), positions)
    per_position = rg.slots(torch.tensor([2, 2, 2, 4, 4, 4]), positions)
    assert per_request.tolist() == per_position.tolist() == [28, 29, 20, 45, 46, 47]
    assert rg.slots(torch.tensor([1, 3]), positions.view(2, 3)).shape == (2, 3)


def test_a_long_life_in_the_ring_never_reads_a_slot_another_position_overwrote():
    """Chunked prefills (with radix hits), then decode steps that commit 1..B tokens, with the
    block's K/V written before the draft reads it (as the draft forward does) and the committed
    context after the verify: every slot the draft reads holds the position the window means."""
    rnd = random.Random(11)
    W, B = 37, 8
    rg = ring(W, B, rows=3)
    held = {}  # slot -> position written there last

    def write(r, positions):
        for p in positions:
            held[r * rg.ring + p % rg.ring] = p

    for owner, (prefix, chunks) in enumerate([(0, [256, 256, 101]), (60, [5]), (0, [3])]):
        r = 1 + owner % 2
        s = prefix
        for n in chunks:  # a chunked prefill: each chunk writes its last W tokens
            rg.start_extend([r], [(f"req{owner}", 1)], [s])
            kept = rg.kept([n])
            write(r, [s + k for k in kept])
            s += n
        for _ in range(60):
            ctx = int(rg.fill(torch.tensor([r]), torch.tensor([s]))[0])
            assert ctx == min(W, s - prefix)
            write(r, range(s, s + B))  # the draft forward writes its block first
            table = rg.pool.req_to_token[r, : ctx + B].tolist()
            assert [held[x] for x in table] == list(range(s - ctx, s + B))
            commit = rnd.randrange(1, B + 1)
            write(r, range(s, s + commit))  # the verified context
            s += commit


def test_the_draft_pool_config_is_sized_to_the_ring_and_the_targets_is_left_alone():
    @dataclasses.dataclass
    class MemoryPoolConfig:  # the fields both releases' config has
        max_total_num_tokens: int
        max_running_requests: int = None
        full_max_total_num_tokens: int = None

    target = MemoryPoolConfig(1_000_000, 48)
    draft = ring(W=4096, B=16, rows=48).pool_config(target)
    assert draft == MemoryPoolConfig(49 * 4112, 48) and target.max_total_num_tokens == 1_000_000


def test_the_ring_switch_reads_0_or_1_and_needs_the_draft_window(monkeypatch):
    from sglang_dflash import config

    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(config.DRAFT_RING_ENV, value)
        assert config.draft_ring() is on
    monkeypatch.setenv(config.DRAFT_RING_ENV, "yes")
    with pytest.raises(config.DFlashConfigError, match="must be 0 or 1"):
        config.draft_ring()


# ---- the worker's writes through the ring --------------------------------------------------------


def ring_worker(W=6, B=4, rows=5):
    from sglang_dflash import compat
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.device, worker.block_size, worker.release = "cpu", B, compat.running()
    worker.window = ring(W, B, rows)
    worker.written = []
    worker.write_context_kv = lambda hidden, positions, loc, commit_len=None: worker.written.append(
        (hidden.tolist(), positions.tolist(), loc.tolist(), None if commit_len is None else commit_len.tolist()))
    pool = SimpleNamespace(req_generation=torch.tensor([0, 0, 3, 1, 0, 0]))
    worker.model_runner = SimpleNamespace(req_to_token_pool=pool)
    return worker


def test_a_prefill_writes_each_requests_last_w_tokens_to_its_ring_slots():
    from sglang_dflash.context import extend_positions
    from sglang_dflash.worker import DFlashWorker

    worker = ring_worker(W=3, B=2)  # R = 5
    reqs = [SimpleNamespace(rid="a", kv=SimpleNamespace(req_pool_idx=2)),  # 0.5.23's request row
            SimpleNamespace(rid="b", req_pool_idx=3)]  # 0.5.17's
    batch = SimpleNamespace(reqs=reqs, prefix_lens=[0, 10], extend_lens=[5, 2])
    hidden = torch.arange(7.0).view(7, 1)
    DFlashWorker.write_ring_prefill(worker, batch, hidden, extend_positions([0, 10], [5, 2], "cpu"))
    (h, positions, loc, commit), = worker.written
    assert positions == [2, 3, 4, 10, 11] and h == [[2.0], [3.0], [4.0], [5.0], [6.0]] and commit is None
    assert loc == [2 * 5 + 2, 2 * 5 + 3, 2 * 5 + 4, 3 * 5 + 0, 3 * 5 + 1]
    assert worker.window.lo[2] == 0 and worker.window.lo[3] == 10  # b's cached prefix is not in the ring
    assert worker.window.owners == {2: ("a", 3), 3: ("b", 1)}


def test_committed_context_and_the_verify_graphs_write_to_ring_slots():
    from sglang_dflash.draft import DraftBlock
    from sglang_dflash.context import ContextInVerifyGraph
    from sglang_dflash.worker import DFlashWorker

    worker = ring_worker(W=6, B=4)  # R = 10
    block = DraftBlock(torch.zeros(2, 3), torch.tensor([18, 19, 20, 5, 6, 7]), torch.arange(6).view(2, 3), None)
    DFlashWorker.commit_context(worker, torch.ones(6, 1), block, torch.tensor([2, 1]), torch.tensor([2, 4]))
    assert worker.written[-1][2:] == ([[28, 29, 20], [45, 46, 47]], [2, 1])
    hook = ContextInVerifyGraph(worker.write_context_kv)
    hook.ring = worker.window
    verify = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True, is_decode=lambda: False),
                             positions=torch.tensor([18, 19, 0, 0]), req_pool_indices=torch.tensor([2, 0]),
                             out_cache_loc=torch.tensor([400, 401, 0, 0]))
    target = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=False))
    hook.capture_hook(target, SimpleNamespace(hidden_states=torch.ones(4, 1)), verify, 4)
    assert worker.written[-1][2] == [28, 29, 0, 0]  # the padded row writes the dummy row's slots


def test_where_the_ring_cannot_serve_it_says_why(monkeypatch):
    from sglang_dflash import compat
    from sglang_dflash.worker import DFlashWorker

    @dataclasses.dataclass
    class Config:
        max_total_num_tokens: int

    worker = object.__new__(DFlashWorker)
    worker.release, worker.ragged = compat.running(), False
    monkeypatch.setattr(compat.SGLangRelease, "resolving", lambda self, args: args)
    monkeypatch.setattr(compat.SGLangRelease, "pd_role", lambda self, args: args.pd)
    args = dict(enable_hierarchical_cache=False, page_size=1, pd=None)
    worker.server_args = SimpleNamespace(**args)
    assert DFlashWorker._draft_ring_unserved(worker, Config(100)) is None
    assert "pool config" in DFlashWorker._draft_ring_unserved(worker, None)
    for change, why in ((dict(enable_hierarchical_cache=True), "hierarchical cache"), (dict(page_size=16), "page_size"),
                        (dict(pd="decode"), "PD")):
        worker.server_args = SimpleNamespace(**{**args, **change})
        assert why in DFlashWorker._draft_ring_unserved(worker, Config(100))
    worker.server_args, worker.ragged = SimpleNamespace(**args), True
    assert "SGLANG_DFLASH_RAGGED" in DFlashWorker._draft_ring_unserved(worker, Config(100))


@dataclasses.dataclass
class MemoryPoolConfig:  # what size_target_cell_for_ring looks for beside the configurator
    max_total_num_tokens: int


class PricedPerToken:
    """SGLang's DefaultPoolConfigurator as both releases have it: a token priced at the target's
    K/V cell, plus the draft's where the target runner was told its layer count."""

    TARGET, DRAFT = 36_864, 8_192  # bytes a token

    def __init__(self, kvc):
        draft = kvc.spec_aux_config.dflash_draft_num_layers
        self._cell_size = self.TARGET + (self.DRAFT if draft else 0)

    def calculate_pool_sizes(self, available_bytes, page_size):
        return MemoryPoolConfig(available_bytes // self._cell_size // page_size * page_size)


def ring_server(tmp_path, **change):
    import json

    from conftest import draft_config_dict

    os.makedirs(tmp_path / "draft", exist_ok=True)
    # 2 layers x 2 KV heads x 64 dims x (K, V) x 2 bytes: 1 KiB a token, below SGLang's 8 KiB figure
    (tmp_path / "draft" / "config.json").write_text(json.dumps(draft_config_dict(head_dim=64)))
    args = dict(speculative_draft_window_size=4096, speculative_num_draft_tokens=16, max_running_requests=48,
                speculative_draft_model_path=str(tmp_path / "draft"), tp_size=1, page_size=1,
                enable_hierarchical_cache=False, pd=None)
    args.update(change)
    kvc = SimpleNamespace(is_draft_worker=False, spec_algorithm=SimpleNamespace(is_dflash_family=lambda: True),
                          server_args=SimpleNamespace(**args), kv_cache_dtype=torch.bfloat16,
                          spec_aux_config=SimpleNamespace(dflash_draft_num_layers=2))
    release = SimpleNamespace(resolving=lambda a: a, spec_setting=getattr, schedule_setting=getattr,
                              pd_role=lambda a: a.pd)
    return kvc, release


@pytest.fixture
def budget(monkeypatch):
    """What the server reports of its budget, fresh for each test, on a rank 0 of its own."""
    from sglang_dflash import context

    monkeypatch.setattr(context, "RING_BUDGET", {})
    monkeypatch.setattr(context, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    return context


def sized(kvc, release, available):
    from sglang_dflash.context import set_aside_ring, size_target_cell_for_ring

    configurator = PricedPerToken(kvc)
    size_target_cell_for_ring(PricedPerToken.__init__, configurator, kvc, release)
    return configurator, configurator.calculate_pool_sizes(set_aside_ring(configurator, available), 1)


def test_under_the_ring_the_target_token_is_priced_alone_and_the_ring_set_aside_whole(tmp_path, budget):
    context = budget
    kvc, release = ring_server(tmp_path)
    available = 100 * 2**30
    configurator, config = sized(kvc, release, available)
    ring_bytes = 49 * (4096 + 16) * 8_192  # the rows the server may hold, SGLang's dummy row included
    assert configurator.dflash_ring == (36_864, 8_192, ring_bytes)  # SGLang's draft figure, the larger
    assert config.max_total_num_tokens == (available - ring_bytes) // 36_864
    assert kvc.spec_aux_config.dflash_draft_num_layers == 2  # SGLang's field is put back
    assert context.RING_BUDGET["target_tokens"] == config.max_total_num_tokens
    assert context.RING_BUDGET["target_tokens_without_ring"] == available // (36_864 + 8_192)
    # the target gains what the draft rows per token took, less the ring: 1.21x here
    assert 1.2 < config.max_total_num_tokens / (available // (36_864 + 8_192)) < 1.23


def test_the_ring_budget_leaves_sglangs_sizing_where_the_ring_is_not_served(tmp_path, budget):
    context = budget
    available = 100 * 2**30
    per_token = available // (36_864 + 8_192)
    for change in (dict(enable_hierarchical_cache=True), dict(page_size=16), dict(pd="decode"),
                   dict(speculative_draft_window_size=None), dict(max_running_requests=None),
                   dict(speculative_draft_model_path=str(tmp_path / "nowhere"))):
        kvc, release = ring_server(tmp_path, **change)
        configurator, config = sized(kvc, release, available)
        assert not hasattr(configurator, "dflash_ring"), change
        assert config.max_total_num_tokens == per_token
    kvc, release = ring_server(tmp_path)
    kvc.kv_cache_dtype = "a packed dtype"  # no element size, and SGLang's figure counted no draft
    kvc.spec_aux_config.dflash_draft_num_layers = None
    configurator, config = sized(kvc, release, available)
    assert config.max_total_num_tokens == available // 36_864 and not hasattr(configurator, "dflash_ring")
    kvc, release = ring_server(tmp_path)
    kvc.is_draft_worker = True  # the draft runner's own pool is sized by the worker, to the ring
    assert not hasattr(sized(kvc, release, available)[0], "dflash_ring") and context.RING_BUDGET == {}


def test_a_ring_larger_than_draft_rows_per_token_says_so(tmp_path, budget, caplog):
    kvc, release = ring_server(tmp_path, max_running_requests=1024)
    with caplog.at_level("INFO", logger="sglang_dflash"):
        _, config = sized(kvc, release, 8 * 2**30)
    assert config.max_total_num_tokens < (8 * 2**30) // (36_864 + 8_192)
    assert "fewer --max-running-requests" in caplog.records[-1].getMessage()


def test_the_ring_budget_hooks_sglangs_pool_configurator_on_this_release(monkeypatch):
    """The contract: both hook targets exist, and SGLang's sizing reads the draft-layer field the
    budget hides from its second pricing and keeps the price where the budget reads it."""
    import inspect

    from sglang_dflash import compat
    from sglang_dflash.config import DRAFT_RING_ENV

    monkeypatch.setenv(DRAFT_RING_ENV, "1")
    targets = compat.running().hook_targets()
    from sglang.srt.model_executor import pool_configurator

    for name in ("ring_target_cell", "ring_set_aside"):
        module, _, qualname = targets[name].rpartition(".DefaultPoolConfigurator.")
        assert module == pool_configurator.__name__ and hasattr(pool_configurator.DefaultPoolConfigurator, qualname)
    source = inspect.getsource(pool_configurator.DefaultPoolConfigurator.__init__)
    assert "spec_aux_config.dflash_draft_num_layers" in source and "self._cell_size" in source
    assert dataclasses.is_dataclass(pool_configurator.MemoryPoolConfig)
    assert compat.missing_symbols(compat.running(), compat.installed_source_root()) == []
    monkeypatch.setenv(DRAFT_RING_ENV, "0")
    assert "ring_target_cell" not in compat.running().hook_targets()
