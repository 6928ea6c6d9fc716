"""GPU: odd requests, aborts and sustained load against the plugin's DFLASH server (tiny pair, bf16).

    bash lab/gpu_tests.sh reliability        # DFLASH_LOAD_SECONDS=300 by default

Every request is either served correctly or refused with a clear error, and the server stays up
with its KV pool and request slots back at their idle counts. Results go to DFLASH_GPU_RESULTS.
"""

import json
import os
import re
import urllib.error
import urllib.request

import pytest

from sglang_dflash.bench.client import kv_loads
from sglang_dflash.bench.server import Server, ServerSpec
from sglang_dflash.bench.stress import alive, run_aborts, run_load
from test_server_gpu import COMMON, RESULTS, save, tiny_pair

pytestmark = pytest.mark.gpu
CONTEXT = 2048
LOAD_SECONDS = float(os.environ.get("DFLASH_LOAD_SECONDS", 300))


def post(url, payload):
    """(HTTP status, JSON body) without raising on 4xx/5xx."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"error": body}


@pytest.fixture(scope="module")
def url():
    target, draft, _ = tiny_pair()
    # the grammar backend is on here (the other GPU tests turn it off): JSON-schema requests need it
    flags = [f for f in COMMON if f not in ("--grammar-backend", "none")]
    spec = ServerSpec("plugin", target, draft, 16, flags + ["--dtype", "bfloat16", "--context-length", str(CONTEXT),
                                                            "--max-running-requests", "64"])
    with Server(spec, log_path=os.path.join(RESULTS, "server-reliability.log"), timeout_s=600) as srv:
        yield srv.url


def served_or_refused(status, body):
    """Served: 200 with output. Refused: a 4xx with a message saying why."""
    if status == 200:
        return "served"
    message = json.dumps(body)
    assert 400 <= status < 500 and len(message) > 20, (status, body)
    return "refused"


ODD = {
    "n=2": {"text": "Once upon a time", "sampling_params": {"n": 2, "max_new_tokens": 16, "temperature": 0.8}},
    "logprobs": {"text": "Once upon a time", "return_logprob": True, "top_logprobs_num": 3,
                 "sampling_params": {"max_new_tokens": 24, "temperature": 0}},
    "json schema": {"text": "Give a JSON object:", "sampling_params": {
        "max_new_tokens": 48, "temperature": 0,
        "json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})}},
    "max_new_tokens 1": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
    "empty prompt": {"text": "", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    "prompt at the context limit": {"input_ids": [100 + i % 3000 for i in range(CONTEXT)],
                                    "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    # Fits the context, but its last verify blocks would reach past it.
    "prompt one block short of the limit": {"input_ids": [100 + i % 3000 for i in range(CONTEXT - 20)],
                                            "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
}
OUTCOMES = {}
# Prefixes of {"a": <integer>} with any JSON whitespace: each piece optional once the one before is there.
_PIECES = [r"\s*", r"\{", r"\s*", '"', "a", '"', r"\s*", ":", r"\s*", "-?", r"\d+", r"\s*", r"\}", r"\s*"]
SCHEMA_PREFIX = re.compile("".join(f"(?:{p}" for p in _PIECES) + ")?" * len(_PIECES))


@pytest.mark.parametrize("name", list(ODD))
def test_odd_request_is_served_or_refused_clearly(url, name):
    status, body = post(url, ODD[name])
    OUTCOMES[name] = {"status": status, "outcome": served_or_refused(status, body)}
    assert alive(url)
    if status != 200:
        return
    outs = body if isinstance(body, list) else [body]
    if name == "n=2":
        assert len(outs) == 2
    if name == "max_new_tokens 1":
        assert outs[0]["meta_info"]["completion_tokens"] == 1
    if name == "logprobs":
        assert len(outs[0]["meta_info"]["output_top_logprobs"]) == outs[0]["meta_info"]["completion_tokens"]
    if name == "json schema":
        text = outs[0]["text"]
        if outs[0]["meta_info"]["finish_reason"]["type"] == "length":
            # A random model may spend the budget on the whitespace JSON allows: what it wrote
            # must still be a prefix of a document of the schema.
            assert SCHEMA_PREFIX.fullmatch(text), text
        else:
            assert isinstance(json.loads(text)["a"], int), text
    if name == "prompt one block short of the limit":
        assert outs[0]["meta_info"]["completion_tokens"] <= 8


def test_stop_strings_inside_and_across_verify_steps(url):
    """Greedy text cut at the first stop string equals the output asked to stop there.

    Stop strings are taken at eight places spread over the answer, so several of them end inside
    a multi-token verify step or straddle two steps.
    """
    base = {"text": "The history of the", "sampling_params": {"max_new_tokens": 96, "temperature": 0}}
    # The first request fills the radix cache; later ones prefill only the uncached tail, whose bf16
    # numerics differ from a cold prefill. Prime the cache so every compared request is alike.
    post(url, base)
    status, full = post(url, base)
    assert status == 200
    text, rows = full["text"], []
    for k in range(8, len(text) - 4, max(1, (len(text) - 12) // 8)):
        stop = text[k:k + 4]
        if not stop.strip():
            continue
        status, cut = post(url, dict(base, sampling_params={**base["sampling_params"], "stop": [stop]}))
        rows.append({"stop": stop, "status": status, "ok": status == 200 and cut["text"] == text[: text.find(stop)]})
    OUTCOMES["stop strings"] = {"tried": len(rows), "passed": sum(r["ok"] for r in rows)}
    assert rows and all(r["ok"] for r in rows), rows


def test_aborts_and_load_leave_the_server_idle(url):
    idle = kv_loads(url)
    aborts = run_aborts(url, requests=1000, abort_fraction=0.2, concurrency=64, max_prompt_words=600)
    load = run_load(url, concurrency=64, seconds=LOAD_SECONDS)
    save("reliability.json", {"odd_requests": OUTCOMES, "idle_loads": idle, "aborts": aborts, "load_c64": load})
    for report in (aborts, load):
        assert report["server_alive"], report
        assert report["leak"] == {"num_used_tokens": 0, "num_running_reqs": 0}, report
    assert aborts["error"] == 0 and aborts["aborted"] >= 100, aborts
    assert load["errors"] == 0 and load["requests"] > 64, load
