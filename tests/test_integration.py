"""Registration through SGLang's plugin framework: entry point, DFLASH takeover, builtin fallback.

Each case runs in a fresh interpreter, as SGLang's launcher and schedulers do, because plugin
loading is once per process.
"""


import json
import os
import random
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch
from conftest import draft_config_dict, write_checkpoint, write_target

from sglang_dflash import compat, integration
from sglang_dflash.config import builtin_serves

RELEASE = compat.running()


def run_python(code, *argv, **env):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *argv],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )
    return out


TAKEOVER = """
    from types import SimpleNamespace
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    cls = SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace(speculative_draft_model_path=None))
    print("DFLASH->" + cls.__module__ + "." + cls.__name__)
    eagle = SpeculativeAlgorithm.EAGLE.create_worker(SimpleNamespace(enable_multi_layer_eagle=False))
    print("EAGLE->" + eagle.__name__)
    from sglang.srt.models.registry import ModelRegistry
    print("MODEL->" + ModelRegistry.models["DFlashDraftModel"].__module__)
"""


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("dflash") == "sglang_dflash.integration:register"


def test_dflash_routes_to_the_plugin_worker_and_model():
    out = run_python(TAKEOVER, SGLANG_PLUGINS="dflash")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DFLASH->sglang_dflash.worker.DFlashWorker" in out.stdout
    assert "EAGLE->EAGLEWorkerV2" in out.stdout  # other algorithms untouched
    assert "MODEL->sglang_dflash.model" in out.stdout


def test_builtin_switch_gives_sglang_its_own_dflash_back():
    out = run_python(TAKEOVER, SGLANG_PLUGINS="dflash", SGLANG_DFLASH_IMPL="builtin")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DFLASH->sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2" in out.stdout
    assert "MODEL->sglang.srt.models.dflash" in out.stdout


def test_unknown_impl_value_is_refused():
    out = run_python(TAKEOVER, SGLANG_PLUGINS="dflash", SGLANG_DFLASH_IMPL="fast")
    assert "SGLANG_DFLASH_IMPL='fast' is not one of plugin, builtin" in out.stdout + out.stderr


def server_args(tmp_path, **overrides):
    args = dict(
        model_path=write_target(str(tmp_path / "target")),
        speculative_draft_model_path=write_checkpoint(str(tmp_path / "draft")),
        speculative_num_draft_tokens=None, speculative_dflash_block_size=None,
        speculative_draft_window_size=None, context_length=None, pp_size=1, enable_dp_attention=False,
        attn_dp_size=1,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.mark.parametrize("field", ["attention_backend", "speculative_draft_attention_backend"])
@pytest.mark.parametrize("backend", ["fa4", "trtllm_mha"])
def test_a_blackwell_only_backend_on_hopper_is_refused_in_one_line(tmp_path, monkeypatch, field, backend):
    from sglang_dflash import config

    monkeypatch.setattr(config, "gpu_capability", lambda: (9, 0))
    with pytest.raises(SystemExit) as e:
        integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path, **{field: backend}))
    message, flag = str(e.value.code), "--" + field.replace("_", "-")
    assert message.startswith(f"sglang-dflash: {flag}: {backend} runs on Blackwell") and "\n" not in message
    assert "this GPU is 9.0: use fa3, flashinfer or triton" in message
    monkeypatch.setattr(config, "gpu_capability", lambda: (10, 0))  # a B200 takes it
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "b200", **{field: backend}))


def test_args_hook_validates_then_defers_to_sglang(tmp_path):
    seen = []
    args = server_args(tmp_path)
    integration.handle_dflash_args_hook(seen.append, args)
    assert seen == [args] and RELEASE.resolving(args).speculative_num_draft_tokens == 16


def test_new_requests_join_a_running_batch_as_under_plain_decoding(tmp_path):
    """SGLang holds a DFLASH server's prefills until 2-4 slots are free (for a draft prefill of its
    own, which the plugin does not run): the plugin turns that off unless the user set it."""
    args = server_args(tmp_path / "a", min_free_slots_delay=None)
    integration.handle_dflash_args_hook(lambda a: None, args)
    assert RELEASE.resolving(args).min_free_slots_delay == 1
    args = server_args(tmp_path / "b", min_free_slots_delay=4)
    integration.handle_dflash_args_hook(lambda a: None, args)
    assert RELEASE.resolving(args).min_free_slots_delay == 4
    args = server_args(tmp_path / "c")  # a release without the field: nothing declared
    integration.handle_dflash_args_hook(lambda a: None, args)
    assert not hasattr(RELEASE.resolving(args), "min_free_slots_delay")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pp_size=2), "--pp-size: DFLASH needs pp_size 1, got 2"),
        (dict(speculative_num_draft_tokens=1), "--speculative-num-draft-tokens: the block must hold"),
        (dict(speculative_draft_model_path="/no/such/draft"), "'/no/such/draft' is not a directory"),
        (dict(context_length=8), "block_size: 16 exceeds the context length 8"),
        (dict(mamba_radix_cache_strategy="extra_buffer_lazy"), "--mamba-radix-cache-strategy: extra_buffer_lazy"),
        (dict(enable_unified_memory=True), "--enable-unified-memory"),
        (dict(speculative_draft_window_size=8), "--speculative-draft-window-size: must be an integer >= the block size 16"),
    ],
)
def test_args_hook_exits_with_one_clear_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as e:
        integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path, **overrides))
    assert str(e.value).startswith("sglang-dflash: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bad_verify_widths_switch_stops_the_launch_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", "8,4")
    with pytest.raises(SystemExit) as e:
        integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path))
    assert str(e.value) == ("sglang-dflash: SGLANG_DFLASH_WIDTHS: '8,4': widths lie in 1..16 and include 16 "
                            "(--speculative-num-draft-tokens)")
    monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", "auto")
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "ok"))


def test_a_block_named_by_flag_is_the_one_verify_width(tmp_path, monkeypatch):
    """Adaptive width is the default; --speculative-num-draft-tokens fixes the block as before,
    unless SGLANG_DFLASH_WIDTHS names the widths too."""
    import os

    monkeypatch.delenv("SGLANG_DFLASH_WIDTHS", raising=False)
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "a"))
    assert "SGLANG_DFLASH_WIDTHS" not in os.environ
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "b", speculative_num_draft_tokens=8))
    assert os.environ["SGLANG_DFLASH_WIDTHS"] == "fixed"
    # A later server of the same process (an in-process Engine) naming no block is adaptive again...
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "d"))
    assert "SGLANG_DFLASH_WIDTHS" not in os.environ
    # ...but a block the user fixed stays fixed.
    monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", "fixed")
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "e"))
    assert os.environ["SGLANG_DFLASH_WIDTHS"] == "fixed"
    monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", "auto")
    integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "c", speculative_num_draft_tokens=8))
    assert os.environ["SGLANG_DFLASH_WIDTHS"] == "auto"


def test_hybrid_target_and_draft_window_pass_the_start_checks(tmp_path):
    target = write_target(str(tmp_path / "t"), layer_types=["linear_attention", "full_attention"] * 4)
    args = server_args(tmp_path, model_path=target, speculative_draft_window_size=1024)
    seen = []
    integration.handle_dflash_args_hook(seen.append, args)
    assert seen == [args]


def test_hooked_sglang_arg_policy_rejects_bad_draft(tmp_path):
    """Through the real hook registry: SGLang's own _handle_dflash now validates first."""
    target = write_target(str(tmp_path / "target"), hidden_size=96)
    draft = write_checkpoint(str(tmp_path / "draft"))
    code = f"""
        from types import SimpleNamespace
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.arg_groups import speculative_hook
        speculative_hook._handle_dflash(SimpleNamespace(
            model_path={target!r}, speculative_draft_model_path={draft!r}, speculative_num_draft_tokens=None,
            speculative_dflash_block_size=None, speculative_draft_window_size=None, context_length=None,
            pp_size=1, enable_dp_attention=False, attn_dp_size=1))
    """
    out = run_python(code, SGLANG_PLUGINS="dflash")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang-dflash: DFlash draft in") and "hidden_size: draft has 64 but the target has 96" in last
    assert "Traceback" not in out.stderr


def registered_targets(monkeypatch, release):
    from sglang.srt.plugins import hook_registry

    registered = []
    monkeypatch.setattr(hook_registry.HookRegistry, "register", lambda *a, **k: registered.append(a[0]))
    monkeypatch.setattr(integration, "_release", lambda: release)
    integration.register()
    return registered


def test_the_running_release_gets_all_its_hooks(monkeypatch):
    assert RELEASE.supported, f"CI runs supported releases only, found {RELEASE.version}"
    targets = registered_targets(monkeypatch, RELEASE)
    assert targets == list(RELEASE.hook_targets().values())
    # Where SGLang still checks the budget first, and refuses logprobs under DFLASH: 0.5.17 only.
    assert (integration.UPDATE_FINISH_STATE in targets) == (RELEASE.version == "0.5.17")
    assert any(t.endswith("validate_dflash_request") for t in targets) == (RELEASE.version == "0.5.17")


def test_the_draft_ring_registers_its_budget_hooks_and_they_act_in_a_plugin_server_only(monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_RING", "1")
    targets = registered_targets(monkeypatch, RELEASE)
    assert [t for t in targets if ".DefaultPoolConfigurator." in t] == [
        compat.HOOK_TARGETS["ring_target_cell"], compat.HOOK_TARGETS["ring_set_aside"]]
    seen = []

    def init(configurator, kvc):
        seen.append(kvc)

    monkeypatch.setattr("sglang_dflash.context.size_target_cell_for_ring", lambda *a: seen.append("ring"))
    monkeypatch.setattr(integration, "_serving", False)  # EAGLE, the built-in DFLASH: SGLang's own sizing
    integration.ring_target_cell_hook(init, object(), "kvc")
    monkeypatch.setattr(integration, "_serving", True)
    integration.ring_target_cell_hook(init, object(), "kvc")
    assert seen == ["kvc", "kvc", "ring"]
    monkeypatch.delenv("SGLANG_DFLASH_DRAFT_RING")
    assert not [t for t in registered_targets(monkeypatch, RELEASE) if ".DefaultPoolConfigurator." in t]


def test_logprob_requests_pass_only_a_plugin_dflash_servers_check(monkeypatch):
    """0.5.17's check refuses return_logprob first: in a plugin server it sees the request without
    it, so its other checks (hidden states under overlap) still speak; elsewhere it is SGLang's."""
    def sglang_check(req, enable_overlap):  # 0.5.17's validate_dflash_request
        if req.return_logprob:
            return "DFLASH speculative decoding does not support return_logprob yet."
        if enable_overlap and req.return_hidden_states:
            return "DFLASH speculative decoding does not support return_hidden_states yet."
        return None

    req = SimpleNamespace(return_logprob=True, return_hidden_states=False)
    monkeypatch.setattr(integration, "_serving", True)
    assert integration.allow_logprobs_hook(sglang_check, req, True) is None
    both = SimpleNamespace(return_logprob=True, return_hidden_states=True)
    assert "return_hidden_states" in integration.allow_logprobs_hook(sglang_check, both, True)
    assert req.return_logprob  # the request itself is untouched
    monkeypatch.setattr(integration, "_serving", False)  # EAGLE, NGRAM, the built-in DFLASH
    assert "return_logprob" in integration.allow_logprobs_hook(sglang_check, req, True)


@pytest.mark.parametrize("version", ["0.5.16", "0.5.24", "0.6.0"])
def test_an_unsupported_release_keeps_the_builtin_and_says_why(monkeypatch, version):
    release = compat.SGLangRelease(version)
    assert registered_targets(monkeypatch, release) == [integration.HANDLE_DFLASH_ARGS]
    assert integration.builtin_reason("plugin", release) == (
        f"SGLang {version} is not a release sglang-dflash supports (0.5.17 to 0.5.23)")


def test_a_release_missing_any_symbol_keeps_the_builtin_all_or_nothing(monkeypatch):
    """Pretend the installed SGLang were another family: some symbol is missing, so no hook at all."""
    other = compat.SGLangRelease("0.5.23" if RELEASE.version == "0.5.17" else "0.5.17")
    assert registered_targets(monkeypatch, other) == [integration.HANDLE_DFLASH_ARGS, integration.CARD_FLAGS]
    reason = integration.builtin_reason("plugin", other)
    assert reason.startswith(f"SGLang {other.version} lacks sglang.srt.")


def test_builtin_switch_reason_names_the_switch(monkeypatch):
    monkeypatch.setenv(integration.IMPL_ENV, "builtin")
    assert registered_targets(monkeypatch, RELEASE) == [integration.HANDLE_DFLASH_ARGS, integration.CARD_FLAGS]
    assert integration.builtin_reason("builtin", RELEASE) == "SGLANG_DFLASH_IMPL=builtin"


def test_fp32_switch_keeps_float32_norms_off_the_cuda_kernels(monkeypatch):
    import torch
    from sglang.srt.plugins import hook_registry

    registered = []
    monkeypatch.setattr(hook_registry.HookRegistry, "register", lambda *a, **k: registered.append(a[0]))
    monkeypatch.setenv(integration.FP32_NORM_ENV, "1")
    integration.register()
    assert {integration.RMSNORM_CUDA, integration.GEMMA_RMSNORM_CUDA, integration.QKNORM_CHECK} <= set(registered)
    calls = []
    jit_check = lambda head_dim, dtype: calls.append(dtype) or True  # noqa: E731
    assert integration.fp32_qknorm_hook(jit_check, 64, torch.float32) is False
    assert integration.fp32_qknorm_hook(jit_check, 64, torch.bfloat16) is True
    assert calls == [torch.bfloat16]  # no JIT build is attempted for float32


STOP_IN_A_MULTI_TOKEN_STEP = """
    import sys
    from array import array
    from types import SimpleNamespace
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    # The scheduler builds its worker first; the hook acts only in a DFLASH server of the plugin's.
    algorithm = SpeculativeAlgorithm[sys.argv[1]]
    algorithm.create_worker(SimpleNamespace(speculative_draft_model_path=None, enable_multi_layer_eagle=False))
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[0])
    params.normalize(None)
    req = Req("r", "", array("i", [1, 2, 3]), params, vocab_size=100)
    req.output_ids = [5, 6, 7, 8, 0, 9, 10, 11]  # one verify step accepted the last five
    req.update_finish_state(5)
    print("FINISH->" + type(req.finished_reason).__name__, req.finished_len)
"""
# What SGLang alone reports for that step: 0.5.17 checks the budget first, later releases stops first.
SGLANG_ALONE = "FINISH->FINISH_LENGTH 8" if RELEASE.version == "0.5.17" else "FINISH->FINISH_MATCHED_TOKEN 5"


@pytest.mark.parametrize("impl, algorithm, expected", [
    ("plugin", "DFLASH", "FINISH->FINISH_MATCHED_TOKEN 5"),
    ("builtin", "DFLASH", SGLANG_ALONE),
    ("plugin", "EAGLE", SGLANG_ALONE),  # other algorithms behave exactly as without the plugin
])
def test_a_stop_token_inside_an_accepted_step_wins_over_the_budget(impl, algorithm, expected):
    """Plain decoding stops at token 0 (5 tokens)."""
    out = run_python(STOP_IN_A_MULTI_TOKEN_STEP, algorithm, SGLANG_PLUGINS="dflash", SGLANG_DFLASH_IMPL=impl)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expected in out.stdout


def make_req(budget, output_ids, stop_ids=(0,)):
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=budget, stop_token_ids=list(stop_ids))
    params.normalize(None)
    req = Req("r", "", array("i", [1, 2, 3]), params, vocab_size=100)
    req.output_ids = list(output_ids)
    return req


def finish(req):
    return type(req.finished_reason).__name__, req.finished_len


def plain_decoding_finish(budget, output_ids):
    """What AR reports: SGLang's own update_finish_state, one token per step."""
    from sglang.srt.managers.schedule_batch import Req

    req = make_req(budget, [])
    for token in output_ids:
        req.output_ids.append(token)
        Req.update_finish_state(req, 1)
        if req.finished():
            break
    return finish(req)


def finish_step(req, n):
    """How a DFLASH step of the plugin's finishes: through the hook where it is installed."""
    from sglang.srt.managers.schedule_batch import Req

    if "stop_before_length" in RELEASE.hook_targets():
        integration.stop_before_length_hook(Req.update_finish_state, req, n)
    else:
        Req.update_finish_state(req, n)


@pytest.fixture(autouse=True)
def plugin_serving(monkeypatch):
    monkeypatch.setattr(integration, "_serving", True)


def speculative_finish(budget, output_ids, step_sizes):
    """The same tokens committed a verify step at a time, as the plugin's DFLASH server finishes them."""

    req, done = make_req(budget, []), 0
    for n in step_sizes:
        req.output_ids.extend(output_ids[done:done + n])
        done += n
        finish_step(req, n)
        assert req.sampling_params.max_new_tokens == budget
        if req.finished() or done >= len(output_ids):
            break
    return finish(req)


@pytest.mark.parametrize("budget, output_ids, steps, expected", [
    (8, [5, 6, 7, 8, 0, 9, 10, 11], [3, 5], ("FINISH_MATCHED_TOKEN", 5)),  # stop inside the step that ends the budget
    (6, [5, 6, 7, 8, 9, 10, 0, 11], [3, 5], ("FINISH_LENGTH", 6)),  # stop past the budget
    # Stop on the budget's own token: 0.5.17's AR says length, later releases the stop.
    (5, [5, 6, 7, 8, 0, 9], [2, 4], ("FINISH_LENGTH" if RELEASE.version == "0.5.17" else "FINISH_MATCHED_TOKEN", 5)),
    (20, [5, 6, 7, 8, 0, 9], [1, 5], ("FINISH_MATCHED_TOKEN", 5)),  # budget not reached: SGLang's own path
])
def test_stop_before_length_hook_cases(budget, output_ids, steps, expected):
    assert speculative_finish(budget, output_ids, steps) == expected == plain_decoding_finish(budget, output_ids)


def test_stop_before_length_hook_equals_plain_decoding_on_random_steps():
    rng = random.Random(0)
    for _ in range(400):
        output_ids = [rng.choice([0, 5, 6, 7, 8, 9]) for _ in range(rng.randrange(1, 24))]
        budget = rng.randrange(1, 26)
        steps = [rng.randrange(1, 9) for _ in range(len(output_ids))]
        ar = plain_decoding_finish(budget, output_ids)
        if ar[0] == "NoneType":
            continue  # AR would go on decoding: the finish is decided by later tokens
        assert speculative_finish(budget, output_ids, steps) == ar, (budget, output_ids, steps)


def test_draft_path_hook_refuses_bad_drafts_in_one_line_and_leaves_other_algorithms(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []

    def original(algorithm, path, *args, **kwargs):
        calls.append((algorithm, path))
        return algorithm

    def refused(path):
        with pytest.raises(SystemExit) as e:
            integration.draft_path_hook(original, "DFLASH", path)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "does not exist" in refused(str(tmp_path / "nope"))
    assert "is not a local folder and the hub has no copy" in refused("z-lab/no-such-draft")
    bad = tmp_path / "bad"
    bad.mkdir()
    assert "has no config.json" in refused(str(bad))
    (bad / "config.json").write_text("{not json")
    assert "config.json: not valid JSON" in refused(str(bad))
    (bad / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    assert "model_type: missing" in refused(str(bad))
    good = write_checkpoint(str(tmp_path / "good"))
    assert integration.draft_path_hook(original, "DFLASH", good) == "DFLASH"
    assert integration.draft_path_hook(original, "EAGLE", str(tmp_path / "nope")) == "EAGLE"  # not ours
    assert calls == [("DFLASH", good), ("EAGLE", str(tmp_path / "nope"))]


def test_a_draft_only_the_builtin_implements_goes_to_the_builtin(tmp_path, caplog):
    """DFlash2 (0.5.19+) is served by the built-in, with one log line; where SGLang has no such
    draft either, the plugin names the architecture it expected."""
    draft = write_checkpoint(str(tmp_path / "d2"))
    path = os.path.join(draft, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["DFlash2DraftModel"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    args = server_args(tmp_path, speculative_draft_model_path=draft)
    seen = []
    if "DFlash2DraftModel" in RELEASE.builtin_only_drafts():
        with caplog.at_level("INFO", logger="sglang_dflash"):
            integration.handle_dflash_args_hook(seen.append, args)
        assert seen == [args]
        assert "built-in implementation: the draft's architecture DFlash2DraftModel" in caplog.text
        assert integration.create_worker_hook(lambda self, a: "builtin-worker", _Dflash(), args) == "builtin-worker"
    else:
        with pytest.raises(SystemExit, match="architectures: expected"):
            integration.handle_dflash_args_hook(seen.append, args)


@pytest.mark.parametrize("variant, since", [
    ({"dflash_config": {"conv_kernel_size": 4, "conv_group_size": 8}}, "0.5.19"),
    ({"dflash_config": {"projector_type": "domino"}}, "0.5.20"),
    ({"use_gemma_norm": True}, "0.5.23"),
])
def test_a_draft_variant_only_the_builtin_implements_goes_to_the_builtin(tmp_path, variant, since):
    """Same architecture name, a config asking for what only the built-in has (where it has it)."""
    cfg = draft_config_dict()
    for key, value in variant.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    for version in compat.SUPPORTED:
        has_it = compat.version_key(version) >= compat.version_key(since)
        assert (compat.SGLangRelease(version).builtin_only_variant(cfg) is not None) == has_it, version
    args = server_args(tmp_path, speculative_draft_model_path=write_checkpoint(str(tmp_path / "v"), config=cfg))
    reason = builtin_serves(args, RELEASE)  # through the checkpoint on disk, on the installed release
    assert (reason or "").startswith("the draft uses ") == (RELEASE.key >= compat.version_key(since)), reason


class _Dflash:
    @staticmethod
    def is_dflash():
        return True


def test_dp_attention_goes_to_the_builtin_where_it_serves_it_else_one_line(tmp_path):
    dp = dict(attn_dp_size=2) if RELEASE.has("attn_dp_size") else dict(enable_dp_attention=True)
    args = server_args(tmp_path, **dp)
    seen = []
    if RELEASE.has("builtin_dp_attention"):
        integration.handle_dflash_args_hook(seen.append, args)
        assert seen == [args]
    else:
        flag = "--attn-dp-size" if RELEASE.has("attn_dp_size") else "--enable-dp-attention"
        with pytest.raises(SystemExit, match=f"sglang-dflash: {flag}: sglang-dflash does not serve DFLASH with DP"):
            integration.handle_dflash_args_hook(seen.append, args)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_disaggregated_server_goes_to_the_builtin_and_says_why(tmp_path, caplog, role):
    """Either role of a PD deployment keeps SGLang's own DFLASH (the decode role's first draft input
    is built by SGLang for its own worker): the args hook hands over to SGLang with one log line,
    and the worker hook does not build the plugin's worker."""
    args = server_args(tmp_path, disaggregation_mode=role)
    seen = []
    with caplog.at_level("WARNING", logger="sglang_dflash"):
        integration.handle_dflash_args_hook(seen.append, args)
    assert seen == [args]
    said = [r.getMessage() for r in caplog.records if "built-in" in r.getMessage()]
    assert said == [f"DFLASH is served by SGLang's built-in implementation: PD disaggregation "
                    f"(--disaggregation-mode {role}) is served by the built-in only."]
    assert integration.create_worker_hook(lambda self, a: "sglang's worker", _Dflash(), args) == "sglang's worker"
    assert builtin_serves(server_args(tmp_path, disaggregation_mode="null"), RELEASE) is None


def test_the_disaggregation_field_the_plugin_reads_exists_on_this_release():
    """The contract for PD: ``compat.pd_role`` reads ``ServerArgs.disaggregation_mode`` ("null" when
    not disaggregated). 0.5.17 declares it as a dataclass field, 0.5.23 in an argument group (a
    slot the source check cannot see), so it is checked on the class itself."""
    from sglang.srt.server_args import ServerArgs

    assert hasattr(ServerArgs, "disaggregation_mode")
    assert RELEASE.pd_role(SimpleNamespace(disaggregation_mode="null")) is None
    assert RELEASE.pd_role(SimpleNamespace()) is None
    assert RELEASE.pd_role(SimpleNamespace(disaggregation_mode="decode")) == "decode"


PREFILL_GRAPHS = """
    import json, os, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import ServerArgs
    target, draft = sys.argv[1:3]
    cases = {"default": {}, "switched_off": {}, "user_list": {"cuda_graph_bs_prefill": [8, 16]},
             "graphs_off": {"cuda_graph_backend_prefill": None, "disable_prefill_cuda_graph": True}}
    out = {}
    for name, flags in cases.items():
        os.environ["SGLANG_DFLASH_ONE_TOKEN_PREFILL_GRAPH"] = "0" if name == "switched_off" else "1"
        # On a CPU machine SGLang's default prefill backend is "disabled": name the GPU's default.
        args = ServerArgs(model_path=target, speculative_algorithm="DFLASH", speculative_draft_model_path=draft,
                          device="cuda", attention_backend="triton", mem_fraction_static=0.5, max_total_tokens=4096,
                          cuda_graph_max_bs_prefill=4096, **{"cuda_graph_backend_prefill": "breakable", **flags})
        args.resolve_once()
        prefill = resolving_view(args).cuda_graph_config.prefill
        out[name] = [prefill.backend, list(prefill.bs or [])[:3]]
    print("GRAPHS=" + json.dumps(out))
"""


def qwen3_target(path):
    """A config SGLang's argument resolution can read (the model type and head layout too)."""
    return write_target(path, model_type="qwen3", intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                        torch_dtype="bfloat16", tie_word_embeddings=False)


@pytest.mark.skipif(not RELEASE.has("declared_resolution"), reason="prefill graph buckets are declared from 0.5.19")
@pytest.mark.parametrize("impl", ["plugin", "builtin"])
def test_a_one_token_prefill_gets_a_graph_bucket_unless_the_user_chose_the_buckets(tmp_path, impl):
    """SGLang's breakable prefill graphs start at 4 tokens and refuse a batch padded more than 2x,
    so a whole-prompt radix-cache hit (one token to prefill) ran eagerly: the plugin adds a bucket
    of 1, through SGLang's own argument resolution. The built-in, a switch, a list the user gave,
    or prefill graphs turned off are left alone."""
    out = run_python(PREFILL_GRAPHS, qwen3_target(str(tmp_path / "target")),
                     write_checkpoint(str(tmp_path / "draft")), SGLANG_PLUGINS="dflash", SGLANG_DFLASH_IMPL=impl)
    assert out.returncode == 0, out.stderr[-3000:]
    graphs = json.loads(out.stdout.split("GRAPHS=")[1])
    assert graphs["default"] == ["breakable", [1, 4, 8] if impl == "plugin" else [4, 8, 12]]
    assert graphs["switched_off"] == ["breakable", [4, 8, 12]]
    assert graphs["user_list"] == ["breakable", [8, 16]]
    assert graphs["graphs_off"][0] == "disabled" and 1 not in graphs["graphs_off"][1]


def test_no_graph_bucket_is_added_where_nothing_was_resolved(tmp_path):
    """Before 0.5.19, or where the prefill graph list is not resolved yet: nothing declared."""
    args = server_args(tmp_path)
    assert RELEASE.with_one_token_prefill_graph(args) is None
    args.cuda_graph_config = SimpleNamespace(prefill=SimpleNamespace(backend="breakable", bs=None))
    assert RELEASE.with_one_token_prefill_graph(args) is None


@pytest.mark.parametrize("layer_types, declared", [(None, True), (["sliding_attention", "full_attention"] * 4, True),
                                                   (["linear_attention", "full_attention"] * 4, False)])
def test_a_hybrid_target_keeps_sglangs_prefill_buckets(tmp_path, monkeypatch, layer_types, declared):
    """A one-token prefill capture has not been checked on linear-attention or Mamba layers."""
    overrides = {} if layer_types is None else {"layer_types": layer_types}
    args = server_args(tmp_path, model_path=write_target(str(tmp_path / "t"), **overrides))
    graphs, declarations = object(), []
    monkeypatch.setattr(RELEASE, "with_one_token_prefill_graph", lambda a: graphs)
    monkeypatch.setattr(RELEASE, "declare", lambda a, **fields: declarations.append(fields))
    monkeypatch.setattr(integration, "_release", lambda: RELEASE)
    integration.handle_dflash_args_hook(lambda a: None, args)
    assert any(d.get("cuda_graph_config") is graphs for d in declarations) == declared, declarations


def test_hybrid_targets_are_told_apart_by_their_config(tmp_path):
    from sglang_dflash.config import TargetInfo

    def attention_only_target(path):
        return TargetInfo.from_pretrained(path).attention_only

    assert attention_only_target(write_target(str(tmp_path / "dense")))
    assert not attention_only_target(write_target(str(tmp_path / "next"), full_attention_interval=4))
    assert not attention_only_target(write_target(str(tmp_path / "nested"), text_config={
        "hidden_size": 64, "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 8}))
    assert not attention_only_target(write_target(str(tmp_path / "nemotron"), architectures=["NemotronHForCausalLM"],
                                                  hybrid_override_pattern="M-M*"))


def tokenizer_manager(tmp_path, algorithm="DFLASH", vocab=4096, **overrides):
    args = server_args(tmp_path, speculative_algorithm=algorithm, **overrides)
    return SimpleNamespace(server_args=args, model_config=SimpleNamespace(vocab_size=vocab))


@pytest.mark.parametrize("input_ids, reason", [
    ([], "The prompt is empty"),
    ([5, -1, 7], "token id -1, outside the model's vocabulary [0, 4096)"),
    ([5, 4096], "token id 4096, outside the model's vocabulary [0, 4096)"),
])
def test_a_prompt_no_forward_can_run_is_refused_like_an_overlong_one(tmp_path, input_ids, reason):
    """An empty prompt (SmolLM2's tokenizer adds no BOS to "") reached the scheduler, whose rotary
    embedding cannot reshape 0 tokens, and the server died; ids outside the vocabulary fail the
    embedding lookup on the GPU. SGLang refuses an overlong prompt with ValueError, a 400: so do we."""
    seen = []
    with pytest.raises(ValueError) as e:
        integration.refuse_unrunnable_prompt_hook(lambda tm, obj, ids: seen.append(ids), tokenizer_manager(tmp_path),
                                                  SimpleNamespace(session_params=None), input_ids)
    assert reason in str(e.value) and "\n" not in str(e.value)
    assert seen == [input_ids]  # SGLang's own checks run first, and their errors win


def test_more_top_logprobs_than_the_vocabulary_holds_is_refused(tmp_path):
    """topk past a row's length raises in the scheduler; asked without return_logprob it is unused."""
    def ask(k, return_logprob=True):
        obj = SimpleNamespace(session_params=None, return_logprob=return_logprob, top_logprobs_num=k)
        integration.refuse_unrunnable_prompt_hook(lambda *a: None, tokenizer_manager(tmp_path), obj, [5, 6])

    with pytest.raises(ValueError, match="top_logprobs_num is 40960, more than the model's vocabulary of 4096"):
        ask(40960)
    ask(4096)
    ask(40960, return_logprob=False)


def test_prompts_the_forward_can_run_pass_and_other_servers_keep_sglangs_checks(tmp_path):
    def original(tm, obj, ids):
        return None

    plain = SimpleNamespace(session_params=None)
    dflash = tokenizer_manager(tmp_path)
    for ids in ([0], [4095, 3, 17], None):  # None: a request given as embeddings
        integration.refuse_unrunnable_prompt_hook(original, dflash, plain, ids)
    # a session's request may be empty: its history supplies the prompt
    integration.refuse_unrunnable_prompt_hook(original, dflash, SimpleNamespace(session_params={"id": "s"}), [])
    for algorithm in ("EAGLE", "NGRAM", None):
        integration.refuse_unrunnable_prompt_hook(original, tokenizer_manager(tmp_path / str(algorithm), algorithm),
                                                  plain, [])


def test_a_server_the_builtin_serves_keeps_sglangs_prompt_checks(tmp_path):
    """A PD-disaggregated DFLASH server runs the built-in: the plugin changes nothing there."""
    tm = tokenizer_manager(tmp_path, disaggregation_mode="prefill")
    integration.refuse_unrunnable_prompt_hook(lambda *a: None, tm, SimpleNamespace(session_params=None), [])


def test_a_hybrid_targets_state_slots_count_requests_apart_from_the_radix_caches_prefixes():
    """/get_server_info's ``state_pool``: slots the radix cache keeps for prefixes (evictable) are
    not in use, so an idle server that cached prefixes reads 0, and a leaked slot still shows."""
    allocator = SimpleNamespace(size=48, available_size=lambda: 40)
    scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_allocator=allocator),
                                tree_cache=SimpleNamespace(mamba_evictable_size=lambda: 7))
    assert integration.recurrent_state_slots(scheduler) == {"used": 1, "cached": 7, "size": 48}
    scheduler.tree_cache = SimpleNamespace()  # no radix cache of states: every slot taken is in use
    assert integration.recurrent_state_slots(scheduler) == {"used": 8, "cached": 0, "size": 48}
    assert integration.recurrent_state_slots(SimpleNamespace(req_to_token_pool=SimpleNamespace())) is None


def test_the_draft_ring_without_a_draft_window_stops_at_start(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_RING", "1")
    with pytest.raises(SystemExit, match="^sglang-dflash: SGLANG_DFLASH_DRAFT_RING: .* --speculative-draft-window-size$"):
        integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "a"))
    seen = []
    args = server_args(tmp_path / "b", speculative_draft_window_size=1024)
    integration.handle_dflash_args_hook(seen.append, args)
    assert seen == [args]


def test_a_held_width_the_step_cannot_verify_stops_at_start(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_WIDTHS", "16,1")
    monkeypatch.setenv("SGLANG_DFLASH_WIDTH_POLICY", "hold:4")
    with pytest.raises(SystemExit, match="^sglang-dflash: SGLANG_DFLASH_WIDTH_POLICY: 'hold:4': width 4 is not "
                                         "one of the verify widths 16, 1$"):
        integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path / "a"))
    monkeypatch.setenv("SGLANG_DFLASH_WIDTH_POLICY", "hold:1")
    seen = []
    args = server_args(tmp_path / "b")
    integration.handle_dflash_args_hook(seen.append, args)
    assert seen == [args]


def test_a_plain_server_times_its_worker_calls_by_mode_only_when_asked(monkeypatch):
    """SGLANG_DFLASH_LEDGER=1: plain decoding's side of a profile. The hook is registered only then,
    and it counts nothing on a speculative server (the plugin's own target calls, EAGLE, the built-in)."""
    monkeypatch.delenv("SGLANG_DFLASH_LEDGER", raising=False)
    assert compat.HOOK_TARGETS["plain_step"] not in registered_targets(monkeypatch, RELEASE)
    monkeypatch.setenv("SGLANG_DFLASH_LEDGER", "1")
    assert compat.HOOK_TARGETS["plain_step"] in registered_targets(monkeypatch, RELEASE)

    monkeypatch.setattr(integration, "_ledger", None)
    monkeypatch.setattr(integration, "_serving", False)
    plain = SimpleNamespace(is_none=lambda: True)
    eagle = SimpleNamespace(is_none=lambda: False)

    def batch(mode, bs, spec=plain, tokens=None):
        return SimpleNamespace(spec_algorithm=spec, seq_lens=torch.zeros(bs), extend_num_tokens=tokens,
                               forward_mode=SimpleNamespace(is_extend=lambda: mode == "extend",
                                                            is_idle=lambda: mode == "idle"))

    calls = []
    forward = lambda worker, b, *a, **k: calls.append(b) or "result"  # noqa: E731
    assert integration.plain_step_hook(forward, "worker", batch("extend", 2, tokens=300)) == "result"
    for _ in range(3):
        integration.plain_step_hook(forward, "worker", batch("decode", 2))
    integration.plain_step_hook(forward, "worker", batch("decode", 2, spec=eagle))  # passed on, not counted
    integration.plain_step_hook(forward, "worker", None, "a forward batch")
    assert len(calls) == 6
    state = integration.server_info_hook(lambda s, r: SimpleNamespace(internal_state={}), SimpleNamespace(), None)
    by_mode = state.internal_state["scheduler_ledger"]["by_mode"]
    assert {m: (v["calls"], v["tokens"]) for m, v in by_mode.items()} == {"extend": (1, 300), "decode": (3, 0)}
    monkeypatch.setattr(integration, "_serving", True)  # the plugin's server: its worker reports instead
    integration.plain_step_hook(forward, "worker", batch("decode", 2))
    assert integration._ledger.by_mode["decode"][0] == 3
    state = integration.server_info_hook(lambda s, r: SimpleNamespace(internal_state={}), SimpleNamespace(), None)
    assert "scheduler_ledger" not in state.internal_state


def test_the_builtin_times_its_worker_calls_by_mode_only_when_asked(monkeypatch):
    """SGLANG_DFLASH_LEDGER=1 beside SGLANG_DFLASH_IMPL=builtin: the built-in's side of a profile,
    its scheduler calls by mode and its decode steps at the block's width, under ``scheduler_ledger``.
    Without the ledger the built-in's server gets no hook of the plugin's but the two it always gets."""
    monkeypatch.setenv("SGLANG_DFLASH_IMPL", "builtin")
    monkeypatch.delenv("SGLANG_DFLASH_LEDGER", raising=False)
    plain_targets = registered_targets(monkeypatch, RELEASE)
    assert compat.HOOK_TARGETS["builtin_step"] not in plain_targets and len(plain_targets) == 2
    monkeypatch.setenv("SGLANG_DFLASH_LEDGER", "1")
    targets = registered_targets(monkeypatch, RELEASE)
    assert targets[2:] == [compat.HOOK_TARGETS["builtin_step"], compat.HOOK_TARGETS["server_info"]]
    assert compat.HOOK_TARGETS["create_worker"] not in targets  # the built-in still serves

    monkeypatch.setattr(integration, "_ledger", None)
    monkeypatch.setattr(integration, "_serving", False)

    def batch(mode, bs, tokens=None):
        return SimpleNamespace(seq_lens=torch.zeros(bs), extend_num_tokens=tokens, is_extend_in_batch=False,
                               forward_mode=SimpleNamespace(is_extend=lambda: mode == "extend",
                                                            is_idle=lambda: mode == "idle"))

    def forward(worker, b, *a, **k):
        return SimpleNamespace(speculative_num_draft_tokens=16)

    integration.builtin_step_hook(forward, "worker", batch("extend", 2, tokens=300))
    for _ in range(3):
        integration.builtin_step_hook(forward, "worker", batch("decode", 4))
    with pytest.raises(RuntimeError):  # a call that raised is timed all the same
        integration.builtin_step_hook(lambda *a, **k: (_ for _ in ()).throw(RuntimeError()), "worker",
                                      batch("decode", 4))
    state = integration.server_info_hook(lambda s, r: SimpleNamespace(internal_state={}), SimpleNamespace(), None)
    ledger = state.internal_state["scheduler_ledger"]
    assert {m: (v["calls"], v["tokens"]) for m, v in ledger["by_mode"].items()} == {"extend": (1, 300), "decode": (4, 0)}
    assert {key[0] for key in integration._ledger.by_width} == {16, 1}  # the raised call's width is unknown: 1
    assert "dflash" not in state.internal_state
