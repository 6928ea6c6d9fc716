"""The draft pass in the plugin's own CUDA graphs (sglang_dflash/draft_graph.py), on the CPU: which
graph a batch replays, the padding of rows a smaller batch leaves, what the block set-up writes,
and where SGLang's runner keeps serving. The capture itself runs on a GPU (lab/gpu_smollm2_pair.sh
sweeps ``adaptive`` against ``adaptive-runner-drafts``: the same accept lengths, the step's host time)."""

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.draft import StepBuffers
from sglang_dflash.draft_graph import DraftGraphUnserved, DraftPassGraphs, PadRows, graph_size


class RecordingGraph:
    """Stands in for a captured graph: records the inputs each replay would read."""

    def __init__(self, graphs, size):
        self.graphs, self.size, self.seen = graphs, size, []

    def replay(self):
        g = self.graphs
        self.seen.append({name: getattr(g, name)[: self.size].clone()
                          for name in ("block_ids", "positions", "cache_loc", "rows", "lens")})
        # the head's tokens for every row the graph holds: row r drafts 100 r + 1 .. 100 r + B - 1
        B = g.block_size
        g.head.out[: self.size * (B - 1)] = (torch.arange(self.size)[:, None] * 100 + torch.arange(1, B)).view(-1)


def cpu_graphs(sizes=(1, 2, 4, 8), B=4, pad_len=1):
    layers = torch.nn.ModuleList([type("RadixAttention", (torch.nn.Module,), {})() for _ in range(3)])
    head = SimpleNamespace(out=torch.zeros(max(sizes) * (B - 1), dtype=torch.int64))
    graphs = DraftPassGraphs(embed=None, draft_model=layers, attn_backend=None, head=head, block_size=B,
                             sizes=sizes, device="cpu", pad_len=pad_len)
    graphs.graphs = {s: RecordingGraph(graphs, s) for s in graphs.sizes}
    return graphs


def test_a_batch_replays_the_smallest_graph_that_holds_it():
    assert [graph_size((1, 2, 4, 8), bs) for bs in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    graphs = cpu_graphs()
    assert graphs.layers == 3  # attention calls a pass makes: each must be the block kernel's
    assert [graphs.serves(bs) for bs in (0, 1, 8, 9)] == [False, True, True, False]


def test_rows_a_smaller_batch_leaves_are_padded_before_its_replay():
    pad = PadRows()
    assert [pad.to_reset(bs) for bs in (5, 7, 3, 3, 6, 1)] == [None, None, (3, 7), None, None, (1, 6)]


def fill_block(graphs, bs, first_slot):
    block_ids, positions, cache_loc = graphs.inputs(bs)
    assert block_ids.shape == (bs, graphs.block_size) and block_ids.is_contiguous() and cache_loc.is_contiguous()
    block_ids.fill_(7)
    positions.copy_(torch.arange(bs * graphs.block_size).view(bs, -1))
    cache_loc.copy_(first_slot + torch.arange(bs * graphs.block_size).view(bs, -1))


def test_a_replay_reads_this_batchs_rows_and_lengths_and_padding_past_them():
    graphs, B = cpu_graphs(pad_len=1), 4
    fill_block(graphs, 7, 500)
    graphs.replay(torch.arange(10, 17), torch.arange(20, 27))
    fill_block(graphs, 3, 900)
    drafts = graphs.replay(torch.tensor([4, 5, 6]), torch.tensor([30, 31, 32]))
    seen = graphs.graphs[4].seen[-1]  # 3 requests replay the graph of 4
    assert seen["rows"].tolist() == [4, 5, 6, 0] and seen["lens"].tolist() == [30, 31, 32, 1]
    assert seen["cache_loc"][:3].flatten().tolist() == list(range(900, 900 + 3 * B))
    assert seen["cache_loc"][3].tolist() == [0] * B  # a stale row would write K/V into a live request's slots
    # rows past the replayed graph are padding too, for a larger batch's replay later
    assert graphs.cache_loc[3:7].eq(0).all() and graphs.rows[3:7].eq(0).all() and graphs.lens[3:7].eq(1).all()
    assert drafts.tolist() == [r * 100 + j for r in range(3) for j in range(1, B)]
    assert graphs.replays == 2


def test_the_greedy_head_must_hold_the_largest_graphs_drafts():
    layers = torch.nn.ModuleList()
    with pytest.raises(DraftGraphUnserved, match="greedy head holds 6 tokens, not 24"):
        DraftPassGraphs(embed=None, draft_model=layers, attn_backend=None, head=SimpleNamespace(out=torch.zeros(6)),
                        block_size=4, sizes=(2, 8), device="cpu")


@pytest.mark.parametrize("bs", [2, 9])
def test_the_block_set_up_writes_the_graphs_inputs_where_a_graph_holds_the_batch(monkeypatch, bs):
    from sglang_dflash.worker import DFlashWorker
    from test_worker import narrow_worker

    worker, _ = narrow_worker(monkeypatch, B=4)
    graphs = worker.draft_graphs = cpu_graphs(B=4)
    batch = SimpleNamespace(seq_lens=torch.arange(bs) + 5, seq_lens_cpu=torch.arange(bs) + 5,
                            req_pool_indices=torch.arange(bs) % 4,
                            spec_info=SimpleNamespace(bonus_tokens=torch.arange(bs) + 50))
    block = DFlashWorker.draft_step(worker, batch, StepBuffers(4, "cpu").take(bs, torch.int64), 4)
    assert block.candidates[:, 0].tolist() == list(range(50, 50 + bs))
    assert block.positions.view(bs, 4)[:, 0].tolist() == list(range(5, 5 + bs))
    if bs <= 8:  # the batch's graph read the block where the set-up wrote it, and drafted
        seen = graphs.graphs[graph_size(graphs.sizes, bs)].seen[-1]
        assert seen["block_ids"][:bs, 0].tolist() == list(range(50, 50 + bs)) and seen["block_ids"][:bs, 1:].eq(99).all()
        assert seen["cache_loc"][:bs].tolist() == block.cache_loc.tolist()
        assert block.candidates[:, 1:].tolist() == [[r * 100 + j for j in range(1, 4)] for r in range(bs)]
        assert worker.draft_calls == 0
    else:  # past the largest graph: SGLang's runner, eagerly
        assert graphs.replays == 0 and worker.draft_calls == 1


def reasons_worker(monkeypatch, **overrides):
    import sglang_dflash.worker as worker_mod
    from sglang_dflash.worker import DFlashWorker

    worker = object.__new__(DFlashWorker)
    worker.head_in_graph, worker.window = True, None
    worker.draft_head = SimpleNamespace(tp_size=1)
    for name, value in overrides.items():
        setattr(worker, name, value)
    return worker, worker_mod


@pytest.mark.parametrize("env, capture, overrides, why", [
    ("0", True, {}, "SGLANG_DFLASH_DRAFT_GRAPHS=0"),
    (None, False, {}, "no decode CUDA graphs"),
    (None, True, {"head_in_graph": False}, "the greedy head runs outside the graph"),
    (None, True, {"window": object()}, "the draft attends to a window"),
    (None, True, {"draft_head": SimpleNamespace(tp_size=2)}, "tensor parallel"),
])
def test_where_the_plugins_draft_graphs_do_not_serve_sglangs_runner_does_and_the_reason_is_kept(
        monkeypatch, env, capture, overrides, why):
    from sglang_dflash.worker import DFlashWorker

    if env is None:
        monkeypatch.delenv("SGLANG_DFLASH_DRAFT_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DFLASH_DRAFT_GRAPHS", env)
    worker, _ = reasons_worker(monkeypatch, **overrides)
    assert DFlashWorker._capture_draft_graphs(worker, capture, (1, 2)) == (None, why)


def test_a_capture_whose_pass_went_past_the_block_kernel_leaves_the_draft_to_sglangs_runner(monkeypatch):
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.delenv("SGLANG_DFLASH_DRAFT_GRAPHS", raising=False)
    worker, worker_mod = reasons_worker(monkeypatch)

    class Unserved:
        def __init__(self, **kw):
            pass

        def capture(self, bind_plan=None):
            raise DraftGraphUnserved("2 of the pass's 3 attention calls were the block kernel's over the request table")

    monkeypatch.setattr(worker_mod, "DraftPassGraphs", Unserved)
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(get_input_embeddings=lambda: None))
    worker.draft_model_runner = SimpleNamespace(attn_backend=None, decode_cuda_graph_runner=None)
    worker.draft_model, worker.block_size, worker.device, worker.release = None, 16, "cpu", None
    graphs, why = DFlashWorker._capture_draft_graphs(worker, True, (1, 2))
    assert graphs is None and why.startswith("2 of the pass's 3 attention calls")


def test_the_draft_pass_is_a_target_verify_forward_over_the_block_rows_and_lengths():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_dflash.draft_graph import draft_forward_batch

    block_ids, positions = torch.arange(8).view(2, 4), torch.arange(10, 18).view(2, 4)
    fb = draft_forward_batch(block_ids, positions, positions + 100, torch.tensor([3, 5]), torch.tensor([10, 14]),
                             torch.tensor([10, 14]))
    assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.batch_size == 2 and fb.seq_lens_sum == 24
    assert fb.input_ids.tolist() == list(range(8)) and fb.out_cache_loc.tolist() == list(range(110, 118))
    assert fb.spec_info.draft_token_num == 4 and fb.spec_info.positions.tolist() == list(range(10, 18))
    assert fb.req_pool_indices.tolist() == [3, 5] and fb.input_embeds is None
