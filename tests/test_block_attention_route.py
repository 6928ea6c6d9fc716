"""The Triton backend's DFLASH passes routed to the plugin's block kernel, and everything else not.

A fake backend calls ``extend_attention_fwd`` as SGLang's ``forward_extend`` does (the leading
arguments by position); the kernel itself is checked in ``test_ops.py`` against the reference.
"""

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash import block_attention_route as route, compat
from sglang_dflash.ops.block_attention import query_rows

BLOCK, Q_HEADS, KV_HEADS, DIM = 4, 8, 2, 64


def _mode(verify: bool):
    return SimpleNamespace(is_target_verify=lambda: verify)


class TritonAttnBackend:  # the name the route looks for, as SGLang's class is called
    def __init__(self, page_size=1):
        self.page_size = page_size
        self.sglang_calls = []
        self.extend_attention_fwd = self._sglang_extend

    def _sglang_extend(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                       kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                       sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1,
                       sinks=None, window_kv_offsets=None, xai_temperature_len=-1, page_size=1):
        self.sglang_calls.append(is_causal)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, custom_mask=None,
                       sliding_window_size=-1, logit_cap=0.0, cache_dtype=torch.float32, kv_scale=1.0):
        bs = q.shape[0] // BLOCK
        cache = torch.zeros(10, KV_HEADS, DIM, dtype=cache_dtype)
        self.extend_attention_fwd(
            q, k, v, torch.empty_like(q), cache, cache.clone(),
            torch.arange(bs + 1) * BLOCK, torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
            custom_mask, layer.causal, None, BLOCK, kv_scale, kv_scale, layer.scaling, logit_cap=logit_cap,
            sliding_window_size=sliding_window_size, sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
            page_size=self.page_size,
        )


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(route, "block_attention", lambda *args: calls.append(args))
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    return calls


def _forward(backend, verify=True, causal=True, **kwargs):
    q = torch.randn(2 * BLOCK, Q_HEADS, DIM)
    k, v = (torch.randn(2 * BLOCK, KV_HEADS * DIM) for _ in range(2))  # as the layer hands them over, flat
    layer = SimpleNamespace(causal=causal, scaling=0.125)
    backend.forward_extend(q, k, v, layer, SimpleNamespace(forward_mode=_mode(verify)), **kwargs)


def test_target_verify_and_draft_passes_take_the_block_kernel(kernel_calls):
    backend = TritonAttnBackend()
    assert route.route_block_attention(backend)
    _forward(backend, causal=True)  # the target's verify
    _forward(backend, causal=False)  # the draft (ENCODER_ONLY layers)
    assert backend.sglang_calls == []
    assert [call[-1] for call in kernel_calls] == [True, False]
    q, k, v, o, k_cache, v_cache, kv_indptr, kv_indices, block, sm_scale, causal = kernel_calls[0]
    assert k.shape == (2 * BLOCK, KV_HEADS, DIM) and v.shape == k.shape and block == BLOCK and sm_scale == 0.125
    assert route.ROUTE.report() == {"backends": 1, "routed_calls": 2, "declined_calls": 0, "plans_skipped": 0,
                                    "served_whole": 0, "refused_tiles": []}
    assert route.route_block_attention(backend)  # routing twice wraps once
    _forward(backend)
    assert len(kernel_calls) == 3


@pytest.mark.parametrize("why", ["prefill", "custom_mask", "window", "soft_cap", "bf16_cache", "kv_scale",
                                 "tensor_kv_scale"])
def test_what_the_block_kernel_lacks_stays_with_sglang(kernel_calls, why):
    backend = TritonAttnBackend()
    assert route.route_block_attention(backend)
    kwargs = {"custom_mask": {"custom_mask": torch.ones(4, dtype=torch.bool)}, "window": {"sliding_window_size": 8},
              "soft_cap": {"logit_cap": 30.0}, "bf16_cache": {"cache_dtype": torch.bfloat16},
              "kv_scale": {"kv_scale": 0.5}, "tensor_kv_scale": {"kv_scale": torch.ones(())}}.get(why, {})
    _forward(backend, verify=why != "prefill", **kwargs)
    assert kernel_calls == [] and backend.sglang_calls == [True]
    assert route.ROUTE.declined == (0 if why == "prefill" else 1)


def test_backends_the_kernel_cannot_serve_are_left_alone(kernel_calls, monkeypatch):
    assert not route.route_block_attention(TritonAttnBackend(page_size=16))

    class HybridTritonBackend(TritonAttnBackend):  # a subclass of SGLang's Triton backend is one
        pass
    assert route.route_block_attention(HybridTritonBackend())

    class TorchNativeAttnBackend:
        page_size = 1
        extend_attention_fwd = TritonAttnBackend._sglang_extend
    assert not route.route_block_attention(TorchNativeAttnBackend())
    monkeypatch.setenv("SGLANG_DFLASH_BLOCK_ATTENTION", "0")
    backend = TritonAttnBackend()
    assert not route.route_block_attention(backend)
    _forward(backend)
    assert kernel_calls == [] and backend.sglang_calls == [True]


class HybridLinearAttnBackend:
    """A hybrid target's wrapper as SGLang 0.5.17-0.5.23 build it: an attention layer's call goes to
    the full-attention backend by attribute (linear layers, not modelled here, to the linear one)."""

    def __init__(self, full):
        self.full_attn_backend = full

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        return self.full_attn_backend.forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)


def test_a_hybrid_targets_attention_layers_take_the_block_kernel(kernel_calls):
    full = TritonAttnBackend()
    wrapper = HybridLinearAttnBackend(full)
    assert route.route_block_attention(wrapper)
    _forward(wrapper)
    assert len(kernel_calls) == 1 and full.sglang_calls == []
    assert route.route_block_attention(wrapper) and route.ROUTE.backends == 1  # routed once
    _forward(wrapper, verify=False)  # a prefill keeps SGLang's kernel
    assert full.sglang_calls == [True] and len(kernel_calls) == 1


def query_tile(block: int, group: int, head_dim: int) -> int:
    """Elements of one program's query tile: the unit of ``route.HYBRID_TILE_LIMIT``."""
    return query_rows(block, group) * head_dim


def test_behind_a_hybrid_wrapper_tiles_beyond_the_measured_one_stay_with_sglang(kernel_calls, monkeypatch):
    assert query_tile(16, 4, 256) < route.HYBRID_TILE_LIMIT  # the Qwen3.5-4B shape
    assert query_tile(16, 8, 256) == route.HYBRID_TILE_LIMIT  # Qwen3.6-35B-A3B: 16/2 heads of 256, timed
    assert query_tile(16, 6, 256) == route.HYBRID_TILE_LIMIT  # Qwen3.5-27B: 24/4, timed
    assert query_tile(16, 16, 256) > route.HYBRID_TILE_LIMIT  # a group of 16: never timed
    assert query_tile(1, 2, 64) == 16 * 64
    monkeypatch.setattr(route, "HYBRID_TILE_LIMIT", query_tile(BLOCK, Q_HEADS // KV_HEADS, DIM) - 1)
    full = TritonAttnBackend()
    assert route.route_block_attention(HybridLinearAttnBackend(full))
    _forward(HybridLinearAttnBackend(full))
    assert kernel_calls == [] and full.sglang_calls == [True] and route.ROUTE.declined == 1
    dense = TritonAttnBackend()  # a dense target's backend keeps the kernel at any tile
    assert route.route_block_attention(dense)
    _forward(dense)
    assert len(kernel_calls) == 1
    monkeypatch.setenv("SGLANG_DFLASH_BLOCK_ATTENTION", "all")  # an A/B run times them
    wide = HybridLinearAttnBackend(TritonAttnBackend())
    assert route.route_block_attention(wide)
    _forward(wide)
    assert len(kernel_calls) == 2


def test_a_tile_the_gpu_refuses_is_served_by_sglang_and_logged_once(kernel_calls, monkeypatch, caplog):
    """Triton refuses a launch needing more shared memory than the GPU has (float32 at heads of 256)
    before enqueueing anything, inside a capture too: the call goes to SGLang's kernel instead."""
    def refused(*args):
        raise route.TileTooLarge("64 x 256 torch.float32 query tile: out of resource: shared memory")

    monkeypatch.setattr(route, "block_attention", refused)
    backend = TritonAttnBackend()
    assert route.route_block_attention(backend)
    with caplog.at_level("WARNING", logger=route.logger.name):
        _forward(backend)
        _forward(backend)
    assert backend.sglang_calls == [True, True]
    report = route.ROUTE.report()
    assert report["routed_calls"] == 0 and report["declined_calls"] == 2 and len(report["refused_tiles"]) == 1
    assert sum("cannot run a 64 x 256" in r.message for r in caplog.records) == 1


def test_a_refused_tile_is_declined_before_its_next_launch(monkeypatch):
    ops = importlib.import_module("sglang_dflash.ops.block_attention")  # the module, not its function

    class Refusing:  # the launcher Triton builds for a kernel whose program does not fit the GPU
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise ops.OutOfResources(262144, 232448, "shared memory")
            return launch

    monkeypatch.setattr(ops, "_block_attention_kernel", Refusing())
    monkeypatch.setattr(ops, "_REFUSED", set())
    q = torch.zeros(2 * 16, 16, 256)
    k_cache = torch.zeros(8, 4, 256)
    assert route.kernel_takes(q, k_cache, k_cache, 16)
    with pytest.raises(ops.TileTooLarge, match="64 x 256 torch.float32"):
        ops.block_attention(q, q[:, :4], q[:, :4], torch.empty_like(q), k_cache, k_cache,
                            torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.int64), 16, 0.0625, True,
                            splits=1)
    assert not route.kernel_takes(q, k_cache, k_cache, 16)
    assert route.kernel_takes(q.to(torch.bfloat16), k_cache.to(torch.bfloat16), k_cache.to(torch.bfloat16), 16)


def test_a_hybrid_targets_flashinfer_attention_is_left_to_sglang(monkeypatch):
    """Behind the hybrid wrapper only Triton has run lossless on a GPU."""
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    full = FlashInferAttnBackend()
    assert route.route_block_attention(full)
    assert not route.route_block_attention(HybridLinearAttnBackend(FlashInferAttnBackend()))


class TableTritonBackend(TritonAttnBackend):
    """SGLang's Triton backend as 0.5.17-0.5.23 build it: a request table, the replay set-up."""

    def __init__(self, translating=False):
        super().__init__()
        self.req_to_token = torch.zeros(4, 32, dtype=torch.int32)
        self.kv_index_translator = SimpleNamespace(is_translating=translating)
        self.sliding_window_size = None
        self.setups = []

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.setups.append(in_capture)  # SGLang refills qo/kv indptr, kv indices and mask offsets here


def _table_forward(backend, verify=True, causal=True, *args, **kwargs):
    q = torch.randn(2 * BLOCK, Q_HEADS, DIM)
    k, v = (torch.randn(2 * BLOCK, KV_HEADS * DIM) for _ in range(2))
    batch = SimpleNamespace(forward_mode=_mode(verify), req_pool_indices=torch.tensor([3, 1]),
                            seq_lens=torch.tensor([5, 9]))
    backend.forward_extend(q, k, v, SimpleNamespace(causal=causal, scaling=0.125), batch, *args, **kwargs)


@pytest.fixture
def table_calls(monkeypatch, kernel_calls):
    calls = []
    monkeypatch.setattr(route, "block_attention_by_table", lambda *args: calls.append(args) or args[1])
    return calls


def test_triton_passes_whose_block_is_cached_read_every_key_by_the_request_table(table_calls, kernel_calls):
    backend = TableTritonBackend()
    assert route.route_block_attention(backend)
    _table_forward(backend, causal=True)
    _table_forward(backend, causal=False)
    assert backend.sglang_calls == [] and kernel_calls == [] and [c[-1] for c in table_calls] == [True, False]
    q, o, k_cache, v_cache, table, req_pool_indices, prefix_lens, block, sm_scale, causal = table_calls[0]
    assert table is backend.req_to_token and req_pool_indices.tolist() == [3, 1] and prefix_lens.tolist() == [5, 9]
    assert block == BLOCK and sm_scale == 0.125 and q.shape == o.shape and k_cache.shape == (10, KV_HEADS, DIM)
    _table_forward(backend, save_kv_cache=False)  # the block's K/V not in the cache: the backend's indices
    _table_forward(backend, True, True, False)  # (by position too)
    assert len(kernel_calls) == 2 and len(table_calls) == 2
    _table_forward(backend, verify=False)
    assert backend.sglang_calls == [True]
    translating = TableTritonBackend(translating=True)  # a unified pool: the table holds ids, not rows
    assert route.route_block_attention(translating)
    _table_forward(translating)
    assert len(kernel_calls) == 3 and len(table_calls) == 2


def _triton_replay(backend, verify=True, in_capture=False, ragged=None, custom_mask=None):
    spec_info = SimpleNamespace(ragged_verify_layout=ragged, custom_mask=custom_mask)
    backend.init_forward_metadata_out_graph(SimpleNamespace(forward_mode=_mode(verify), spec_info=spec_info),
                                            in_capture=in_capture)


def test_triton_replays_of_passes_read_by_table_skip_the_replay_set_up(table_calls, kernel_calls, monkeypatch):
    backend = TableTritonBackend()
    assert route.route_block_attention(backend)
    _triton_replay(backend, in_capture=True)  # a capture sets up as SGLang does, then runs the routed layers
    monkeypatch.setattr(route, "capturing", lambda: True)
    _table_forward(backend)
    _triton_replay(backend)  # a replay of that graph: no set-up
    _triton_replay(backend, verify=False)  # a decode or prefill replay sets up
    _triton_replay(backend, ragged=object())
    _triton_replay(backend, custom_mask=torch.ones(1))
    assert backend.setups == [True, False, False, False] and route.ROUTE.plans_skipped == 1
    _table_forward(backend, save_kv_cache=False)  # a captured call that reads the backend's kv indices
    _triton_replay(backend)
    assert backend.setups == [True, False, False, False, False] and route.ROUTE.plans_skipped == 1
    declining = TableTritonBackend()
    assert route.route_block_attention(declining)
    _table_forward(declining, sliding_window_size=8)  # SGLang's kernel, captured
    _triton_replay(declining)
    assert declining.setups == [False]


@pytest.mark.parametrize("why", ["switched_off", "sliding_window", "translating", "no_table"])
def test_triton_replays_set_up_where_the_skip_does_not_hold(table_calls, kernel_calls, monkeypatch, why):
    if why == "switched_off":
        monkeypatch.setenv("SGLANG_DFLASH_SKIP_UNUSED_PLANS", "0")
    backend = TableTritonBackend(translating=why == "translating")
    if why == "sliding_window":
        backend.sliding_window_size = 4096
    if why == "no_table":
        del backend.req_to_token
    assert route.route_block_attention(backend)
    _table_forward(backend)
    _triton_replay(backend)
    assert backend.setups == [False] and route.ROUTE.plans_skipped == 0


def test_a_table_of_ids_a_unified_pool_translates_is_no_table_of_slots():
    assert route.table_holds_slots(SimpleNamespace())
    assert route.table_holds_slots(SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=False)))
    assert not route.table_holds_slots(SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True)))
    assert not route.table_holds_slots(SimpleNamespace(kv_index_translator=SimpleNamespace()))  # unknown: no
    assert not route.table_holds_slots(SimpleNamespace(_translate_kv_loc=lambda loc: loc))  # 0.5.17
    assert route.table_holds_slots(SimpleNamespace(_translate_kv_loc=None))


class PagedPrefillWrapper:
    def __init__(self):
        self.calls = []

    def forward(self, q, kv_cache, causal=True, sm_scale=None, window_left=-1, logits_soft_cap=0.0,
                k_scale=None, v_scale=None):
        self.calls.append(causal)
        return q


class FlashInferAttnBackend:  # SGLang's: writes the block's K/V, then runs the planned wrapper
    def __init__(self, use_ragged=False):
        self.page_size = 1
        self.wrapper = PagedPrefillWrapper()
        self.forward_metadata = SimpleNamespace(use_ragged=use_ragged, prefill_wrappers=[self.wrapper],
                                                multi_item_params=None)
        self.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(4, 32, dtype=torch.int32))
        self.prefill_uses_dequant_workspace = False
        self.plans = []

    dispatch_reason = None
    use_sliding_window_kv_pool = False

    def _get_wrapper_idx(self, layer):
        return 0

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.plans.append(in_capture)  # SGLang plans the wrappers here, before each capture and replay

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, window_left=-1,
                       cache_dtype=torch.float32, kv_scale=1.0):
        cache = torch.zeros(10, KV_HEADS, DIM, dtype=cache_dtype)
        wrapper = self.forward_metadata.prefill_wrappers[self._get_wrapper_idx(layer)]
        return wrapper.forward(q.view(-1, Q_HEADS, DIM), (cache, cache.clone()), causal=layer.causal,
                               sm_scale=layer.scaling, window_left=window_left, logits_soft_cap=0.0,
                               k_scale=kv_scale, v_scale=kv_scale)


def _flashinfer_forward(backend, verify=True, causal=True, **kwargs):
    q = torch.randn(2 * BLOCK, Q_HEADS * DIM)
    batch = SimpleNamespace(forward_mode=_mode(verify), req_pool_indices=torch.tensor([3, 1]),
                            seq_lens=torch.tensor([5, 9]))
    backend.forward_extend(q, q, q, SimpleNamespace(causal=causal, scaling=0.125), batch, **kwargs)


def test_flashinfer_passes_take_the_block_kernel_over_the_request_table(monkeypatch):
    calls = []
    monkeypatch.setattr(route, "block_attention_by_table", lambda *args: calls.append(args) or args[1])
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    backend = FlashInferAttnBackend()
    assert route.route_block_attention(backend)
    _flashinfer_forward(backend, causal=True)
    _flashinfer_forward(backend, causal=False)
    assert backend.wrapper.calls == [] and [c[-1] for c in calls] == [True, False]
    q, o, k_cache, v_cache, table, req_pool_indices, prefix_lens, block, sm_scale, causal = calls[0]
    assert table is backend.req_to_token_pool.req_to_token and req_pool_indices.tolist() == [3, 1]
    assert prefix_lens.tolist() == [5, 9] and block == BLOCK and sm_scale == 0.125 and q.shape == o.shape
    assert "forward" not in backend.wrapper.__dict__  # the wrapper's own method is back
    _flashinfer_forward(backend, verify=False)  # a prefill
    _flashinfer_forward(backend, window_left=8)
    _flashinfer_forward(backend, cache_dtype=torch.bfloat16)
    _flashinfer_forward(backend, kv_scale=torch.ones(()))  # a tensor scale: its value is not read
    assert backend.wrapper.calls == [True] * 4 and len(calls) == 2
    ragged = FlashInferAttnBackend(use_ragged=True)
    assert route.route_block_attention(ragged)
    _flashinfer_forward(ragged)
    assert ragged.wrapper.calls == [True] and len(calls) == 2
    assert route.ROUTE.report() == {"backends": 2, "routed_calls": 2, "declined_calls": 4, "plans_skipped": 0,
                                    "served_whole": 0, "refused_tiles": []}
    translating = FlashInferAttnBackend()
    translating.kv_index_translator = SimpleNamespace(is_translating=True)
    assert not route.route_block_attention(translating)  # its table holds ids, not cache rows


def test_a_flashinfer_pass_whose_tile_the_gpu_refuses_goes_to_the_planned_wrapper(monkeypatch):
    def refused(*args):
        raise route.TileTooLarge("64 x 256 torch.float32 query tile: out of resource: shared memory")

    monkeypatch.setattr(route, "block_attention_by_table", refused)
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    backend = FlashInferAttnBackend()
    assert route.route_block_attention(backend)
    _flashinfer_forward(backend, causal=True)
    _flashinfer_forward(backend, causal=False)
    assert backend.wrapper.calls == [True, False]  # FlashInfer's planned forward served both
    report = route.ROUTE.report()
    assert report["routed_calls"] == 0 and report["declined_calls"] == 2 and len(report["refused_tiles"]) == 1


def _replay(backend, verify=True, in_capture=False, ragged=None):
    spec_info = SimpleNamespace(ragged_verify_layout=ragged)
    backend.init_forward_metadata_out_graph(SimpleNamespace(forward_mode=_mode(verify), spec_info=spec_info),
                                            in_capture=in_capture)


def test_flashinfer_replays_of_routed_passes_go_unplanned(monkeypatch):
    monkeypatch.setattr(route, "block_attention_by_table", lambda *args: args[1])  # returns o, as the kernel does
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    backend = FlashInferAttnBackend()
    assert route.route_block_attention(backend)
    _replay(backend, in_capture=True)  # a capture plans as SGLang does, then runs the routed layers
    _flashinfer_forward(backend)
    _replay(backend)  # a replay of that graph: no plan
    _replay(backend, verify=False)  # a decode or prefill replay plans
    _replay(backend, ragged=object())  # a ragged verify plans
    assert backend.plans == [True, False, False] and route.ROUTE.plans_skipped == 1
    _flashinfer_forward(backend, window_left=8)  # an eager call that declines plans for itself
    _replay(backend)
    assert backend.plans == [True, False, False] and route.ROUTE.plans_skipped == 2
    assert route.as_the_scheduler_sees(backend).needs_cpu_seq_lens is False
    monkeypatch.setattr(route, "capturing", lambda: True)
    _flashinfer_forward(backend, window_left=8)  # once a capture declines, its graph runs the wrapper
    _replay(backend)
    assert backend.plans == [True, False, False, False] and route.ROUTE.plans_skipped == 2
    assert route.as_the_scheduler_sees(backend) is backend


def test_the_scheduler_copies_no_host_lengths_for_a_backend_whose_replays_go_unplanned(monkeypatch):
    monkeypatch.setattr(route, "block_attention_by_table", lambda *args: args[1])  # returns o, as the kernel does
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    backend = FlashInferAttnBackend()
    assert route.as_the_scheduler_sees(backend) is backend  # not routed
    assert route.route_block_attention(backend)
    seen = route.as_the_scheduler_sees(backend)
    assert seen.needs_cpu_seq_lens is False and seen.backend is backend
    assert seen.req_to_token_pool is backend.req_to_token_pool  # anything else is the backend's
    planning = FlashInferAttnBackend()
    planning.use_sliding_window_kv_pool = True  # its replays keep planning
    assert route.route_block_attention(planning) and route.as_the_scheduler_sees(planning) is planning
    triton = TritonAttnBackend()
    assert route.route_block_attention(triton) and route.as_the_scheduler_sees(triton) is triton
    try:  # the installed SGLang's decision, from the worker's spec_v2_attn_backends
        from sglang.srt.managers import overlap_utils
        from sglang.srt.managers.overlap_utils import decide_needs_cpu_seq_lens
    except ImportError:
        return
    exec_config = SimpleNamespace(overlap=SimpleNamespace(enable_two_batch_overlap=False),
                                  enable_two_batch_overlap=False)
    monkeypatch.setattr(overlap_utils, "get_exec", lambda: exec_config, raising=False)
    monkeypatch.setattr(overlap_utils, "get_spec", lambda: SimpleNamespace(speculative_algorithm="DFLASH"),
                        raising=False)
    monkeypatch.setattr("sglang.srt.runtime_context.get_spec", overlap_utils.get_spec, raising=False)
    args = (SimpleNamespace(enable_two_batch_overlap=False, speculative_algorithm="DFLASH"),)  # 0.5.17-0.5.19
    if "server_args" not in inspect.signature(decide_needs_cpu_seq_lens).parameters:
        args = ()
    assert decide_needs_cpu_seq_lens(*args, (seen, route.as_the_scheduler_sees(backend))) is False
    assert decide_needs_cpu_seq_lens(*args, (seen, planning)) is True


@pytest.mark.parametrize("why", ["switched_off", "sliding_window_pool", "several_wrappers"])
def test_flashinfer_replays_plan_where_the_skip_does_not_hold(monkeypatch, why):
    monkeypatch.setattr(route, "block_attention_by_table", lambda *args: args[1])  # returns o, as the kernel does
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    if why == "switched_off":
        monkeypatch.setenv("SGLANG_DFLASH_SKIP_UNUSED_PLANS", "0")
    backend = FlashInferAttnBackend()
    backend.use_sliding_window_kv_pool = why == "sliding_window_pool"
    backend.dispatch_reason = "SLIDING_WINDOW" if why == "several_wrappers" else None
    assert route.route_block_attention(backend)
    _flashinfer_forward(backend)
    _replay(backend)
    assert backend.plans == [False] and route.ROUTE.plans_skipped == 0


def test_sglang_extend_kernel_takes_the_arguments_the_route_reads():
    """The installed SGLang's extend kernel, as its Triton backend wraps it, leads with the
    arguments the route reads by position, and its other ones are known to the route."""
    ops = pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    names = list(inspect.signature(torch.compiler.disable(ops.extend_attention_fwd)).parameters)
    assert tuple(names[: len(route._POSITIONAL)]) == route._POSITIONAL
    assert set(names[len(route._POSITIONAL):]) <= route._UNREAD | set(route._AT_DEFAULT)


def _sglang_backend_source(name: str) -> str:
    """The installed SGLang's ``srt/layers/attention/NAME.py``; the test skips without sources."""
    from sglang_dflash import compat

    root = compat.installed_source_root()
    if root is None:
        pytest.skip("no SGLang sources")
    with open(f"{root}/srt/layers/attention/{name}.py") as f:
        return f.read()


def _method(source: str, name: str) -> str:
    """The body of the class method ``name`` in ``source``, up to the next method."""
    body = source[source.index(f"    def {name}("):]
    return body[: body.index("\n    def ", 10)]


def test_sglang_hybrid_wrapper_reaches_its_full_attention_backend_by_attribute():
    """The installed SGLang's hybrid wrapper calls its full-attention backend's ``forward_extend``
    and replay set-up on the instance each time, so what the route puts there is what runs."""
    source = _sglang_backend_source("hybrid_linear_attn_backend")
    wrapper = source[source.index("class HybridLinearAttnBackend("):]
    assert "self.full_attn_backend.forward_extend(" in _method(wrapper, "forward_extend")
    assert "self.full_attn_backend = full_attn_backend" in wrapper
    if "    def init_forward_metadata_out_graph(" in wrapper:  # 0.5.23's replay set-up, which the route skips
        assert "attn_backend.init_forward_metadata_out_graph(" in _method(wrapper, "init_forward_metadata_out_graph")


def test_sglang_flashinfer_backend_runs_the_paged_wrapper_the_route_lends_a_forward():
    """The installed SGLang's FlashInfer backend attends a TARGET_VERIFY pass through
    ``prefill_wrapper_paged.forward`` with the keywords the lent ``forward`` reads, and keeps the
    attributes the route consults."""
    source = _sglang_backend_source("flashinfer_backend")
    call = source[source.index("o = prefill_wrapper_paged.forward("):]
    call = call[: call.index("\n            )\n")]
    for keyword in ("causal=", "sm_scale=", "window_left=", "logits_soft_cap=", "k_scale=", "v_scale="):
        assert keyword in call
    for attribute in ("self.req_to_token_pool = ", "def _get_wrapper_idx", "use_ragged", "prefill_wrappers",
                      "self.dispatch_reason = ", "self.use_sliding_window_kv_pool = "):
        assert attribute in source
    # the replay set-up the route skips: (forward_batch, in_capture), planning TARGET_VERIFY through
    # the prefill updater and refilling only the sliding-window pool's buffer beside it
    setup = _method(source, "init_forward_metadata_out_graph")
    assert "forward_batch: ForwardBatch,\n        in_capture: bool = False," in setup
    assert "elif forward_mode.is_target_verify():\n            self.indices_updater_prefill.update(" in setup
    assert setup.count("self.use_sliding_window_kv_pool") == 1


def test_sglang_triton_backend_caches_the_block_before_the_kernel_and_sets_up_only_its_inputs():
    """The installed SGLang's Triton backend writes a pass's K/V to the cache before its extend
    kernel (so the table reads the block), keeps the request table, and before a replay refills
    only what the extend kernel reads (and a sliding-window pool's write loc)."""
    source = _sglang_backend_source("triton_backend")
    extend = _method(source, "forward_extend")
    kernel = "self._forward_extend_kernel(" if "self._forward_extend_kernel(" in extend else "self.extend_attention_fwd("
    assert extend.index("if save_kv_cache:") < extend.index(kernel)  # 0.5.23 / 0.5.17
    assert "self.req_to_token = model_runner.req_to_token_pool.req_to_token" in source
    setup = _method(source, "init_forward_metadata_out_graph")
    assert "forward_batch: ForwardBatch,\n        in_capture: bool = False," in setup
    verify = _method(source, "_update_target_verify_buffers")
    for filled in ("qo_indptr", "kv_indptr", "mask_indptr", "custom_mask"):
        assert filled in verify


# ---- Triton passes served whole: the same K/V write and kernel call as SGLang's forward_extend -----------


class KVPool:
    """A one-token-page MHA pool: what SGLang's set_kv_buffer writes, and where."""

    requires_physical_write_loc = False

    def __init__(self, dtype=torch.float32):
        self.k = torch.zeros(40, KV_HEADS, DIM, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.writes = []

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v

    def get_kv_buffer(self, layer_id):
        return self.k, self.v

    def set_kv_buffer(self, layer, loc, k, v, *scales, **kwargs):
        loc = getattr(loc, "loc", loc)  # SGLang's KVWriteLoc (0.5.17+) or a bare loc
        self.k[loc], self.v[loc] = k.reshape(-1, KV_HEADS, DIM), v.reshape(-1, KV_HEADS, DIM)
        self.writes.append((loc.tolist(), scales, kwargs))


def sglang_triton_backend(**overrides):
    """The installed SGLang's Triton backend class, its state set by hand (no GPU, no model runner):
    its own ``forward_extend`` and ``_set_kv_buffer`` run."""
    triton_backend = pytest.importorskip("sglang.srt.layers.attention.triton_backend")
    backend = object.__new__(triton_backend.TritonAttnBackend)
    table = torch.arange(4 * 32, dtype=torch.int32).view(4, 32)
    state = dict(
        page_size=1, req_to_token=table, req_to_token_pool=SimpleNamespace(req_to_token=table, size=4),
        token_to_kv_pool=KVPool(), dcp_size=1, dcp_rank=0, enable_deterministic=False, use_mla=False,
        dllm_attention=None, use_verify_splitkv=False, use_verify_shared_kv=False, use_dense_fp8_chunked_prefill=False,
        allow_bidirectional_attention_in_extend=False, sliding_window_size=None, _translate_kv_loc=None,
        kv_index_translator=None,
        forward_metadata=SimpleNamespace(custom_mask=None, swa_out_cache_loc=None, out_cache_loc_full_physical=None,
                                         qo_indptr=None, kv_indptr=None, kv_indices=None, mask_indptr=None,
                                         max_extend_len=BLOCK, window_kv_indptr=None, window_kv_indices=None,
                                         window_kv_offsets=None),
    )
    state.update(overrides)
    backend.__dict__.update(state)
    backend.extend_attention_fwd = _extend_kernel_never_runs
    return backend


def _extend_kernel_never_runs(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                              kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                              sm_scale=None, **rest):
    pytest.fail("SGLang's extend kernel ran")


def _sglang_layer(kind="DECODER", **overrides):
    from sglang.srt.layers.radix_attention import AttentionType

    layer = dict(layer_id=0, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS, qk_head_dim=DIM,
                 v_head_dim=DIM, head_dim=DIM, scaling=0.125, k_scale=None, v_scale=None, k_scale_float=None,
                 v_scale_float=None, attn_type=getattr(AttentionType, kind), is_cross_attention=False,
                 sliding_window_size=-1, logit_cap=0.0, logit_capping_method="tanh", xai_temperature_len=-1)
    layer.update(overrides)
    return SimpleNamespace(**layer)


def _pass(backend, layer, save_kv_cache=True, **batch):
    """One TARGET_VERIFY call as RadixAttention makes it: q flat, k and v views of one projection
    (strided, as a fused QKV leaves them)."""
    torch.manual_seed(0)
    qkv = torch.randn(2 * BLOCK, (Q_HEADS + 2 * KV_HEADS) * DIM)
    q, k, v = qkv.split([Q_HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    k, v = k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)
    assert not k.is_contiguous()
    fields = dict(forward_mode=SimpleNamespace(is_target_verify=lambda: True, is_dllm_extend=lambda: False),
                  req_pool_indices=torch.tensor([3, 1]), seq_lens=torch.tensor([5, 9]),
                  out_cache_loc=torch.arange(20, 20 + 2 * BLOCK), out_cache_loc_is_physical=False, spec_info=None,
                  mha_one_shot=False, attn_attend_prefix_cache=None, extend_seq_lens_cpu=None)
    fields.update(batch)
    out = backend.forward_extend(q, k, v, layer, SimpleNamespace(**fields), save_kv_cache=save_kv_cache)
    return out, q


@pytest.mark.parametrize("kind", ["DECODER", "ENCODER_ONLY"])  # the target's verify, the draft's pass
def test_sglang_triton_passes_are_served_whole_with_its_kv_write_and_the_table_kernel(table_calls, monkeypatch, kind):
    """The installed SGLang's forward_extend is one the route has read. Routed with the copies
    skipped and without, a pass leaves the same cache, makes the same kernel call and returns
    the buffer that call filled; skipped, SGLang's forward_extend never runs."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert compat.source_digest(TritonAttnBackend.forward_extend) in route.TRITON_FORWARD_EXTEND_SOURCES
    runs = {}
    for skip in ("1", "0"):
        monkeypatch.setenv("SGLANG_DFLASH_SKIP_KV_COPIES", skip)
        monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
        backend = sglang_triton_backend()
        sglang_writes = []
        backend._set_kv_buffer = lambda *args, **kwargs: (sglang_writes.append(1),
                                                            TritonAttnBackend._set_kv_buffer(backend, *args, **kwargs))
        assert route.route_block_attention(backend)
        before = len(table_calls)
        out, q = _pass(backend, _sglang_layer(kind))
        (call,) = table_calls[before:]
        runs[skip] = (backend.token_to_kv_pool, call, out, sglang_writes, route.ROUTE.report())
    (pool, call, out, sglang_writes, report), (pool0, call0, out0, sglang_writes0, report0) = runs["1"], runs["0"]
    assert sglang_writes == [] and sglang_writes0 == [1]  # the K/V write: the route's, then SGLang's own
    assert [w[0] for w in pool.writes] == [w[0] for w in pool0.writes] == [list(range(20, 20 + 2 * BLOCK))]
    assert torch.equal(pool.k, pool0.k) and torch.equal(pool.v, pool0.v) and pool.k[20:].abs().sum() > 0
    q3, o, k_cache, v_cache, table, rows, lens, block, sm_scale, causal = call
    q3_0, o0, *rest0 = call0
    assert torch.equal(q3, q3_0) and q3.shape == (2 * BLOCK, Q_HEADS, DIM) and o.shape == o0.shape
    same = lambda a, b: torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b  # noqa: E731
    assert all(same(a, b) for a, b in zip((k_cache, v_cache, table, rows, lens, block, sm_scale, causal), rest0))
    assert k_cache is pool.k and v_cache is pool.v and rows.tolist() == [3, 1] and lens.tolist() == [5, 9]
    assert causal == (kind == "DECODER") and block == BLOCK and sm_scale == 0.125
    assert out.shape == q.shape and out.data_ptr() == o.data_ptr()  # the kernel's output is the pass's
    assert report["served_whole"] == 1 and report["routed_calls"] == 1 and report0["served_whole"] == 0


@pytest.mark.parametrize("why", ["no_save", "k_scale", "window", "soft_cap", "cross", "bidirectional", "dcp",
                                 "deterministic", "mla", "custom_mask", "swa_pool", "physical_pool", "ragged",
                                 "sinks", "fp16_cache"])
def test_triton_passes_served_whole_only_where_sglang_would_write_and_attend_alike(table_calls, kernel_calls,
                                                                                   monkeypatch, why):
    pytest.importorskip("sglang.srt.layers.attention.triton_backend")
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    layer = {"k_scale": {"k_scale": 0.5, "v_scale": 0.5, "k_scale_float": 0.5, "v_scale_float": 0.5},
             "window": {"sliding_window_size": 8}, "soft_cap": {"logit_cap": 30.0},
             "cross": {"is_cross_attention": True}}.get(why, {})
    kind = "DECODER_BIDIRECTIONAL" if why == "bidirectional" else "DECODER"
    backend = sglang_triton_backend(**{"dcp": {"dcp_size": 2}, "deterministic": {"enable_deterministic": True},
                                       "mla": {"use_mla": True}}.get(why, {}))
    if why == "custom_mask":
        backend.forward_metadata.custom_mask = torch.ones(4, dtype=torch.bool)
    if why == "swa_pool":
        backend.forward_metadata.swa_out_cache_loc = torch.arange(8)
    if why == "physical_pool":
        backend.token_to_kv_pool.requires_physical_write_loc = True
    if why == "fp16_cache":
        backend.token_to_kv_pool = KVPool(torch.float16)
    assert route.route_block_attention(backend)
    served = route.serve_pass_by_table
    args = {"no_save": ((False,), {}), "sinks": ((), {"sinks": torch.zeros(Q_HEADS)})}.get(why, ((), {}))
    q = torch.randn(2 * BLOCK, Q_HEADS * DIM)
    k = v = torch.randn(2 * BLOCK, KV_HEADS, DIM)
    spec_info = SimpleNamespace(ragged_verify_layout=object() if why == "ragged" else None)
    batch = SimpleNamespace(forward_mode=_mode(True), req_pool_indices=torch.tensor([3, 1]),
                            seq_lens=torch.tensor([5, 9]), out_cache_loc=torch.arange(8), spec_info=spec_info,
                            mha_one_shot=False)
    assert served(backend, backend.req_to_token, q, k, v, _sglang_layer(kind, **layer), batch, *args) is None
    assert backend.token_to_kv_pool.writes == [] and table_calls == [] and route.ROUTE.served_whole == 0


def test_a_pass_whose_tile_the_gpu_refuses_goes_through_sglangs_forward_extend(monkeypatch):
    def refused(*args):
        raise route.TileTooLarge("64 x 256 torch.float32 query tile: out of resource: shared memory")

    monkeypatch.setattr(route, "block_attention_by_table", refused)
    monkeypatch.setattr(route, "block_attention", refused)
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    ran = []

    def sglang_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                      custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=None, **rest):
        ran.append(is_causal)

    backend = sglang_triton_backend()
    backend.extend_attention_fwd = sglang_extend  # SGLang's own kernel, which serves the pass here
    assert route.route_block_attention(backend)
    _pass(backend, _sglang_layer())
    report = route.ROUTE.report()
    assert ran == [True] and report["routed_calls"] == 0 and report["served_whole"] == 0
    assert len(report["refused_tiles"]) == 1 and report["declined_calls"] == 2  # the whole pass, then the kernel call


def test_a_forward_extend_not_read_here_is_never_served_whole(table_calls, monkeypatch, caplog):
    monkeypatch.setattr(route, "ROUTE", route.BlockAttentionRoute())
    backend = TableTritonBackend()  # this file's stand-in: its forward_extend is no SGLang release's
    with caplog.at_level("INFO", logger="sglang_dflash"):
        assert route.route_block_attention(backend)
    assert "not one the plugin has read" in caplog.text
    assert not route.forward_extend_read(TableTritonBackend)
    _table_forward(backend)
    assert len(table_calls) == 1 and route.ROUTE.served_whole == 0


@pytest.mark.parametrize("version", compat.SUPPORTED)
def test_the_forward_extends_read_here_are_each_supported_releases(version):
    """Every supported release's Triton forward_extend is one the route serves whole (read from its
    wheel, digested as ``inspect.getsource`` gives it), so none is left to the copies unread."""
    import ast
    import hashlib
    import textwrap

    from test_compat import sglang_source

    with open(f"{sglang_source(version)}/srt/layers/attention/triton_backend.py") as f:
        source = f.read()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "TritonAttnBackend")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward_extend")
    first = min([method.lineno] + [d.lineno for d in method.decorator_list])
    text = "".join(source.splitlines(keepends=True)[first - 1: method.end_lineno])
    assert hashlib.sha256(textwrap.dedent(text).encode()).hexdigest()[:16] in route.TRITON_FORWARD_EXTEND_SOURCES
