"""The real-scale rig (sglang_dflash.bench.rig): sparse real-shape checkpoints, the bytes floor,
and the benchmark's --rig mode against the fake server."""

import json
import os
import sys
import time

import pytest
from safetensors import safe_open

from sglang_dflash.bench import rig, sweep
from sglang_dflash.bench.server import ServerSpec
from sglang_dflash.config import TargetInfo, load_and_validate

FAKE = os.path.join(os.path.dirname(__file__), "fake_sglang_server.py")


def test_a_qwen3_8b_pair_appears_at_once_takes_no_disk_and_passes_the_draft_checks(tmp_path):
    t0 = time.perf_counter()
    target, draft = rig.write_rig(str(tmp_path), "qwen3-8b", block_size=16)
    assert time.perf_counter() - t0 < 5
    sizes = {p: os.path.getsize(os.path.join(p, "model.safetensors")) for p in (target, draft)}
    assert sizes[target] > 16e9 and sizes[draft] > 2e9  # the published sizes (16.4 GB, 2.1 GB)
    assert sum(os.stat(os.path.join(p, "model.safetensors")).st_blocks for p in sizes) * 512 < 10e6  # holes
    with safe_open(os.path.join(draft, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        fc = f.get_tensor("fc.weight")
    assert len(names) == 58 and tuple(fc.shape) == (4096, 5 * 4096) and not fc.any()  # z-lab count, zeros
    with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 36 * 11 + 3
        assert tuple(f.get_slice("lm_head.weight").get_shape()) == (151936, 4096)
    cfg = load_and_validate(draft, TargetInfo.from_pretrained(target), block_size=16)
    assert list(cfg.target_layer_ids) == [1, 9, 17, 25, 33] and cfg.mask_token_id == 151669


def test_floor_ratio_counts_target_draft_and_the_second_lm_head_read():
    f = rig.floor_ratio("qwen3-8b")
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    target = 2 * (36 * layer + 4096 + 151936 * 4096)  # layers, final norm, lm_head (not the embedding)
    draft = 2 * (5 * layer + 4096 * 5 * 4096 + 2 * 4096)  # layers, fc, hidden_norm and norm
    assert f["target_gb"] == pytest.approx(target / 1e9) and f["draft_gb"] == pytest.approx(draft / 1e9)
    assert f["floor_ratio_c1"] == pytest.approx((target + draft + 2 * 151936 * 4096) / target)
    assert 1.2 < f["floor_ratio_c1"] < 1.25
    assert rig.floor_ratio("qwen3-32b")["floor_ratio_c1"] < f["floor_ratio_c1"]  # a bigger target hides more


def test_rig_requests_are_token_ids_that_run_to_the_budget():
    payloads = rig.rig_payloads(3, 7, 50)
    assert [len(p["input_ids"]) for p in payloads] == [7, 7, 7]
    assert all(p["sampling_params"] == {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True} for p in payloads)
    assert rig.server_flags("zero") == ["--skip-tokenizer-init"]
    assert rig.server_flags("random")[-2:] == ["--load-format", "dummy"]


@pytest.mark.parametrize("argv, message", [
    (["--rig", "zero", "--model-path", "m"], "--rig writes its own target and draft"),
    (["--rig", "ones"], "invalid choice: 'ones'"),
    (["--rig", "zero", "--rig-prompt-len", "0"], "--rig-prompt-len must be >= 1"),
])
def test_bad_rig_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(["--impls", "ar", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_rig_sweep_reports_step_times_beside_the_floor(tmp_path, monkeypatch):
    def command(self, port):  # AR: 1 ms a token; DFLASH: 8 ms a step of 8
        ar = self.impl == "ar"
        return [sys.executable, FAKE, "--port", str(port), "--accept", "1" if ar else "8",
                "--delay-ms", "1" if ar else "8"]

    flags = []
    real_server_flags = sweep.server_flags
    monkeypatch.setattr(sweep, "server_flags", lambda args: flags.append(real_server_flags(args)) or flags[-1])
    monkeypatch.setattr(ServerSpec, "command", command)
    summary = tmp_path / "summary.json"
    earlier = {"weights": "zero", "step_over_ar": {"plugin": {"c1": 1.3}}}
    summary.write_text(json.dumps({"scale": {"0.5.17/fa3": earlier}}))
    monkeypatch.setattr(sweep, "installed_sglang", lambda: "0.5.23")
    rc = sweep.main(["--rig", "zero", "--rig-dir", str(tmp_path / "rig"), "--impls", "ar,plugin",
                     "--num-prompts", "4", "--max-new-tokens", "24", "--rig-prompt-len", "16",
                     "--concurrencies", "1,2", "--output-dir", str(tmp_path / "out"), "--startup-timeout", "30",
                     "--server-args", "--attention-backend triton", "--summary", str(summary)])
    assert rc == 0
    assert os.path.isfile(tmp_path / "rig" / "qwen3-8b" / "draft" / "model.safetensors")
    assert "--skip-tokenizer-init" in flags[0] and "--load-format" not in flags[0]
    scale = json.load(open(tmp_path / "out" / "scale.json"))
    assert scale["shape"] == "qwen3-8b" and scale["weights"] == "zero" and 1.2 < scale["floor_ratio_c1"] < 1.25
    steps = scale["steps"]
    assert set(steps) == {"ar", "plugin"} and set(steps["plugin"]) == {"1", "2"}
    assert steps["ar"]["1"]["over_ar"] == 1.0 and steps["plugin"]["1"]["over_ar"] > 1.5  # about 5 ms vs 1 ms a step
    assert "## Step time at scale: qwen3-8b, zero weights" in open(tmp_path / "out" / "report.md").read()
    recorded = json.loads(summary.read_text())["scale"]
    entry = recorded["0.5.23/triton"]
    assert recorded["0.5.17/fa3"] == earlier and entry["weights"] == "zero"
    assert entry["plugin_step_ms"] == {"c1": steps["plugin"]["1"]["step_ms"], "c2": steps["plugin"]["2"]["step_ms"]}
    assert entry["step_over_ar"]["plugin"]["c1"] == steps["plugin"]["1"]["over_ar"]
    assert "plugin_over_builtin" not in entry  # no built-in ran
    assert recorded["step_ratio_c1"] == 1.3  # fa3 only: the newest release's
    assert recorded["floor_ratio_c1"] == round(scale["floor_ratio_c1"], 3)


def test_the_step_profile_runs_on_the_rig_with_its_flags(tmp_path, monkeypatch):
    from sglang_dflash.bench import profile_step

    seen = []
    figures = {"trace_span_us_per_step": 1, "gpu_kernel_us_per_step": 1, "kernel_launches_per_step": 1}

    def fake_profile(spec, args, out, on_level):
        seen.append((spec, args))
        levels = {}
        for conc in args.concurrency:  # one server, every level; the file is written after each
            levels[f"c{conc}"] = figures
            on_level(levels)

    monkeypatch.setattr(profile_step, "profile_impl", fake_profile)
    assert profile_step.main(["--rig", "random", "--rig-dir", str(tmp_path), "--impls", "ar,plugin@8",
                              "--concurrency", "1,8", "--output-dir", str(tmp_path / "out")]) == 0
    (spec, args), (plugin, _) = seen
    assert (plugin.impl, plugin.block_size, plugin.label) == ("plugin", 8, "plugin-b8")  # as the sweep names it
    assert plugin.command(30000)[-len(plugin.extra_args) - 2:-len(plugin.extra_args)] == [
        "--speculative-num-draft-tokens", "8"]
    assert spec.model_path.endswith("qwen3-8b/target") and spec.draft_model_path.endswith("qwen3-8b/draft")
    assert spec.extra_args[-3:] == ["--skip-tokenizer-init", "--load-format", "dummy"]
    written = json.load(open(tmp_path / "out" / "profile_step.json"))
    assert set(written["ar"]) == set(written["plugin@8"]) == {"c1", "c8"}
    with pytest.raises(SystemExit):
        profile_step.main(["--output-dir", str(tmp_path / "out"), "--rig", "zero", "--concurrency", "1,x"])
    with pytest.raises(SystemExit):
        profile_step.main(["--output-dir", str(tmp_path / "out")])  # no model and no rig


def test_light_too_traces_each_level_both_ways_on_one_server(tmp_path, monkeypatch):
    from sglang_dflash.bench import profile_step

    servers, traced = [], []

    class OneServer:
        def __init__(self, spec, **kwargs):
            servers.append(spec)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_level(server, spec, conc, args, light):
        traced.append((conc, light))
        return {"gpu_span_us_per_step": 1} if light else {"trace_span_us_per_step": 1}

    monkeypatch.setattr(profile_step, "Server", OneServer)
    monkeypatch.setattr(profile_step, "profile_level", fake_level)
    assert profile_step.main(["--rig", "zero", "--rig-dir", str(tmp_path), "--impls", "plugin", "--light-too",
                              "--concurrency", "1,32", "--output-dir", str(tmp_path / "out")]) == 0
    assert len(servers) == 1 and traced == [(1, True), (1, False), (32, True), (32, False)]
    written = json.load(open(tmp_path / "out" / "profile_step.json"))["plugin"]
    assert list(written) == ["c1-light", "c1", "c32-light", "c32"]
    assert written["c1-light"] == {"gpu_span_us_per_step": 1} and written["c32"] == {"trace_span_us_per_step": 1}


def test_a_rig_sweep_is_rebuilt_from_its_results_with_plugin_over_builtin(tmp_path, monkeypatch):
    """--from-results brings back the rig settings, and the summary gets the paired-wave ratio."""
    def row(label, conc, step_ms, waves):
        return {"impl": label, "label": label, "dataset": "rig-zero", "concurrency": conc, "requests": 8, "errors": 0,
                "output_tok_s": sum(waves) / len(waves), "accept_length": None if label == "ar" else 16.0,
                "step_p50_ms": step_ms, "wave_tok_s": waves, "ttft_p50_ms": 60.0, "ttft_p99_ms": 80.0,
                "tpot_p50_ms": step_ms / 16, "tpot_p99_ms": step_ms / 16}

    settings = {"rig": "zero", "rig_shape": "qwen3-8b", "rig_prompt_len": 128, "block_sizes": [None],
                "server_args": "--attention-backend fa3", "attention_backend": None, "max_new_tokens": 256,
                "model_path": "t", "draft_model_path": "d", "temperature": 0.0, "thinking": False, "num_prompts": 8}
    rows = [row("ar", 1, 6.7, [145.0] * 4), row("plugin", 1, 8.3, [1300.0, 1200, 1250, 1300]),
            row("builtin", 1, 8.4, [1200.0, 1200, 1200, 1250])]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"settings": settings, "rows": rows, "server_failures": []}))
    monkeypatch.setattr(sweep, "installed_sglang", lambda: "0.5.23")
    summary = tmp_path / "summary.json"
    assert sweep.main(["--from-results", str(results), "--output-dir", str(tmp_path / "out"),
                       "--summary", str(summary)]) == 0
    recorded = json.loads(summary.read_text())
    assert set(recorded) == {"scale"}  # the headline benchmark is left as it was
    scale = recorded["scale"]
    entry = scale["0.5.23/fa3"]
    assert entry["ar_step_ms"] == {"c1": 6.7} and entry["step_over_ar"]["builtin"] == {"c1": 1.254}
    assert entry["plugin_over_builtin"]["c1"] == pytest.approx((1300 / 1200 * 1 * 1250 / 1200 * 1300 / 1250) ** 0.25,
                                                               abs=1e-3)
    lo, hi = entry["interval"]["c1"]
    assert lo <= entry["plugin_over_builtin"]["c1"] <= hi
    assert scale["step_ratio_c1"] == 1.239 and entry["evidence"].endswith("report.md")
