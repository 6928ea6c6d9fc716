"""The lab's reference-server shim: SGLang's penalizers in one order, whatever the process."""

import importlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = os.path.join(ROOT, "lab", "ordered-penalizers")


def load_lab(name: str):
    """A lab module, imported as the package it is (``python -m pytest`` runs from the checkout's root)."""
    return importlib.import_module(f"lab.{name}")

PROBE = """
import sys
from types import SimpleNamespace
from sglang.srt.sampling import penaltylib as p
from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
class Batch:
    device, reqs = "cpu", []
classes = {p.BatchedRepetitionPenalizer, p.BatchedPresencePenalizer, p.BatchedMinNewTokensPenalizer,
           p.BatchedFrequencyPenalizer}
print(",".join(c.__name__ for c in BatchedPenalizerOrchestrator(8, Batch(), classes).penalizers))
print("next sitecustomize ran:", "next_ran" in sys.modules)
"""


def run_probe(tmp_path, with_shim: bool) -> list[str]:
    nxt = tmp_path / "next"
    nxt.mkdir(exist_ok=True)
    (nxt / "sitecustomize.py").write_text("import sys, types\nsys.modules['next_ran'] = types.ModuleType('next_ran')\n")
    path = [SHIM] if with_shim else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(nxt), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Error in sitecustomize" not in out.stderr, out.stderr
    return out.stdout.split("\n")


def test_the_reference_server_applies_repetition_after_the_additive_penalties(tmp_path):
    order, chained, _ = run_probe(tmp_path, with_shim=True)
    assert order == ("BatchedFrequencyPenalizer,BatchedPresencePenalizer,BatchedMinNewTokensPenalizer,"
                     "BatchedRepetitionPenalizer")
    assert chained == "next sitecustomize ran: True"  # the kit's own shim still loads behind it
    order, chained, _ = run_probe(tmp_path, with_shim=False)
    assert set(order.split(",")) == {"BatchedFrequencyPenalizer", "BatchedPresencePenalizer",
                                     "BatchedMinNewTokensPenalizer", "BatchedRepetitionPenalizer"}
    assert chained == "next sitecustomize ran: True"


def load_matrix():
    return load_lab("request_params_matrix")


def test_the_matrix_measures_every_row_before_the_ones_that_crash_servers():
    m = load_matrix()
    order = m.row_order(list(m.rows([[1, 2, 3]], 8, True, {0: "ab"})))
    assert order[-3:] == ["sampled", "n", "token_ids_logprob"]
    assert {"plain", "penalties_together", "stop", "stream", "return_logprob", "json_schema", "regex"} <= set(order)


def test_the_matrix_sampled_row_compares_each_position_not_only_whole_sequences():
    from collections import Counter
    m = load_matrix()
    a = Counter({(1, 2, 3, 4): 1, (1, 2, 3, 5): 1, (1, 2, 3, 6): 1, (1, 2, 3, 7): 1})
    b = Counter({(1, 2, 3, 8): 1, (1, 2, 3, 9): 1, (1, 2, 3, 10): 1, (1, 2, 3, 11): 1})
    assert m.total_variation(a, b) == 1.0  # disjoint sequences
    assert m.marginal_tv(a, b) == 1.0  # ... told apart by their last position alone
    assert m.marginal_tv(a, Counter({(1, 2, 3, 4): 2, (1, 2, 3, 5): 2})) == 0.5
    assert m.total_variation(a, Counter()) == 1.0  # a crashed server's empty sample


def test_the_matrix_does_not_count_a_row_the_reference_failed():
    m = load_matrix()
    ok = [{"output_ids": [1, 2], "meta_info": {"finish_reason": "length"}}]
    summary = m.compare({"ar-sync": [[{"error": "boom"}], ok], "plugin": [ok, ok]})
    assert summary["reference_errors"] == 1 and summary["plugin"]["mismatches"] == 1


def load_lossless_pair():
    return load_lab("lossless_pair")


class CharTokenizer:
    """One token per character; a chat template of two marker strings around the user's text."""

    class Ids:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=True):
        return self.Ids([ord(c) for c in text])

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<user>" + messages[0]["content"] + "</user><bot>"


def test_the_smollm2_workload_keeps_each_questions_ask_and_gives_every_prompt_one_length():
    lp = load_lossless_pair()
    questions = ["short", "x" * 20 + "ASK", "y" * 30 + "ASK", "z" * 7]
    greedy, stops = lp.smollm2_workload(2, 32, CharTokenizer(), questions, keep=8)
    texts = ["".join(map(chr, g["input_ids"])) for g in greedy]
    assert texts == ["<user>xxxxxASK</user><bot>", "<user>yyyyyASK</user><bot>"]
    assert [s["sampling_params"].get("stop_token_ids") for s in stops] == [None, [ord("\n")]]
    assert [s["sampling_params"]["max_new_tokens"] for s in stops] == [5, 6]
    with pytest.raises(SystemExit):
        lp.smollm2_workload(3, 32, CharTokenizer(), questions, keep=8)


def test_the_lossless_pair_keeps_sglangs_prefill_graphs_when_asked():
    lp = load_lossless_pair()
    assert "--disable-prefill-cuda-graph" in lp.server_flags()
    on, capped = lp.server_flags("on"), lp.server_flags("4096")
    assert "--disable-prefill-cuda-graph" not in on + capped and "--cuda-graph-max-bs-prefill" not in on
    assert capped[-2:] == ["--cuda-graph-max-bs-prefill", "4096"] and "--dtype" in capped
    with pytest.raises(ValueError, match="--prefill-graphs 'all'"):
        lp.server_flags("all")


def test_the_lossless_pair_runs_on_another_backend_and_dtype_as_asked():
    lp = load_lossless_pair()
    flags = lp.server_flags("off", "flashinfer", "bfloat16")
    assert flags[flags.index("--attention-backend") + 1] == "flashinfer"
    assert flags[flags.index("--dtype") + 1] == "bfloat16" and flags.count("--dtype") == 1
    assert lp.server_flags()[lp.server_flags().index("--dtype") + 1] == "float32"
    assert lp.server_env("float32")["TRITON_F32_DEFAULT"] == "ieee" and lp.server_env("bfloat16") == {}
    assert lp.switch("SGLANG_DFLASH_SKIP_HOST_LENGTHS=0") == {"SGLANG_DFLASH_SKIP_HOST_LENGTHS": "0"}
    for bad in ("NOVALUE", "=0"):
        with pytest.raises(Exception, match="NAME=VALUE"):
            lp.switch(bad)


def test_a_half_precision_run_is_checked_by_the_same_kernels_a_b_only(monkeypatch, capsys):
    lp = load_lossless_pair()
    for argv, why in ((["out", "--dtype", "bfloat16"], "near-ties"), (["out", "--ab-only"], "needs --context-ab"),
                      (["out", "--context-ab", "4", "--ab-only", "--plain-too", "--widths", "auto"], "drop --plain-too"),
                      (["out", "--in-flight", "0"], "--in-flight must be 1 or more")):
        monkeypatch.setattr(sys, "argv", ["lossless_pair.py"] + argv)
        with pytest.raises(SystemExit):
            lp.main()
        assert why in capsys.readouterr().err


def test_the_a_b_needs_the_same_tokens_and_verify_steps_from_both_servers():
    from types import SimpleNamespace as R
    lp = load_lossless_pair()

    def ok(ids, steps, error=None):
        return R(output_ids=ids, spec_verify_ct=steps, error=error)

    same = lp.same_requests([ok([1, 2], 2), ok([3], 1)], [ok([1, 2], 2), ok([3], 1)])
    assert lp.ab_clean(same) and same["verify_steps"] == {"plugin": 3, "plugin-switched": 3}
    tokens = lp.same_requests([ok([1, 2], 2)], [ok([1, 9], 2)])
    assert not lp.ab_clean(tokens) and tokens["requests_with_other_tokens"] == 1
    steps = lp.same_requests([ok([1, 2], 2)], [ok([1, 2], 1)])
    assert not lp.ab_clean(steps) and steps["first"] == [0]
    assert not lp.ab_clean(lp.same_requests([ok([], 0, "boom")], [ok([], 0, "boom")]))
    assert not lp.ab_clean(lp.same_requests([], []))


def test_the_lossless_comparison_counts_greedy_and_stop_mismatches_apart():
    from types import SimpleNamespace as R
    lp = load_lossless_pair()

    def ok(ids, finish="length"):
        return R(output_ids=ids, meta={"finish_reason": finish}, error=None, completion_tokens=len(ids), spec_verify_ct=1)

    ar = ([ok([1, 2, 3]), ok([4, 5])], [ok([7], "stop")], {})
    plugin = ([ok([1, 2, 9]), ok([4, 5])], [ok([7], "length")], {"num_used_tokens": 0})
    out = lp.compare(ar, plugin)
    assert out["greedy_mismatches"] == 1 and out["first_divergences"] == [(0, 2)]
    assert out["stop_mismatches"] == 1 and out["errors"] == 0 and out["accept_length"] == 2.5


def test_the_pooled_ratio_plot_reads_each_level_with_its_interval(tmp_path):
    plot = load_lab("plot_pooled")
    pooled = tmp_path / "pooled_waves.json"
    pooled.write_text(json.dumps({"pooled": {  # written by sglang_dflash.bench.pool; c16 before c4 there
        "c16": {"geomean": 0.95, "ci95": [0.9, 1.1]}, "c4": {"geomean": 1.0, "ci95": [0.8, 1.05]}}}))
    conc, mean, low, high = plot.points(str(pooled))
    assert conc == [4, 16] and mean == [1.0, 0.95]
    assert low == pytest.approx([0.2, 0.05]) and high == pytest.approx([0.05, 0.15])
    out = tmp_path / "ratios.png"
    subprocess.run([sys.executable, os.path.join(ROOT, "lab", "plot_pooled.py"), str(out), "--line", "0.98",
                    "--panel", "set", f"a / b={pooled}"], check=True)
    assert out.stat().st_size > 1000




def sweep_row(impl, dataset, conc, waves, steps, asleep, used16, fallback, host_calls):
    """A sweep's row whose server counters are running totals, as /get_server_info reports them."""
    totals = [{"calls": 100 * (i + 1), "call_ms": 150.0 * (i + 1), "gap_ms": 100.0 * (i + 1),
               "policy_ms": (2.0 if impl == "adaptive" else 0.3) * (i + 1)} for i in range(host_calls)]
    return {"impl": impl, "label": impl, "dataset": dataset, "concurrency": conc, "output_tok_s": 100.0,
            "accept_length": 3.0, "wave_tok_s": waves, "wave_host_pauses": [{"decode_host": t} for t in totals],
            "server_after": {"dflash": {"decode_steps": steps, "widths_used": {"16": used16, "8": steps - used16},
                                        "choices": {"16@4": {"asleep": asleep, "best": 3}}, "fallback": {"requests": fallback}}}}


def test_adaptive_levels_counts_each_level_from_its_own_steps():
    m = load_lab("adaptive_levels")
    rows = [sweep_row("adaptive", "gsm8k", 4, [110, 99, 121, 90], 1000, 900, 990, 5, 4),
            sweep_row("plugin-fixed", "gsm8k", 4, [100, 110, 110, 100], 800, 0, 800, 0, 4),
            sweep_row("adaptive", "gsm8k", 8, [100, 100], 3000, 1000, 2980, 12, 3),
            sweep_row("plugin-fixed", "gsm8k", 8, [100, 100], 2500, 0, 2500, 0, 3)]
    levels = m.run_levels(rows)
    c4, c8 = levels["gsm8k c4"], levels["gsm8k c8"]
    assert c4["adaptive"]["asleep_share"] == 0.9 and c4["adaptive"]["widths_used"] == {"16": 990, "8": 10}
    # c8 ran after c4 on the same servers: its counts are the totals less c4's
    assert c8["adaptive"]["asleep_share"] == 0.05 and c8["adaptive"]["widths_used"] == {"16": 1990, "8": 10}
    assert c8["adaptive"]["fallback_requests"] == 7
    assert c4["adaptive"]["policy_us_per_step"] == 20.0 and c4["plugin-fixed"]["call_plus_gap_us_per_step_median_of_waves"] == 2500.0
    assert c4["policy_share_of_fixed_16_host_time"] == 0.008 and c4["host_time_a_step_over_fixed_16"] == 1.0
    assert c4["over_fixed_16"]["waves"] == 4 and abs(c4["over_fixed_16"]["geomean"] - (1.1 * 0.9 * 1.1 * 0.9) ** 0.25) < 1e-4
    pooled = m.pooled([rows, rows])
    assert pooled["c4"]["waves"] == 8 and pooled["c4"]["gsm8k"]["waves"] == 8


def test_adaptive_levels_reads_the_default_against_plain_decoding():
    m = load_lab("adaptive_levels")
    ar = sweep_row("ar", "rig-random", 8, [100, 100], 0, 0, 0, 0, 0)
    ar["server_after"] = {}
    default = sweep_row("plugin", "rig-random", 8, [97, 95], 400, 0, 10, 8, 2)
    levels = m.run_levels([default, ar], "plugin", "ar")["rig-random c8"]
    assert levels["over_ar"]["waves"] == 2 and abs(levels["over_ar"]["geomean"] - (0.97 * 0.95) ** 0.5) < 1e-4
    assert levels["plugin"]["widths_used"] == {"16": 10, "8": 390} and levels["plugin"]["fallback_requests"] == 8
    assert "over_fixed_16" not in levels and m.pooled([[default, ar]], "plugin", "ar")["c8"]["waves"] == 2


def test_adaptive_levels_tells_servers_of_one_implementation_apart_by_label():
    m = load_lab("adaptive_levels")
    fixed_8 = sweep_row("plugin-fixed", "gsm8k", 4, [50, 50], 5000, 0, 0, 0, 2)
    fixed_8["label"], fixed_8["output_tok_s"] = "plugin-fixed-b8", 70.0  # a six-server sweep's plugin-fixed@8
    rows = [sweep_row("adaptive", "gsm8k", 4, [100, 100], 900, 800, 900, 0, 2),
            sweep_row("plugin-fixed", "gsm8k", 4, [100, 100], 800, 0, 800, 0, 2), fixed_8]
    c4 = m.run_levels(rows)["gsm8k c4"]
    assert c4["plugin-fixed"]["tok_s"] == 100.0 and c4["over_fixed_16"]["geomean"] == 1.0
    assert set(c4) == {"adaptive", "plugin-fixed", "over_fixed_16", "host_time_a_step_over_fixed_16",
                       "policy_share_of_fixed_16_host_time"}


def test_adaptive_levels_skips_a_server_that_reported_nothing():
    m = load_lab("adaptive_levels")
    failed = sweep_row("adaptive", "gsm8k", 4, [], 0, 0, 0, 0, 0)
    failed["server_after"] = None
    levels = m.run_levels([failed, sweep_row("plugin-fixed", "gsm8k", 4, [100, 110], 800, 0, 800, 0, 2)])
    assert "adaptive" not in levels["gsm8k c4"] and "over_fixed_16" not in levels["gsm8k c4"]


def test_plot_goals_divides_each_server_by_plain_decoding_at_its_own_level():
    m = load_lab("plot_goals")
    from sglang_dflash.bench.stats import add_speedups

    rows = [{"impl": lab, "label": lab, "dataset": "gsm8k", "concurrency": c, "output_tok_s": tok}
            for lab, c, tok in [("adaptive", 8, 300.0), ("ar", 1, 100.0), ("adaptive", 1, 220.0), ("ar", 8, 200.0),
                                ("builtin", 8, 0.0), ("adaptive", 4, 150.0)]]
    add_speedups(rows)  # as the sweep does before it writes results.json
    assert m.over_ar(rows) == {"gsm8k": {"adaptive": [(1, 2.2), (8, 1.5)], "ar": [(1, 1.0), (8, 1.0)]}}
    doc = {"pooled": {"levels": {"c16": {"geomean": 0.97, "ci95": [0.96, 0.98], "waves": 6},
                                 "c2": {"geomean": 0.99, "ci95": [0.98, 1.0], "waves": 8}}}}
    assert m.pooled_points(doc) == [(2, 0.99, 0.98, 1.0, 8), (16, 0.97, 0.96, 0.98, 6)]


def test_plot_goals_holds_mt_bench_to_plain_decoding_beside_the_rigs(tmp_path):
    m = load_lab("plot_goals")
    level = {"pooled": {"levels": {"c4": {"geomean": 1.1, "ci95": [1.05, 1.15], "waves": 9}}}}
    path = tmp_path / "levels.json"
    path.write_text(json.dumps(level))
    series = m.paired_series(str(path), None, str(path))
    assert [(goal, what.split(":")[0]) for _, goal, what in series] == [(0.98, "rig, zero weights"),
                                                                       (1.0, "SmolLM2 mt-bench")]
    assert series[1][0] == [(4, 1.1, 1.05, 1.15, 9)]


def test_the_card_commands_run_each_cards_flags_as_printed_on_its_targets_rig(monkeypatch, tmp_path):
    """lab/card_commands.py (issue 78, item 5): the flags after the model paths are the card's, the
    renamed ones kept as printed so the plugin's mapping is what is tried; the rig's zero weights."""
    cards = load_lab("card_commands")
    from sglang_dflash.bench import rig
    from sglang_dflash.card_flags import CARD_COMMANDS, HOPPER_COMMANDS
    from sglang_dflash.config import BLACKWELL_ONLY_BACKENDS

    written = []
    monkeypatch.setattr(rig, "write_rig", lambda out, shape: written.append(shape) or (f"{out}/t", f"{out}/d"))
    assert {shape for shape, _ in cards.RUNS.values()} == {"qwen3.5-4b", "qwen3.5-27b", "qwen3.6-35b-a3b"}
    assert not set(HOPPER_COMMANDS["4b"]) & set(BLACKWELL_ONLY_BACKENDS)
    assert set(CARD_COMMANDS["4b"]) & set(BLACKWELL_ONLY_BACKENDS)  # the B200 line: refused at start on Hopper
    for name, (shape, flags) in cards.RUNS.items():
        cmd = cards.card_spec(name, str(tmp_path)).command(30000)
        assert cmd[cmd.index("--model-path") + 1] == f"{tmp_path}/{shape}/t"
        assert cmd[cmd.index("--speculative-draft-model-path") + 1] == f"{tmp_path}/{shape}/d"
        tail = cmd[-len(flags) - 1:]
        assert tail == list(flags) + ["--skip-tokenizer-init"], tail
        assert "--mamba-scheduler-strategy" in cmd or name == "4b-hopper"
    assert written == [shape for shape, _ in cards.RUNS.values()]


def test_the_long_context_run_gives_every_server_the_window_and_only_the_ring_its_switch():
    lc = load_lab("long_context")
    args = SimpleNamespace(backend="fa3", window=4096, prompt_tokens=32768, max_new_tokens=256, levels=[1, 4],
                           mem_fraction=0.8, shape="qwen3.5-4b")
    for name, ring in (("plugin", None), ("plugin-ring", "1"), ("builtin", None)):
        spec = lc.server_spec(name, "/t", "/d", args)
        cmd = spec.command(30000)
        assert cmd[cmd.index("--speculative-draft-window-size") + 1] == "4096"
        assert int(cmd[cmd.index("--context-length") + 1]) > 32768 + 256
        assert spec.env().get("SGLANG_DFLASH_DRAFT_RING") == ring
        assert spec.env().get("SGLANG_DFLASH_IMPL") == ("builtin" if name == "builtin" else "plugin")
    batch = lc.prompts(4, 100, 248320, seed=1)
    assert len({tuple(p) for p in batch}) == 4 and all(len(p) == 100 for p in batch)


def test_the_long_context_run_reads_the_plugins_step_counts_and_nothing_from_the_builtin(monkeypatch):
    """Per level, what tells a per-step decode cost from a per-request one: the plugin's decode
    steps, eager drafts and verifies and host time by part; the built-in has none of them."""
    lc = load_lab("long_context")
    host = {"calls": 5, "call_ms": 9.0, "gap_ms": 4.0, "policy_ms": 0.1, "phases_ms": {"draft": 2.0}}
    plugin = {"dflash": {"decode_steps": 5, "eager_drafts": 1, "eager_verifies": {"16": 2}, "prefills": 3,
                         "widths_used": {"16": 5}, "stalls": {"decode_host": host, "recent": [1, 2]}, "block_size": 16}}
    monkeypatch.setattr(lc, "server_info", lambda url: plugin if url == "p" else {"internal_states": []})
    assert lc.step_counts("p") == {"decode_steps": 5, "eager_drafts": 1, "eager_verifies": {"16": 2}, "prefills": 3,
                                   "widths_used": {"16": 5}, "decode_host": host}
    assert lc.step_counts("b") == {}


def test_the_tiny_moe_target_keeps_expert_zero_and_pulls_the_others_toward_it(tmp_path):
    import importlib.util

    import torch
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("make_tiny_pair", os.path.join(ROOT, "scripts", "make_tiny_pair.py"))
    make_tiny_pair = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_pair)
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.randn(4, 4, generator=g) for e in range(3)}
    state["model.layers.0.mlp.shared_expert.down_proj.weight"] = torch.randn(4, 4, generator=g)
    save_file(state, tmp_path / "model.safetensors")
    make_tiny_pair.pull_experts_together(str(tmp_path), 0.1)
    after = load_file(tmp_path / "model.safetensors")
    base = state["model.layers.0.mlp.experts.0.down_proj.weight"]
    torch.testing.assert_close(after["model.layers.0.mlp.experts.0.down_proj.weight"], base)
    torch.testing.assert_close(after["model.layers.0.mlp.shared_expert.down_proj.weight"],
                               state["model.layers.0.mlp.shared_expert.down_proj.weight"])
    for e in (1, 2):
        own = state[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        torch.testing.assert_close(after[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], base + 0.1 * (own - base))


def test_wave_tails_sets_the_slowest_requests_steps_beside_the_ratio(tmp_path, capsys, monkeypatch):
    wave_tails = load_lab("wave_tails")
    # One wave of 2 a server: plain decoding 256 steps a request (255 after the first token); the
    # speculative server's requests 50 and 100 steps, its wave at 1.5x plain decoding's tok/s.
    # The policy's step_ms after the level: bucket 2's full width and width 1, bucket 4's left out.
    info = {"dflash": {"step_ms": {"16@2": 3.4, "1@2": 2.6, "16@4": 9.9, "1@1": 9.9}}}
    spec = {"label": "adaptive", "dataset": "mix", "concurrency": 2, "wave_tok_s": [150.0], "step_p50_ms": 3.6,
            "accept_length": 3.4, "per_request": [[256, 50], [256, 100]], "server_after": info}
    plain = {"label": "ar", "dataset": "mix", "concurrency": 2, "wave_tok_s": [100.0], "step_p50_ms": 2.0,
             "accept_length": None, "per_request": [[256, 0], [256, 0]]}
    reading = wave_tails.level_reading(spec, plain)
    assert reading["ratio"] == 1.5 and reading["steps_ratio_slowest"] == 2.55 and reading["steps_ratio_mean"] == 3.4
    assert reading["step_cost_a_over_b"] == 1.7  # 2.55 fewer steps for the wave, 1.5x its speed
    assert reading["step_cost_measured"] == 1.8 and reading["policy_step_ms"] == {"full": 3.4, "1": 2.6}
    assert wave_tails.level_reading({**spec, "server_after": None, "step_p50_ms": None}, plain)["policy_step_ms"] == {}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": [spec, plain]}))
    monkeypatch.setattr(sys, "argv", ["wave_tails", str(path)])
    wave_tails.main()
    assert "| mix | 2 | 1 | 1.500 | 2.55 | 3.40 | 1.70 | 1.80 | 3.40, 2.60 | 3.40 |" in capsys.readouterr().out


def test_the_compile_cache_comes_back_in_one_file_beside_the_runs_logs_and_unpacks_on_the_next_machine(tmp_path):
    cache, out = tmp_path / "triton", tmp_path / "out"
    for kernel in ("AAA", "BBB"):
        (cache / kernel).mkdir(parents=True)
        (cache / kernel / "k.cubin").write_bytes(os.urandom(256))
    (out / "run").mkdir(parents=True)
    for name in ("server-a.log", "server-b.log", "results.json"):
        (out / "run" / name).write_text(name)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    save = subprocess.run(["bash", os.path.join(ROOT, "lab", "compile-cache.sh"), "save", str(out)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert save.returncode == 0 and "2 kernels" in save.stdout, save.stdout + save.stderr
    # The logs share one archive so that the run's files and the cache fit the 8 files that come back.
    assert sorted(p.name for p in (out / "run").iterdir()) == ["results.json"]
    assert sorted(p.name for p in out.iterdir()) == ["compile-cache.tar.xz", "run", "server-logs.tgz"]
    # The next machine: a checkout carrying .compile-cache/ gets the kernels where Triton looks.
    checkout = tmp_path / "checkout"
    (checkout / ".compile-cache").mkdir(parents=True)
    os.replace(out / "compile-cache.tar.xz", checkout / ".compile-cache" / "compile-cache.tar.xz")
    with open(os.path.join(ROOT, "lab", "gpu-env.sh")) as f:
        text = f.read()
    restore = text[text.index("export TRITON_CACHE_DIR"):text.index("# kit-shim/")]
    fresh = tmp_path / "fresh"
    run = subprocess.run(["bash", "-c", f"_kroot={checkout}\n{restore}"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "TRITON_CACHE_DIR": str(fresh)})
    assert "2 Triton kernels unpacked" in run.stdout, run.stdout + run.stderr
    assert (fresh / "AAA" / "k.cubin").read_bytes() == (cache / "AAA" / "k.cubin").read_bytes()
    # An empty cache saves nothing and says so.
    empty = subprocess.run(["bash", os.path.join(ROOT, "lab", "compile-cache.sh"), "save", str(out)],
                           env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "none")},
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 0 and "nothing saved" in empty.stdout


def test_the_heldout_report_pools_each_set_and_level_and_names_every_missed_goal(tmp_path):
    def rows(scale):  # three servers taking turns at two levels of two sets; a second run scales them
        out = []
        for dataset, over_ar in (("heldout-writing", {1: 1.30, 64: 0.90}), ("heldout-code", {1: 1.50, 64: 1.10})):
            for conc, ratio in over_ar.items():
                ar = [scale * (100.0 + k % 3) for k in range(12)]
                for label, waves in (("ar", ar), ("adaptive", [ratio * x for x in ar]),
                                     ("builtin", [ratio * x / 1.02 for x in ar])):
                    out.append({"label": label, "dataset": dataset, "concurrency": conc, "wave_tok_s": waves,
                                "output_tokens": 3000, "spec_verify_ct": 1000 if label != "ar" else 0})
        return out

    paths = []
    for k, scale in enumerate((1.0, 2.0)):
        (tmp_path / f"run{k}").mkdir()
        paths.append(tmp_path / f"run{k}" / "results.json")
        paths[-1].write_text(json.dumps({"rows": rows(scale)}))
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, "-m", "lab.heldout_report", str(out), *map(str, paths),
                          "--setup", "SmolLM2, 0.5.23, H200, fa3"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert run.returncode == 1, run.stderr  # writing at c64 sits under plain decoding
    assert "goals missed at heldout-writing c64" in run.stderr and "heldout-code" not in run.stderr
    report = json.loads((out / "heldout.json").read_text())
    assert report["levels"] == ["c1", "c64"]
    writing = report["default_over_ar"]["heldout-writing"]
    assert writing["c1"]["geomean"] == pytest.approx(1.30, abs=1e-3) and writing["c1"]["waves"] == 24  # both runs
    assert report["default_over_builtin"]["heldout-code"]["c64"]["geomean"] == pytest.approx(1.02, abs=1e-3)
    assert report["goals"]["heldout-writing"]["c64"] == {"over_ar": False, "over_builtin": True}
    assert report["accept_length"]["heldout-code"]["c1"] == 3.0
    assert "| c64 | 0.900 (0.900-0.900), 24 waves | **no** |" in (out / "heldout.md").read_text()
    assert (out / "heldout.png").stat().st_size > 1000
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    refused = subprocess.run([sys.executable, "-m", "lab.heldout_report", str(out), str(bad)],
                             capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1


def test_the_summary_is_in_its_layout_and_the_check_catches_a_hand_edit(tmp_path):
    layout = load_lab("summary_json")
    committed = os.path.join(ROOT, "results", "summary.json")
    assert layout.main(["--check", committed]) == 0, "python -m lab.summary_json results/summary.json"
    edited = tmp_path / "summary.json"
    edited.write_text(json.dumps({"a": {"c1": 1.0, "c8": [1.0, 2.0]}}, indent=1) + "\n")
    assert layout.main(["--check", str(edited)]) == 1
    assert layout.main([str(edited)]) == 0
    assert edited.read_text() == '{\n "a": {"c1": 1.0, "c8": [1.0, 2.0]}\n}\n'
    long = {"notes": ["x" * 70, "y" * 70], "deep": {"a": {"b": {"c": 1}}}}
    laid_out = layout.dumps(long)
    assert json.loads(laid_out) == long
    assert '\n  "x' in laid_out and '"deep": {\n  "a": {"b": {"c": 1}}\n }' in laid_out
