"""The SGLang contract: every symbol the plugin touches resolves, on the installed release by
import and on every supported release by reading its wheel's source.

The per-release check downloads the SGLang wheels (``pip download --no-deps``, ~40 MB each) into
``.cache/sglang-wheels`` once; the next SGLang upgrade then fails here instead of in a server.
"""

import importlib
import inspect
import os
import subprocess
import sys
import zipfile

import pytest

from sglang_dflash import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".cache", "sglang-wheels")
# Modules whose import needs a GPU (sgl_kernel's CUDA ops): the source check covers them on the CPU.
NEEDS_GPU = ("sglang.srt.layers.attention.hybrid_linear_attn_backend", "sglang.srt.model_executor.model_runner",
             "sglang.srt.layers.layernorm", "sglang.srt.layers.activation", "sglang.srt.models.utils",
             "sglang.srt.layers.rotary_embedding", "sglang.srt.layers.linear", "sglang.srt.layers.sampler",
             "sglang.srt.layers.quantization.unquant", "sglang.srt.layers.radix_attention",
             "sglang.srt.layers.logits_processor", "sglang.srt.layers.attention.flashattention_backend")


def sglang_source(version):
    """The ``sglang`` package folder of a release's wheel, unpacked under .cache once."""
    dest = os.path.join(WHEELS, version)
    if not os.path.isdir(os.path.join(dest, "sglang")):
        os.makedirs(WHEELS, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--platform", "manylinux_2_34_x86_64",
                        f"sglang=={version}", "-d", WHEELS], check=True, capture_output=True)
        wheel = next(f for f in os.listdir(WHEELS) if f.startswith(f"sglang-{version}-") and f.endswith(".whl"))
        with zipfile.ZipFile(os.path.join(WHEELS, wheel)) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
        os.remove(os.path.join(WHEELS, wheel))
    return os.path.join(dest, "sglang")


def test_families_cover_the_supported_releases_once():
    in_families = [v for releases in compat.FAMILIES.values() for v in releases]
    assert sorted(in_families, key=compat.version_key) == list(compat.SUPPORTED)
    assert compat.SGLangRelease("0.5.17").family == "F2" and compat.SGLangRelease("0.5.23").family == "F5"
    assert compat.SGLangRelease("0.5.24").family is None and not compat.SGLangRelease("0.5.24").supported


def test_each_change_starts_at_its_release():
    r17, r18, r20, r21, r22, r23 = (compat.SGLangRelease(v) for v in ("0.5.17", "0.5.18", "0.5.20", "0.5.21",
                                                                       "0.5.22", "0.5.23"))
    assert not r17.has("stops_before_budget") and r18.has("stops_before_budget")
    assert r17.reserved_lens_field == "reserved_seq_lens_cpu" and r20.reserved_lens_field == "nxt_kv_lens_cpu"
    assert not r20.has("worker_without_ps") and r21.has("worker_without_ps")
    assert not r21.has("kv_loc_plan") and r22.has("kv_loc_plan")
    assert not r22.has("builtin_dp_attention") and r23.has("builtin_dp_attention")
    assert "DFlash2DraftModel" not in r18.builtin_only_drafts() and "DFlash2DraftModel" in r20.builtin_only_drafts()
    assert compat.PLUGIN_DRAFT not in r23.builtin_only_drafts()


def test_the_verify_refreshes_the_track_slots_itself_where_the_worker_leaves_it_to():
    """The worker refreshes a hybrid batch's radix-checkpoint slots before the verify only where
    SGLang's DFlashVerifyInput.prepare_for_verify does not (0.5.17); twice is a host loop over the
    requests and a host-to-device copy more a step."""
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    release = compat.running()
    refreshes = "prepare_mamba_track_for_verify(batch)" in inspect.getsource(DFlashVerifyInput.prepare_for_verify)
    assert refreshes == release.has("verify_prepares_mamba_track"), release.version


def test_the_track_grid_is_read_once_per_server(monkeypatch):
    """A width-1 step asks for the track grid every time; SGLang is asked once."""
    release, reads = compat.SGLangRelease("0.5.23"), []
    monkeypatch.setattr(release, "_read_track_interval", lambda batch: reads.append(batch) or 256)
    assert [release.mamba_track_interval(b) for b in ("first", "second")] == [256, 256] and reads == ["first"]


def test_the_installed_release_has_every_symbol_in_its_source():
    release = compat.running()
    assert release.supported, release.version
    assert compat.missing_symbols(release, compat.installed_source_root()) == []


def test_the_ledgers_hook_target_is_checked_when_it_is_asked_for(monkeypatch):
    """SGLANG_DFLASH_LEDGER's hook is in the contract only where it is registered: a release that
    lacked it would otherwise send every DFLASH server to the built-in for a lab switch."""
    release = compat.running()
    monkeypatch.delenv("SGLANG_DFLASH_LEDGER", raising=False)
    assert "plain_step" not in release.hook_targets()
    monkeypatch.setenv("SGLANG_DFLASH_LEDGER", "1")
    assert release.hook_targets()["plain_step"] == compat.HOOK_TARGETS["plain_step"]
    assert compat.missing_symbols(release, compat.installed_source_root()) == []


def test_the_symbol_check_leaves_no_parsed_source_alive():
    """Every SGLang process runs the check at start; trees it kept would be walked by every full
    GC after (0.15-0.6 s each, stalling a server's request intake)."""
    import ast
    import gc

    def live_ast_nodes():
        gc.collect()
        return sum(isinstance(o, ast.AST) for o in gc.get_objects())

    before = live_ast_nodes()
    assert compat.missing_symbols(compat.running(), compat.installed_source_root()) == []
    assert live_ast_nodes() - before < 1000  # the trees are ~400k nodes


def test_the_installed_release_resolves_every_symbol_by_import():
    """The source check agrees with Python: import each module and look each name up."""
    checked = 0
    for sym in compat.running().symbols():
        if sym.module in NEEDS_GPU:
            continue
        obj = importlib.import_module(sym.module)
        for i, name in enumerate(sym.qualname.split(".")):
            if not hasattr(obj, name):
                # Instance attributes and dataclass fields without defaults live on instances only.
                fields = getattr(obj, "__dataclass_fields__", {}) or getattr(obj, "__annotations__", {})
                assert inspect.isclass(obj) and (name in fields or name in inspect.getsource(obj)), sym
                break
            obj = getattr(obj, name)
        else:
            if sym.params:
                params = inspect.signature(obj).parameters
                assert set(sym.params) <= set(params) or any(
                    p.kind is p.VAR_KEYWORD for p in params.values()), sym
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("version", compat.SUPPORTED)
def test_every_supported_release_has_every_symbol_the_plugin_touches(version):
    assert compat.missing_symbols(compat.SGLangRelease(version), sglang_source(version)) == []


@pytest.mark.parametrize("older, newer", [("0.5.17", "0.5.19"), ("0.5.20", "0.5.21"), ("0.5.21", "0.5.22")])
def test_a_newer_familys_contract_fails_on_an_older_release(older, newer):
    """The check can fail: each family needs something its predecessor lacks."""
    missing = compat.missing_symbols(compat.SGLangRelease(newer), sglang_source(older))
    expected = {
        "0.5.19": "DFlashDraftInputV2.nxt_kv_lens_cpu",
        "0.5.21": "build_draft_tp_worker(server_args, gpu_id, nccl_port, target_model_config, algo_label,",
        "0.5.22": "KVIndexTranslator.bind_own_plan",
    }[newer]
    if newer == "0.5.21":  # 0.5.21 drops a parameter rather than adding one: run it the other way round
        missing = compat.missing_symbols(compat.SGLangRelease(older), sglang_source(newer))
        expected = ("build_draft_tp_worker(server_args, gpu_id, nccl_port, target_model_config, algo_label, "
                    "attention_backend_override, ps)")
    assert any(expected in m for m in missing), missing


def test_split_target():
    assert compat.split_target("a.b.Cls.meth") == ("a.b", "Cls.meth")
    assert compat.split_target("a.b._fn") == ("a.b", "_fn")


@pytest.mark.parametrize("version, model_eos", [("0.5.17", False), ("0.5.18", False), ("0.5.19", True), ("0.5.23", True)])
def test_min_new_tokens_holds_back_what_sglangs_penalizer_holds_back(version, model_eos):
    """Request stop ids, the tokenizer's EOS and extra stops; from 0.5.19 the model's EOS ids too."""
    from types import SimpleNamespace

    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_token_ids={5}), eos_token_ids={9, 2},
                          tokenizer=SimpleNamespace(eos_token_id=2, additional_stop_token_ids={7}))
    assert compat.SGLangRelease(version).min_new_tokens_stop_ids(req) == ({2, 5, 7, 9} if model_eos else {2, 5, 7})
    req.tokenizer, req.sampling_params.stop_token_ids = None, None  # skip_tokenizer_init
    assert compat.SGLangRelease(version).min_new_tokens_stop_ids(req) == ({2, 9} if model_eos else set())


def test_the_width_one_runner_captures_plain_decode_steps_with_the_tapped_hidden_states():
    """SGLang's runner picks TARGET_VERIFY and the server's hidden mode for a speculative target and
    captures inside ``__init__``, a spec input from ``get_spec_info`` in each batch: whatever it
    assigns, the width-1 runner reads DECODE, FULL and no spec input."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode, ForwardMode, get_required_capture_hidden_mode)
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    runner_class = compat.tapped_decode_runner_class()
    assert issubclass(runner_class, DecodeCudaGraphRunner)
    runner = object.__new__(runner_class)
    runner.capture_forward_mode = ForwardMode.TARGET_VERIFY
    runner.capture_hidden_mode = CaptureHiddenMode.NULL
    spec_info = runner.get_spec_info(64)
    assert spec_info is None and runner.capture_forward_mode == ForwardMode.DECODE
    assert get_required_capture_hidden_mode(runner.capture_hidden_mode, spec_info) == CaptureHiddenMode.FULL


@pytest.mark.parametrize("capture, decode_width_one", [(True, True), (True, False), (False, True)])
def test_each_width_gets_a_backend_and_graphs_of_its_own_built_at_that_width(monkeypatch, capture, decode_width_one):
    from types import SimpleNamespace

    import sglang.srt.model_executor.runner.decode_cuda_graph_runner as graph_runners
    import sglang.srt.runtime_context as runtime_context

    spec = SimpleNamespace(speculative_num_draft_tokens=16)
    context = SimpleNamespace(override=lambda source, speculative_num_draft_tokens: setattr(
        spec, "speculative_num_draft_tokens", speculative_num_draft_tokens))
    monkeypatch.setattr(runtime_context, "get_context", lambda: context)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)

    class Runner:
        def __init__(self, model_runner, attn_backend, speculative_num_draft_tokens):
            assert speculative_num_draft_tokens == spec.speculative_num_draft_tokens  # built at its width
            self.attn_backend, self.width = attn_backend, speculative_num_draft_tokens

    class DecodeRunner(Runner):
        pass

    monkeypatch.setattr(graph_runners, "DecodeCudaGraphRunner", Runner)
    monkeypatch.setattr(compat, "tapped_decode_runner_class", lambda: DecodeRunner)
    model_runner = SimpleNamespace(init_new_workspace=False)

    def get_attention_backend(init_new_workspace):
        model_runner.init_new_workspace = init_new_workspace  # as SGLang's does
        return "backend", spec.speculative_num_draft_tokens

    model_runner._get_attention_backend = get_attention_backend
    pairs = compat.running().build_width_runners(model_runner, (8, 4, 1), capture, decode_width_one=decode_width_one)
    assert {w: backend for w, (backend, _) in pairs.items()} == {w: ("backend", w) for w in (8, 4, 1)}
    if capture:
        assert [type(pairs[w][1]) for w in (8, 4, 1)] == [Runner, Runner, DecodeRunner if decode_width_one else Runner]
        assert all(runner.attn_backend is backend for backend, runner in pairs.values())
    else:
        assert all(runner is None for _, runner in pairs.values())
    assert spec.speculative_num_draft_tokens == 16 and not model_runner.init_new_workspace  # the block's again


def test_compact_ragged_verify_turns_on_for_dflash_alone_and_only_on_fa3(monkeypatch):
    """SGLang's graph runner asks one module function whether to capture ragged tiers: wrapped, it
    says yes for DFLASH (and whatever it said before for others); a backend without ragged graphs
    (flashinfer would fail at capture) is refused in one line."""
    from types import SimpleNamespace

    import sglang.srt.model_executor.runner.decode_cuda_graph_runner as runner_module

    from sglang_dflash import compat
    from sglang_dflash.config import DFlashConfigError

    release = compat.running()
    monkeypatch.setattr(runner_module, "ragged_verify_compact_graphs_enabled",
                        runner_module.ragged_verify_compact_graphs_enabled)
    with pytest.raises(DFlashConfigError, match="fa3"):
        release.enable_ragged_verify(type("FlashInferAttnBackend", (), {})())
    fa3 = type("FlashAttentionBackend", (), {"supports_ragged_verify_graph": True})()
    release.enable_ragged_verify(fa3)
    release.enable_ragged_verify(fa3)  # once wrapped, left as it is
    asks = runner_module.ragged_verify_compact_graphs_enabled
    algorithm = lambda name: SimpleNamespace(is_dflash=lambda: name == "DFLASH",  # noqa: E731
                                             supports_ragged_verify=lambda: name == "DSPARK")
    assert asks(algorithm("DFLASH")) and not asks(algorithm("EAGLE"))


def test_a_ragged_layout_takes_the_smallest_tier_that_holds_the_lanes_and_past_the_last_runs_eager(monkeypatch):
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

    from sglang_dflash import compat

    asked = []
    monkeypatch.setattr(RaggedVerifyLayout, "from_verify_lens", classmethod(lambda cls, **kw: asked.append(kw)))
    release = compat.running()
    release.ragged_layout([4, 1, 3], "cpu", [4, 8, 16])
    release.ragged_layout([16, 16], "cpu", [4, 8, 16])  # past the largest tier: its own sum, eager
    release.ragged_layout([2], "cpu", None)  # no graphs
    assert asked == [{"verify_lens_cpu": [4, 1, 3], "device": "cpu", "grid": [4, 8, 16]},
                     {"verify_lens_cpu": [16, 16], "device": "cpu", "grid": [32]},
                     {"verify_lens_cpu": [2], "device": "cpu", "grid": [2]}]


TRACK_AFTER_DECODE = r"""
import torch
from types import SimpleNamespace
from sglang_dflash.compat import running

torch.manual_seed(0)
conv, temporal = torch.randn(2, 6, 3, 2), torch.randn(2, 6, 2, 2, 2)  # [layers, slots, ...]
before = conv.clone(), temporal.clone()
cache = SimpleNamespace(conv=[conv], temporal=temporal)
linear = SimpleNamespace(
    req_to_token_pool=SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache)),
    forward_metadata=SimpleNamespace(mamba_cache_indices=torch.tensor([1, 2, 3, 5])),  # a graph's padded rows
    _translate_mamba_indices=lambda t: t + 0, enable_unified_memory=False)
running().track_decoded_state(SimpleNamespace(linear_attn_backend=linear), torch.tensor([False, True, True]),
                              torch.tensor([4, 5, 0]))
for new, old in ((conv, before[0]), (temporal, before[1])):
    want = old.clone()
    want[:, 5], want[:, 0] = old[:, 2], old[:, 3]
    assert torch.equal(new, want), (new - want).abs().amax(dim=tuple(range(2, new.dim())))
print("tracked")
"""


def test_a_decoded_state_reaches_the_track_slot_of_each_marked_request_in_every_layer():
    """A hybrid target's width-1 DECODE leaves the live recurrent state in each request's slot;
    SGLang's own all-layers track kernel (the installed release's, under the Triton interpreter)
    copies it, conv and SSM, to the track slots of the marked requests alone, and nothing else moves."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", TRACK_AFTER_DECODE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and "tracked" in out.stdout, out.stdout[-1000:] + out.stderr[-3000:]
