"""GPU: odd requests, the OpenAI client, and load with cancels, on a real tokenizer.

    DFLASH_TARGET=/tmp/smollm2 DFLASH_DRAFT=/tmp/smol-draft bash lab/gpu_tests.sh reliability

The pair is SmolLM2-135M-Instruct and its DFlash draft (``DFLASH_TARGET``/``DFLASH_DRAFT``): its
tokenizer adds no BOS, so an empty text is an empty prompt, which once ended a 0.5.23 server.
- ``odd``: each request of :mod:`sglang_dflash.bench.odd_inputs` (``DFLASH_ODD_CASES``: only those
  named) against plain decoding, the built-in and the plugin (``DFLASH_ODD_IMPLS``), one server at a
  time, restarted after a crash.
  The plugin must serve or refuse (4xx with a message) every one and stay up, and never refuse
  what plain decoding serves.
- ``openai``: the official ``openai`` client against plain decoding and the plugin, float32 and
  greedy, where every text is exact (:mod:`sglang_dflash.bench.openai_client`).
- ``load``: the plugin with its defaults at c64 for ``DFLASH_LOAD_SECONDS`` (300) with mixed
  parameters and a quarter of the requests cancelled mid-stream, on SmolLM2 and on the tiny
  Qwen3.5 hybrid at once (``DFLASH_LOAD_PAIRS``): no error but the cancels, KV, recurrent-state
  slots and request slots back to idle, GPU and host memory read every 30 s: what grows in the
  second half, once compiles and caches have warmed, is a leak (at most ``LATE_GROWTH_MB``).
  ``DFLASH_LOAD_IMPL=ar`` puts plain decoding under the same load, the reference for its throughput
  (``reliability-<release>-load-ar.json``).
Evidence goes to ``DFLASH_GPU_RESULTS`` as ``reliability-<release>-*.json``.
"""

import json
import os
import threading
from functools import lru_cache

import pytest
from test_hybrid_gpu import FLAGS as HYBRID_FLAGS
from test_hybrid_gpu import hybrid_pair
from test_server_gpu import RESULTS

from sglang_dflash import compat
from sglang_dflash.bench import odd_inputs, openai_client
from sglang_dflash.bench.client import kv_loads, server_info
from sglang_dflash.bench.server import Server, ServerSpec, exit_on_sigterm
from sglang_dflash.bench.stress import alive, late_growth, run_load

pytestmark = [pytest.mark.gpu, pytest.mark.reliability]
exit_on_sigterm()  # a call's `timeout` ends the run through the finally blocks that stop the servers
RELEASE = compat.running().version
CONTEXT = 4096
ODD_IMPLS = os.environ.get("DFLASH_ODD_IMPLS", "ar,builtin,plugin").split(",")
# Only these odd requests, by name (comma-separated): what an earlier call left unmeasured.
ODD_CASES = [c.strip() for c in os.environ.get("DFLASH_ODD_CASES", "").split(",") if c.strip()]
LOAD_SECONDS = float(os.environ.get("DFLASH_LOAD_SECONDS", 300))
LOAD_PAIRS = os.environ.get("DFLASH_LOAD_PAIRS", "smollm2,qwen3.5-hybrid").split(",")
LOAD_IMPL = os.environ.get("DFLASH_LOAD_IMPL", "plugin")  # ar: plain decoding under the same load
CANCEL_SHARE = 0.25
LATE_GROWTH_MB = 128  # GPU or host memory gained over a load's second half
# A user's server as the crash was reported on: triton, 64 slots; SGLang's own grammar backend and
# CUDA graphs. A fixed share of memory each, so servers side by side all fit.
USER_FLAGS = ["--attention-backend", "triton", "--max-running-requests", "64", "--mem-fraction-static", "0.3",
              "--log-level", "warning"]


def real_pair():
    if not os.environ.get("DFLASH_TARGET"):
        pytest.skip("needs DFLASH_TARGET and DFLASH_DRAFT (SmolLM2 and its draft: a tokenizer without BOS)")
    return os.environ["DFLASH_TARGET"], os.environ["DFLASH_DRAFT"]


def save(name, payload):
    with open(os.path.join(RESULTS, f"reliability-{RELEASE}-{name}.json"), "w") as f:
        json.dump({"sglang": RELEASE, **payload}, f, indent=1)


@lru_cache(maxsize=None)
def odd_outcomes_all():
    """Every server of ODD_IMPLS through the odd requests at once (each its own server, restarted
    after a crash): restarts dominate, and three small servers share one GPU easily. Launched
    from this thread, so each server dies with the run (bench.server.server_preexec)."""
    target, draft = real_pair()
    vocab, specials, special_text = odd_inputs.tokenizer_facts(target)
    cases = odd_inputs.odd_cases(vocab, CONTEXT, specials, special_text)
    unknown = set(ODD_CASES) - set(cases)
    assert not unknown, f"DFLASH_ODD_CASES names no odd request {sorted(unknown)}"
    cases = {name: case for name, case in cases.items() if not ODD_CASES or name in ODD_CASES}
    servers = {impl: Server(ServerSpec(impl, target, draft, None, USER_FLAGS + ["--context-length", str(CONTEXT)]),
                            log_path=os.path.join(RESULTS, f"server-odd-{impl}.log"), timeout_s=600)
               for impl in ODD_IMPLS}
    done = {impl: {"outcomes": {}, "restarts": 0} for impl in ODD_IMPLS}
    # One start at a time, restarts too: 0.5.23 refuses to start when memory moves under its
    # reading ("Loaded weights leave no GPU memory for the KV cache"), as a neighbour's start does.
    starting, saving = threading.Lock(), threading.Lock()

    def record():
        with saving:
            for _ in range(10):  # another server's thread may add an outcome while this one copies
                try:
                    snapshot = json.loads(json.dumps(done))
                    break
                except RuntimeError:
                    continue
            save("odd", {"impls": ODD_IMPLS, "context_length": CONTEXT, "vocab": vocab, "by_impl": snapshot})

    def run(impl):
        server, got = servers[impl], done[impl]
        restart = odd_inputs.Restarter(server, os.path.join(RESULTS, f"server-odd-{impl}"), starting)

        def recorded():
            got["restarts"] = restart.restarts
            record()

        try:
            odd_inputs.run_cases(server, cases, alive, restart, out=got["outcomes"], recorded=recorded)
            got["alive_at_end"] = alive(server.url)
        except Exception as e:  # a restart that failed: recorded, and the plugin's test fails on it
            got.update(alive_at_end=False, failed=f"{type(e).__name__}: {e}"[:500])
        record()

    try:
        # One at a time: 0.5.23 refuses to start where another server took memory after its
        # reading ("Loaded weights leave no GPU memory for the KV cache").
        for server in servers.values():
            server.start()
        threads = [threading.Thread(target=run, args=(impl,)) for impl in ODD_IMPLS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for server in servers.values():
            server.stop()
        record()
    return done


def odd_outcomes(impl):
    return odd_outcomes_all()[impl]


@pytest.mark.parametrize("impl", ODD_IMPLS)
def test_reliability_odd_requests(impl):
    got = odd_outcomes(impl)
    if impl != "plugin":
        return  # plain decoding and the built-in are recorded, and judged by what they did
    bad = {name: o for name, o in got["outcomes"].items() if o["outcome"] in ("crashed", "error") or o.get("insane")}
    assert not bad and got.get("alive_at_end") and "failed" not in got, (bad, got.get("failed"))


def test_reliability_plugin_serves_what_plain_decoding_serves():
    if "ar" not in ODD_IMPLS or "plugin" not in ODD_IMPLS:
        pytest.skip("needs ar and plugin in DFLASH_ODD_IMPLS")
    by_case = {}
    for impl in ("ar", "plugin"):
        for name, o in odd_outcomes(impl)["outcomes"].items():
            by_case.setdefault(name, {})[impl] = o
    found = odd_inputs.problems(by_case)
    assert not found, found


def test_reliability_empty_prompt_is_refused_and_the_server_stays_up():
    """The request that ended a 0.5.23 server: a 400 that says why, and the next request served."""
    got = odd_outcomes("plugin")["outcomes"]
    for name in ("empty text", "empty prompt on /v1/completions"):
        assert got[name]["outcome"] == "refused" and got[name]["status"] == 400, got[name]
        assert "empty" in got[name]["message"], got[name]


def test_reliability_openai_client_matches_plain_decoding():
    target, draft = real_pair()
    flags = USER_FLAGS + openai_client.FLOAT32_FLAGS + ["--cuda-graph-max-bs-decode", "8"]
    report = openai_client.compare_servers(target, draft, ["ar", "plugin"], flags, openai_client.FLOAT32_ENV,
                                           RESULTS, warm=True, logprob_tol=1e-3)
    save("openai", report)
    verdicts = openai_client.verdicts(report)
    assert all(v == "same" for v in verdicts.values()), verdicts


def load_server(pair):
    target, draft = real_pair() if pair == "smollm2" else hybrid_pair()
    flags = USER_FLAGS + (HYBRID_FLAGS if pair != "smollm2" else [])
    return ServerSpec(LOAD_IMPL, target, None if LOAD_IMPL == "ar" else draft, None, flags)


def idle_counters(url):
    loads = kv_loads(url)
    state = (server_info(url).get("dflash") or {}).get("state_pool")
    return {"kv_used_tokens": loads.get("num_used_tokens"), "running_reqs": loads.get("num_running_reqs"),
            "state_slots_used": state["used"] if state else None,
            "state_slots_cached": state.get("cached") if state else None}


def test_reliability_load_with_cancels_leaves_the_servers_idle():
    """Servers start one at a time; each takes its load as soon as it is up (a server that serves
    does not move memory under a neighbour's start as a starting one does)."""
    servers = {pair: Server(load_server(pair), log_path=os.path.join(RESULTS, f"server-load-{LOAD_IMPL}-{pair}.log"),
                            timeout_s=600) for pair in LOAD_PAIRS}
    reports, threads, saving = {}, [], threading.Lock()

    def load(pair, start):
        s = servers[pair]
        report = run_load(s.url, concurrency=64, seconds=LOAD_SECONDS, abort_fraction=CANCEL_SHARE,
                          mixed_params=True, memory_probe=s.memory)
        info = server_info(s.url)
        report.update(start=start, end={"memory": s.memory(), "idle": idle_counters(s.url)},
                      alive_after=alive(s.url), dflash=info.get("dflash"),
                      scheduler_ledger=info.get("scheduler_ledger"))  # plain decoding's calls by mode
        with saving:  # each pair's report as it ends: a call cut short keeps the pairs that finished
            reports[pair] = report
            save("load" if LOAD_IMPL == "plugin" else f"load-{LOAD_IMPL}",
                 {"impl": LOAD_IMPL, "seconds": LOAD_SECONDS, "cancel_share": CANCEL_SHARE, "pairs": reports})

    try:
        for pair, s in servers.items():
            s.start()
            start = {"memory": s.memory(), "idle": idle_counters(s.url)}
            threads.append(threading.Thread(target=load, args=(pair, start), daemon=True))
            threads[-1].start()
        # lab/gpu_reliability.sh starts other servers beside this load once these are up
        open(os.path.join(RESULTS, "load-servers-up"), "w").close()
        for t in threads:
            t.join()
    finally:
        for s in servers.values():
            s.stop()
    assert set(reports) == set(servers), ("a load ended without its report", sorted(reports))
    for pair, r in reports.items():
        assert r["alive_after"] and r["errors"] == 0, (pair, r["errors_sample"])
        # planned cancels always land mid-stream; a slow client may read two steps as one chunk
        assert r["aborted"] >= 0.9 * CANCEL_SHARE * r["requests"], (pair, r["aborted"], r["requests"])
        end, first = r["end"]["idle"], r["start"]["idle"]
        assert end["kv_used_tokens"] == first["kv_used_tokens"] == 0, (pair, first, end)
        assert end["running_reqs"] == 0 and end["state_slots_used"] in (None, 0), (pair, end)
        late = {k: late_growth(r["memory_series"], k) for k in ("gpu_mb", "host_rss_mb")}
        assert all(v is not None and v <= LATE_GROWTH_MB for v in late.values()), (pair, late)
