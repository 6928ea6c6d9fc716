"""Registration through SGLang's plugin framework: entry point, DFLASH takeover, builtin fallback.

Each case runs in a fresh interpreter, as SGLang's launcher and schedulers do, because plugin
loading is once per process.
"""


import os
import random
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
from conftest import write_checkpoint, write_target

from sglang_dflash import integration


def run_python(code, **env):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )
    return out


TAKEOVER = """
    from types import SimpleNamespace
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    cls = SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace())
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
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def test_args_hook_validates_then_defers_to_sglang(tmp_path):
    seen = []
    args = server_args(tmp_path)
    integration.handle_dflash_args_hook(seen.append, args)
    assert seen == [args] and args.speculative_num_draft_tokens == 16


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pp_size=2), "--pp-size: DFLASH needs pp_size 1, got 2"),
        (dict(speculative_num_draft_tokens=1), "--speculative-num-draft-tokens: the block must hold"),
        (dict(speculative_draft_model_path="/no/such/draft"), "'/no/such/draft' is not a directory"),
        (dict(context_length=8), "block_size: 16 exceeds the context length 8"),
        (dict(enable_dp_attention=True), "--enable-dp-attention"),
        (dict(speculative_draft_window_size=8), "--speculative-draft-window-size: must be an integer >= the block size 16"),
    ],
)
def test_args_hook_exits_with_one_clear_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as e:
        integration.handle_dflash_args_hook(lambda a: None, server_args(tmp_path, **overrides))
    assert str(e.value).startswith("sglang-dflash: ") and message in str(e.value)
    assert "\n" not in str(e.value)


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
            pp_size=1, enable_dp_attention=False))
    """
    out = run_python(code, SGLANG_PLUGINS="dflash")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang-dflash: DFlash draft in") and "hidden_size: draft has 64 but the target has 96" in last
    assert "Traceback" not in out.stderr


def test_version_gate_keeps_builtin_on_untested_sglang(monkeypatch):
    registered = []
    from sglang.srt.plugins import hook_registry

    monkeypatch.setattr(hook_registry.HookRegistry, "register", lambda *a, **k: registered.append(a[0]))
    monkeypatch.setattr(integration, "sglang_version", lambda: "0.5.99")
    integration.register()
    assert registered == [integration.HANDLE_DFLASH_ARGS]  # only the "built-in serves" log line
    monkeypatch.setattr(integration, "sglang_version", lambda: "0.5.17")
    registered.clear()
    integration.register()
    assert registered == [integration.CREATE_WORKER, integration.HANDLE_DFLASH_ARGS, integration.RESOLVE_ALGORITHM,
                          integration.UPDATE_FINISH_STATE]


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
    from array import array
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8, stop_token_ids=[0])
    params.normalize(None)
    req = Req("r", "", array("i", [1, 2, 3]), params, vocab_size=100)
    req.output_ids = [5, 6, 7, 8, 0, 9, 10, 11]  # one verify step accepted the last five
    req.update_finish_state(5)
    print("FINISH->" + type(req.finished_reason).__name__, req.finished_len)
"""


@pytest.mark.parametrize("impl, expected", [("plugin", "FINISH->FINISH_MATCHED_TOKEN 5"),
                                            ("builtin", "FINISH->FINISH_LENGTH 8")])
def test_a_stop_token_inside_an_accepted_step_wins_over_the_budget(impl, expected):
    """Plain decoding stops at token 0 (5 tokens); SGLang alone reports the budget (8 tokens)."""
    out = run_python(STOP_IN_A_MULTI_TOKEN_STEP, SGLANG_PLUGINS="dflash", SGLANG_DFLASH_IMPL=impl)
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


def speculative_finish(budget, output_ids, step_sizes):
    """The same tokens committed a verify step at a time, through the hook."""
    from sglang.srt.managers.schedule_batch import Req

    req, done = make_req(budget, []), 0
    for n in step_sizes:
        req.output_ids.extend(output_ids[done:done + n])
        done += n
        integration.stop_before_length_hook(Req.update_finish_state, req, n)
        assert req.sampling_params.max_new_tokens == budget
        if req.finished() or done >= len(output_ids):
            break
    return finish(req)


@pytest.mark.parametrize("budget, output_ids, steps, expected", [
    (8, [5, 6, 7, 8, 0, 9, 10, 11], [3, 5], ("FINISH_MATCHED_TOKEN", 5)),  # stop inside the step that ends the budget
    (6, [5, 6, 7, 8, 9, 10, 0, 11], [3, 5], ("FINISH_LENGTH", 6)),  # stop past the budget
    (5, [5, 6, 7, 8, 0, 9], [2, 4], ("FINISH_LENGTH", 5)),  # stop on the budget's own token: AR says length
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


def test_draft_path_hook_refuses_missing_local_paths_and_passes_hub_ids(tmp_path):
    calls = []

    def original(algorithm, path, *args, **kwargs):
        calls.append((algorithm, path))
        return algorithm

    with pytest.raises(SystemExit, match="does not exist"):
        integration.draft_path_hook(original, "DFLASH", str(tmp_path / "nope"))
    assert integration.draft_path_hook(original, "DFLASH", "z-lab/Qwen3-8B-DFlash-b16") == "DFLASH"  # the hub's
    assert integration.draft_path_hook(original, "EAGLE", str(tmp_path / "nope")) == "EAGLE"  # not ours
    assert calls == [("DFLASH", "z-lab/Qwen3-8B-DFlash-b16"), ("EAGLE", str(tmp_path / "nope"))]
