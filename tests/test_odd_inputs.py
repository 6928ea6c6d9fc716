"""The odd-request suite, the OpenAI-client comparison and the mixed-parameter load, without a GPU."""

import json
import math
import os
import random

import pytest

from sglang_dflash.bench import odd_inputs, openai_client, stress
from sglang_dflash.bench.odd_inputs import OddCase

CASES = odd_inputs.odd_cases(vocab=49152, context=4096, special_ids=[0, 1, 2], special_text="<|a|><|b|>")


def test_the_suite_asks_everything_the_issue_lists():
    wanted = ["empty text", "whitespace-only text", "only special tokens (text)", "only special tokens (ids)",
              "token id past the vocabulary", "negative token id", "prompt past the context", "max_new_tokens 0",
              "max_new_tokens far past the context", "min_new_tokens above max_new_tokens", "negative temperature",
              "NaN temperature", "top_p 0", "top_p above 1", "top_k 0", "penalties at 0", "huge penalties", "n 0",
              "empty stop string", "invalid regex", "invalid JSON schema", "logit_bias with unknown ids",
              "logprob_start_len past the prompt", "huge top_logprobs_num", "unknown ids in token_ids_logprob",
              "body not JSON", "empty prompt on /v1/completions"]
    assert not set(wanted) - set(CASES)
    assert CASES["empty text"].body["text"] == ""
    assert CASES["token id past the vocabulary"].body["input_ids"][-1] >= 49152
    assert len(CASES["prompt past the context"].body["input_ids"]) > 4096
    assert "NaN" in CASES["NaN temperature"].body  # sent as written: JSON has no NaN
    with pytest.raises(ValueError):
        json.loads(CASES["body not JSON"].body)
    assert CASES["empty prompt on /v1/completions"].path == "/v1/completions"


@pytest.mark.parametrize("status, body, alive, expected", [
    (200, {"text": "x", "meta_info": {"completion_tokens": 0}}, True, "served"),
    (400, {"error": {"message": "The prompt is empty: it tokenized to 0 tokens"}}, True, "refused"),
    (400, {"error": {"message": ""}}, True, "error"),  # a refusal must say why
    (500, {"error": "Internal"}, True, "error"),
    (0, "ConnectionRefusedError", False, "crashed"),
    (200, {"text": "x"}, False, "crashed"),  # answered, then died
])
def test_each_answer_is_read_as_served_refused_error_or_crashed(status, body, alive, expected):
    assert odd_inputs.outcome(status, body, alive, OddCase({}))["outcome"] == expected


def test_a_served_answer_is_checked_for_sense():
    case = CASES["logit_bias on one id"]
    good = {"output_ids": [42] * 12, "meta_info": {"completion_tokens": 12}}
    bad = {"output_ids": [42, 7, 42], "meta_info": {"completion_tokens": 3}}
    assert "insane" not in odd_inputs.outcome(200, good, True, case)
    assert "not all 42" in odd_inputs.outcome(200, bad, True, case)["insane"]
    two = [{"text": "a", "meta_info": {}}, {"text": "b", "meta_info": {}}]
    assert "insane" not in odd_inputs.outcome(200, two, True, CASES["n 2"])
    assert "> 0" in odd_inputs.outcome(200, {"meta_info": {"completion_tokens": 3}}, True,
                                       CASES["max_new_tokens 0"])["insane"]
    tops = {"meta_info": {"completion_tokens": 2, "output_top_logprobs": [[1] * 5, [1] * 4]}}
    assert "asked 5" in odd_inputs.outcome(200, tops, True, CASES["top_logprobs_num 5"])["insane"]


def test_problems_name_what_the_plugin_did_wrong_and_nothing_else():
    served, refused = {"outcome": "served", "status": 200}, {"outcome": "refused", "status": 400, "message": "no"}
    crashed = {"outcome": "crashed", "status": 0, "cause": "RuntimeError: cannot reshape tensor of 0 elements"}
    results = {
        "a": {"ar": crashed, "plugin": refused},  # plain decoding crashes; the plugin refusing is right
        "b": {"ar": served, "plugin": refused},  # refusing what plain decoding serves is a bug
        "c": {"ar": refused, "plugin": crashed},
        "d": {"ar": served, "plugin": {**served, "insane": "3 outputs, asked for 2"}},
        "e": {"ar": refused, "plugin": refused},
    }
    found = odd_inputs.problems(results)
    assert [line.split(":")[0] for line in found] == ["b", "c", "d"]
    assert "reshape" in found[1]


class FakeServer:
    url = "http://fake"

    def __init__(self, log):
        self.log = log

    def log_tail(self, lines=40):
        return self.log


def test_a_crash_is_recorded_with_its_cause_and_the_server_restarted_only_for_a_request_to_come(monkeypatch):
    state = {"up": True, "restarts": 0}
    answers = {"n 0": (400, {"error": {"message": "n must be > 0"}})}

    def post(url, body, timeout=300):
        key = next(k for k, c in CASES.items() if c.body == body)
        if key in ("top_k 0", "empty text"):
            state["up"] = False
            return 0, "refused connection"
        return answers.get(key, (200, {"text": "ok", "meta_info": {"completion_tokens": 1}}))

    def restart():
        state["restarts"] += 1
        state["up"] = True

    monkeypatch.setattr(odd_inputs, "post", post)
    log = "INFO serving\nScheduler hit an exception: Traceback (most recent call last):\n" \
          "RuntimeError: cannot reshape tensor of 0 elements into shape [0, -1, 64]\nINFO killed\n"
    kept, seen = {}, []
    out = odd_inputs.run_cases(FakeServer(log), CASES, lambda url: state["up"], restart,
                               only=["empty text", "n 0", "top_k 0"], out=kept,
                               recorded=lambda: seen.append((len(kept), state["restarts"])))
    assert list(out) == ["top_k 0", "n 0", "empty text"]  # the requests that ended servers go last
    assert out is kept and state["restarts"] == 1  # none after the last request
    assert seen == [(1, 0), (2, 1), (3, 1)]  # each outcome kept before the restart that follows it
    assert out["top_k 0"]["outcome"] == out["empty text"]["outcome"] == "crashed"
    assert out["empty text"]["cause"].startswith("RuntimeError: cannot reshape tensor of 0 elements")
    assert out["n 0"]["outcome"] == "refused"


def test_a_restart_logs_to_a_file_of_its_own_under_the_start_lock_and_tries_once_more(tmp_path):
    import threading

    from sglang_dflash.bench.server import ServerError

    lock, events = threading.Lock(), []

    class Flaky:
        log_path = str(tmp_path / "server-ar.log")
        fail_next = True

        def stop(self, grace_s=10):
            events.append("stop")

        def start(self):
            events.append(("start", os.path.basename(self.log_path), lock.locked()))
            if self.fail_next:
                self.fail_next = False
                raise ServerError("Loaded weights leave no GPU memory for the KV cache")

    server = Flaky()
    restart = odd_inputs.Restarter(server, str(tmp_path / "server-ar"), lock)
    restart()
    restart()
    assert restart.restarts == 2 and not lock.locked()
    assert events == ["stop", ("start", "server-ar-1.log", True), "stop", ("start", "server-ar-1.log", True),
                      "stop", ("start", "server-ar-2.log", True)]


def test_the_command_keeps_each_outcome_as_it_comes_and_restarts_a_dead_server(tmp_path, monkeypatch, capsys):
    import sglang_dflash.bench.server as server_mod
    import sglang_dflash.bench.stress as stress_mod

    state = {"up": True, "starts": []}

    class FakeServer:
        def __init__(self, spec, log_path, timeout_s):
            self.spec, self.log_path, self.url = spec, log_path, f"http://{spec.impl}"

        def __enter__(self):
            self.start()
            return self

        def __exit__(self, *exc):
            self.stop()

        def start(self):
            state["starts"].append(os.path.basename(self.log_path))
            state["up"] = True

        def stop(self, grace_s=10):
            pass

        def log_tail(self, lines=40):
            return "RuntimeError: cannot reshape tensor of 0 elements\n"

    def post(url, body, timeout=300):
        if url.startswith("http://ar") and isinstance(body, dict) and body["sampling_params"].get("n") == 0:
            state["up"] = False
            return 0, "connection refused"
        return 200, {"text": "ok", "meta_info": {"completion_tokens": 1}}

    monkeypatch.setattr(odd_inputs, "tokenizer_facts", lambda path: (49152, [0, 1, 2], "<|a|>"))
    monkeypatch.setattr(odd_inputs, "post", post)
    monkeypatch.setattr(server_mod, "Server", FakeServer)
    monkeypatch.setattr(stress_mod, "alive", lambda url: state["up"])
    rc = odd_inputs.main(["--model-path", "m", "--draft-model-path", "d", "--impls", "ar,plugin",
                          "--cases", "empty text,n 0", "--output-dir", str(tmp_path)])
    report = json.loads((tmp_path / "odd.json").read_text())
    assert report["cases"]["n 0"]["ar"]["outcome"] == "crashed"
    assert report["cases"]["n 0"]["plugin"]["outcome"] == report["cases"]["empty text"]["ar"]["outcome"] == "served"
    assert report["starts"] == {"ar": 2, "plugin": 1}  # restarted for the request after the crash
    assert state["starts"] == ["server-ar.log", "server-ar-1.log", "server-plugin.log"]
    assert rc == 0 and "crashed" in capsys.readouterr().out


def test_the_openai_command_in_float32_warms_each_server_and_compares_exactly(tmp_path, monkeypatch, capsys):
    import sglang_dflash.bench.server as server_mod

    started, asked = [], []

    class FakeServer:
        def __init__(self, spec, log_path, timeout_s):
            self.spec, self.url = spec, f"http://{spec.impl}"

        def __enter__(self):
            started.append((self.spec.impl, self.spec.extra_args, self.spec.extra_env))
            return self

        def __exit__(self, *exc):
            pass

    record = {"logprobs": [{"token": "a", "logprob": -0.1, "top": []}]}
    monkeypatch.setattr(server_mod, "Server", FakeServer)
    monkeypatch.setattr(openai_client, "collect", lambda url: asked.append(url) or record)
    monkeypatch.setattr(openai_client, "compare", lambda ref, got, logprob_tol: {"tol": "same" if logprob_tol == 1e-3 else "differs"})
    monkeypatch.setattr(openai_client, "self_checks", lambda rec: {"stream joins": "same"})
    rc = openai_client.main(["--model-path", "m", "--draft-model-path", "d", "--float32", "--output-dir", str(tmp_path)])
    assert rc == 0 and asked == ["http://ar"] * 2 + ["http://plugin"] * 2  # a warm-up round, then the recorded one
    assert all("float32" in flags and env["TRITON_F32_DEFAULT"] == "ieee" for _, flags, env in started)
    assert json.loads((tmp_path / "openai.json").read_text())["compare"] == {"tol": "same"}


def test_error_messages_are_read_from_every_shape_sglang_answers_with():
    assert odd_inputs.error_message({"error": {"message": "bad"}}) == "bad"
    assert odd_inputs.error_message({"error": "bad"}) == "bad"
    assert odd_inputs.error_message({"detail": "bad"}) == "bad"
    assert odd_inputs.error_message("plain text") == "plain text"


def record(chat="The sky is blue because of Rayleigh scattering of light.", **over):
    rec = {"chat": [chat, "b"], "chat_stream": [chat, "b"], "chat_usage": [{"prompt_tokens": 5, "completion_tokens": 9}] * 2,
           "chat_stream_usage": [{"prompt_tokens": 5, "completion_tokens": 9}] * 2,
           "stops": {s: chat[: chat.find(s)] for s in openai_client.stop_strings(chat)},
           "logprobs": [{"token": "a", "logprob": -0.5, "top": ["a", "b"]}], "n2": ["x", "x"],
           "card": "long ago", "card_stream": "long ago", "card_sampled": {"completion_tokens": 5, "finish_reason": "length"}}
    rec.update(over)
    return rec


def test_stop_strings_are_first_occurrences_spread_over_the_text():
    text = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."
    stops = openai_client.stop_strings(text)
    assert 3 <= len(stops) <= openai_client.STOP_PLACES
    assert all(text.find(s) > 0 and s.strip() for s in stops)
    assert len({text.find(s) for s in stops}) == len(stops)


def test_one_servers_answers_must_agree_with_themselves():
    assert set(openai_client.self_checks(record()).values()) == {"same"}
    broken = record(chat_stream=["The sky is blue", "b"], n2=["x", "y"])
    checks = openai_client.self_checks(broken)
    assert checks["chat stream joins to the unstreamed text"] == "differs"
    assert checks["n=2 greedy gives the one answer twice"] == "differs"
    assert checks["completions stream joins to the unstreamed text"] == "same"


def test_two_servers_are_compared_case_by_case():
    ref = record()
    assert set(openai_client.compare(ref, record()).values()) == {"same"}
    off = record(logprobs=[{"token": "a", "logprob": -0.6, "top": ["a", "b"]}], card="long, long ago")
    verdict = openai_client.compare(ref, off, logprob_tol=1e-3)
    assert verdict["logprobs with top_logprobs"] == "differs"
    assert verdict["the card's example request (/v1/completions, greedy)"] == "differs"
    assert verdict["/v1/chat/completions"] == "same"


def test_the_load_mixes_the_parameter_sets_users_send():
    rng = random.Random(0)
    base = stress.mixed_payloads(200, 0, 64, 32)
    mixed = [stress.mixed_request(rng, p) for p in base]
    params = [m["sampling_params"] for m in mixed]
    assert any(p.get("temperature") == 0.8 for p in params) and any(p.get("temperature") == 0.0 for p in params)
    assert any("frequency_penalty" in p for p in params) and any("stop" in p for p in params)
    assert any("logit_bias" in p for p in params) and any("regex" in p for p in params)
    assert any(m.get("return_logprob") for m in mixed) and any("min_new_tokens" in p for p in params)
    assert all(p.get("min_new_tokens", 0) <= p["max_new_tokens"] for p in params)
    assert all(math.isfinite(p.get("temperature", 1.0)) for p in params)
    assert all(b["text"] == m["text"] for b, m in zip(base, mixed))


def test_the_reliability_evidence_reads_into_the_summary_form(tmp_path):
    """lab/reliability_summary.py turns the GPU group's three files into issue 77's summary keys."""
    import os
    import subprocess
    import sys

    odd = {"by_impl": {
        "ar": {"outcomes": {"empty text": {"outcome": "crashed", "status": 0, "cause": "RuntimeError: cannot reshape"},
                            "n 2": {"outcome": "served", "status": 200}}},
        "plugin": {"outcomes": {"empty text": {"outcome": "refused", "status": 400, "message": "The prompt is empty"},
                                "n 2": {"outcome": "served", "status": 200}}}}}
    openai = {"compare": {"n=2": "same", "logprobs": "differs"}, "self": {"plugin": {"chat stream joins to the unstreamed text": "same"}}}
    load = {"seconds": 300, "pairs": {"smollm2": {
        "requests": 900, "aborted": 230, "errors": 0, "output_tok_s": 5000.0,
        "start": {"memory": {"gpu_mb": 40000, "host_rss_mb": 3000}, "idle": {"kv_used_tokens": 0}},
        "end": {"memory": {"gpu_mb": 40010, "host_rss_mb": 3050},
                "idle": {"kv_used_tokens": 0, "running_reqs": 0, "state_slots_used": None}}}}}
    for part, body in (("odd", odd), ("openai", openai), ("load", load)):
        (tmp_path / f"reliability-0.5.23-{part}.json").write_text(json.dumps(body))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "lab", "reliability_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    rel = json.loads(out.stdout)["0.5.23"]
    # Cases met alike are counted, the others named (the summary's size is capped).
    assert rel["odd"] == {"empty text": {"ar": "crashed", "plugin": "refused"}} and rel["odd_alike"] == {"served": 1}
    assert rel["empty_prompt_cause"].startswith("ar: crashed (RuntimeError: cannot reshape)")
    assert rel["openai_client"] == {"differs": 1, "not_same": ["logprobs"], "same": 2}
    smol = rel["load"]["smollm2"]
    assert smol["aborts"] == 230 and smol["kv_idle"] and smol["state_idle"]
    assert smol["gpu_mem_mb"] == [40000, 40010] and smol["host_rss_mb"] == [3000, 3050]
    assert smol["cancelled_share"] == 0.256 and "late_growth_mb" not in smol  # no readings in between
    assert len(rel["evidence"]) == 3
    empty = subprocess.run([sys.executable, os.path.join(root, "lab", "reliability_summary.py"), str(tmp_path / "x")],
                           capture_output=True, text=True)
    assert empty.returncode == 2 and "no such folder" in empty.stderr

    # A later call's servers add to the earlier ones: the built-in's odd run, the hybrid's load.
    later = tmp_path / "later"
    later.mkdir()
    (later / "reliability-0.5.23-odd.json").write_text(json.dumps({"by_impl": {"builtin": {"outcomes": {
        "empty text": {"outcome": "crashed", "status": 0, "cause": "RuntimeError: cannot reshape"}}}}}))
    series = [{"t_s": t, "gpu_mb": 40000 + t, "host_rss_mb": 3000 + min(t, 100)} for t in (0, 50, 100, 150, 200)]
    hybrid = {**load["pairs"]["smollm2"], "memory_series": series}
    (later / "reliability-0.5.23-load.json").write_text(json.dumps({**load, "pairs": {"qwen3.5-hybrid": hybrid}}))
    out = subprocess.run([sys.executable, os.path.join(root, "lab", "reliability_summary.py"), str(tmp_path), str(later)],
                         capture_output=True, text=True, check=True)
    rel = json.loads(out.stdout)["0.5.23"]
    assert rel["odd"]["empty text"] == {"ar": "crashed", "builtin": "crashed", "plugin": "refused"}
    assert rel["empty_prompt_cause"].count("ar: crashed") == 1 and "builtin: crashed" in rel["empty_prompt_cause"]
    assert set(rel["load"]) == {"smollm2", "qwen3.5-hybrid"} and len(rel["evidence"]) == 5
    assert rel["load"]["qwen3.5-hybrid"]["late_growth_mb"] == {"gpu_mb": 100, "host_rss_mb": 0}
