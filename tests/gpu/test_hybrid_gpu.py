"""GPU: a hybrid target (Qwen3.5: gated delta net + full attention) and the draft context window.

    bash lab/gpu_tests.sh hybrid                           # plugin, plugin + draft window, AR
    DFLASH_HYBRID_RUNS=builtin bash lab/gpu_tests.sh hybrid  # the built-in on the same tests
    DFLASH_HYBRID_RUNS=plugin_switching bash lab/gpu_tests.sh hybrid  # a new verify width every step
    DFLASH_HYBRID_RUNS=plugin_snapshot bash lab/gpu_tests.sh hybrid   # the same, the state kept in the snapshots
    DFLASH_HYBRID_RUNS=plugin_window,plugin_ring bash lab/gpu_tests.sh hybrid  # draft K/V in a ring, beside the window
    DFLASH_HYBRID_ARCH=qwen3_next bash lab/gpu_tests.sh hybrid  # the Qwen3-Next MoE hybrid instead
    DFLASH_HYBRID_PROMPTS=64 bash lab/gpu_tests.sh hybrid       # fewer greedy prompts (200 by default)

Besides greedy prompts, follow-ups and long prompts, each server answers the second turns of 8
sessions (SGLang's ``/open_session``, without streaming).

Every server runs the same random Qwen3.5 target (``make_tiny_pair.py --target-arch qwen3_5``)
with the radix cache and ``--mamba-radix-cache-strategy extra_buffer``; the draft has a
sliding-window layer and a full layer. SGLang's chunked gated-delta-rule kernel has no float32,
so the servers run bf16, and every divergence from AR must sit on a near-tie (the rule of
test_server_gpu, calibrated on the AR server's own decode-vs-prefill noise).
"""

import os
import random
import subprocess
import sys
from functools import lru_cache

import pytest
from test_server_gpu import BACKEND, COMMON, MAX_TIE_RATE, RESULTS, ROOT, calibrate, divergence, greedy, ids, save

from sglang_dflash.bench.client import kv_loads, post_json, run_requests, server_info
from sglang_dflash.bench.server import Server, ServerSpec

pytestmark = [pytest.mark.gpu, pytest.mark.hybrid]
INTERVAL = 32  # --mamba-track-interval: a checkpoint every 32 tokens (>= 2 blocks, see worker)
SKIP_INTERVAL = 64  # plugin_track_skip's: beyond two blocks' reach, so most steps skip the track scatter
WINDOW = 1024  # --speculative-draft-window-size, far below the long prompts
LONG_PROMPTS = (8448, 9000)
SHORT_PROMPTS = int(os.environ.get("DFLASH_HYBRID_PROMPTS", 200))  # greedy prompts of 128 new tokens
SESSIONS = 8  # two turns each
KINDS = ("greedy", "follow_ups", "long", "sessions")
FLAGS = ["--dtype", "bfloat16", "--mamba-radix-cache-strategy", "extra_buffer",
         "--mamba-track-interval", str(INTERVAL)]
# name: (implementation, extra flags, extra environment)
RUNS = {"plugin": ("plugin", (), {}),
        "plugin_window": ("plugin", ("--speculative-draft-window-size", str(WINDOW)), {}),
        # draft K/V in a ring of WINDOW + B slots a request (follow-ups start cold at their hit)
        "plugin_ring": ("plugin", ("--speculative-draft-window-size", str(WINDOW)), {"SGLANG_DFLASH_DRAFT_RING": "1"}),
        # every width in turn, so each commits the recurrent state at every accepted length
        "plugin_switching": ("plugin", (), {"SGLANG_DFLASH_WIDTHS": "16,8,4,2,1", "SGLANG_DFLASH_WIDTH_POLICY": "cycle"}),
        # the same with checkpoints every 64 tokens, beyond two blocks' reach: most commits and DECODEs
        # skip the track scatter (worker.may_reach_track), and the follow-ups still resume right
        "plugin_track_skip": ("plugin", ("--mamba-track-interval", str(SKIP_INTERVAL)),
                              {"SGLANG_DFLASH_WIDTHS": "16,8,4,2,1", "SGLANG_DFLASH_WIDTH_POLICY": "cycle"}),
        # the switching run with each request's state kept in the verify's snapshot rows (gdn_state):
        # width 1's DECODEs copy it back, the next verify stages it again, every step
        "plugin_snapshot": ("plugin", (), {"SGLANG_DFLASH_WIDTHS": "16,8,4,2,1", "SGLANG_DFLASH_WIDTH_POLICY": "cycle",
                                           "SGLANG_DFLASH_GDN_STATE": "snapshot"}),
        "builtin": ("builtin", (), {})}
SELECTED = os.environ.get("DFLASH_HYBRID_RUNS", "plugin,plugin_window").split(",")
ARCH = os.environ.get("DFLASH_HYBRID_ARCH", "qwen3_5")  # make_tiny_pair.py --target-arch: qwen3_5, qwen3_next


@lru_cache(maxsize=None)
def hybrid_pair():
    out = os.environ.get("DFLASH_HYBRID_DIR") or ("/tmp/dflash-hybrid-m15" if ARCH == "qwen3_5" else f"/tmp/dflash-{ARCH}-m15-b25-s05")
    if not os.path.exists(os.path.join(out, "draft", "model.safetensors")):
        # A weaker magnet than the Qwen3 pair's. The recurrent target still locks onto it once
        # emitted (answers are mostly magnet runs); flatter targets leave the bf16 rule undecided.
        # Qwen3-Next's top-2 routing needs close experts and a magnet bias for that (make_tiny_pair.py).
        moe = ["--magnet-bias", "0.25", "--expert-spread", "0.05"] if ARCH == "qwen3_next" else []
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_pair.py"), out, "--magnet", "1.5",
                        "--target-arch", ARCH, "--draft-sliding-window", "256", *moe], check=True)
    return os.path.join(out, "target"), os.path.join(out, "draft")


def short_prompts():
    rng = random.Random(21)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(8, 64))] for _ in range(SHORT_PROMPTS)]


def long_prompts():
    rng = random.Random(22)
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in LONG_PROMPTS]


def follow_ups(short, outputs):
    """Each prompt again, followed by its whole answer: the radix cache keeps the recurrent state
    of the last track boundary the decode crossed, so these resume from a checkpoint taken by a
    multi-token commit while decoding."""
    return [(len(prompt), greedy(prompt + out, max_new=24)) for prompt, out in zip(short[:32], outputs)]


def session_turns(url, short):
    """Two turns of SESSIONS sessions: the second appends new tokens to the first's prompt and answer.
    Without streaming, SGLang starts each turn as a new request, its prefix from the radix cache
    (a streaming session would resume the last turn's state slot). Returns the first turns' outputs,
    the second turns' results, and each second turn as one plain request (for the near-tie probe)."""
    rng = random.Random(23)
    firsts, seconds, plain = [], [], []
    for i, prompt in enumerate(short[:SESSIONS]):
        sid = f"dflash-hybrid-{i}"
        opened = post_json(url + "/open_session", {"capacity_of_str_len": 1 << 16, "session_id": sid})
        assert not isinstance(opened, dict), opened  # an error answer
        first, _ = run_requests(url, [{**greedy(prompt, max_new=48), "session_params": {"id": sid}, "rid": f"{sid}-1"}], 1)
        turn = [rng.randrange(10, 4000) for _ in range(rng.randrange(4, 16))]
        second, _ = run_requests(url, [{**greedy(turn, max_new=48), "session_params": {"id": sid, "rid": f"{sid}-1"}}], 1)
        post_json(url + "/close_session", {"session_id": sid})
        firsts += ids(first)
        seconds += second
        plain.append(greedy(prompt + firsts[-1] + turn, max_new=48))
    return firsts, seconds, plain


def serve(name, server):
    """The workloads, in order: greedy prompts, their follow-ups (radix hits), sessions' two turns,
    long prompts."""
    out = {"requests": {}}
    short = short_prompts()
    # Two at a time where the track skip is checked: 16 requests at once leave some always within
    # reach of a boundary every 64 tokens, so no step would skip (2026-12-05: none did).
    first, _ = run_requests(server.url, [greedy(p) for p in short], 2 if name == "plugin_track_skip" else 16)
    out["greedy"], out["requests"]["greedy"] = ids(first), [greedy(p) for p in short]
    out["accept_length"] = sum(r.completion_tokens for r in first) / max(1, sum(r.spec_verify_ct for r in first))
    work = follow_ups(short, out["greedy"])
    second, _ = run_requests(server.url, [w for _, w in work], 8)
    out["follow_ups"], out["requests"]["follow_ups"] = ids(second), [w for _, w in work]
    out["follow_up_prompt_lens"] = [n for n, _ in work]
    out["follow_up_cached"] = [r.meta.get("cached_tokens", 0) for r in second]
    out["session_firsts"], second, out["requests"]["sessions"] = session_turns(server.url, short)
    out["sessions"] = ids(second)
    out["session_cached"] = [r.meta.get("cached_tokens", 0) for r in second]
    long = [greedy(p, max_new=64) for p in long_prompts()]
    out["long"], out["requests"]["long"] = ids(run_requests(server.url, long, 2)[0]), long
    out["loads_after"] = kv_loads(server.url)
    dflash = server_info(server.url).get("dflash") or {}
    out["state_pool_after"], out["widths_used"] = dflash.get("state_pool"), dflash.get("widths_used")
    out["draft_kv"], out["verify_track"], out["decode_track"] = (dflash.get(k) for k in ("draft_kv", "verify_track",
                                                                                       "decode_track"))
    out["gdn_state"], out["block_attention"] = dflash.get("gdn_state"), dflash.get("block_attention")
    return out


def spec(name):
    impl, extra, env = RUNS.get(name, ("ar", (), {}))
    target, draft = hybrid_pair()
    return ServerSpec(impl, target, draft if impl != "ar" else None, 16 if impl != "ar" else None,
                      COMMON + FLAGS + list(extra), dict(env))


@lru_cache(maxsize=None)
def against_ar():
    """Every selected run, then AR: its outputs, the rule's calibration, a probe at each divergence."""
    runs = {}
    for name in SELECTED:
        with Server(spec(name), log_path=os.path.join(RESULTS, f"server-hybrid-{name}.log"), timeout_s=600) as s:
            runs[name] = serve(name, s)
        # What the run showed before plain decoding's server starts: a call cut short keeps it.
        save(evidence_name(name, "served"), {"run": name, "target_arch": ARCH, **served_figures(runs[name]),
                                             "prompts": {k: len(runs[name][k]) for k in KINDS}})
    with Server(spec("ar"), log_path=os.path.join(RESULTS, "server-hybrid-ar.log"), timeout_s=600) as ar:
        ar_out = serve("ar", ar)
        ar_checkpointed = sum(c > n for c, n in zip(ar_out["follow_up_cached"], ar_out["follow_up_prompt_lens"]))
        calibration = calibrate(ar.url, 4000, "bfloat16")
        reports = {}
        for name, out in runs.items():
            rows = {}
            same_first_turn = [a == b for a, b in zip(out["session_firsts"], ar_out["session_firsts"])]
            for kind in KINDS:
                rows[kind] = []
                for i, (req, a, b) in enumerate(zip(out["requests"][kind], out[kind], ar_out[kind])):
                    if kind == "sessions" and not same_first_turn[i]:
                        continue  # the second turns' prompts differ: the first turn's divergence is a greedy one
                    row = divergence(ar.url, req, a, b, calibration["near_tie_nats"])
                    if row is not None:
                        rows[kind].append({"request": i, **row})
            checkpointed = sum(c > n for c, n in zip(out["follow_up_cached"], out["follow_up_prompt_lens"]))
            reports[name] = {
                "run": name, "target_arch": ARCH, "dtype": "bfloat16", "calibration": calibration, "divergences": rows,
                "off_near_tie": {k: sum(not r["near_tie"] for r in v) for k, v in rows.items()},
                "prompts": {k: len(out[k]) for k in rows}, "long_prompt_tokens": list(LONG_PROMPTS),
                "draft_window": WINDOW if name in ("plugin_window", "plugin_ring") else None,
                "mamba_track_interval": SKIP_INTERVAL if name == "plugin_track_skip" else INTERVAL,
                "follow_ups_served_from_decode_checkpoints": checkpointed, "ar_follow_ups_from_checkpoints": ar_checkpointed,
                "follow_up_cached_tokens": out["follow_up_cached"], "ar_loads_after": ar_out["loads_after"],
                "sessions_compared": sum(same_first_turn),
                "session_cached_tokens": out["session_cached"],
                **served_figures(out),
            }
            save(evidence_name(name), reports[name])
    return reports


def served_figures(out):
    """What a run's server reported of itself after the workloads."""
    return {k: out.get(k) for k in ("accept_length", "loads_after", "state_pool_after", "widths_used", "draft_kv",
                                    "verify_track", "decode_track", "gdn_state", "block_attention")}


def evidence_name(name, part=""):
    arch = "" if ARCH == "qwen3_5" else f"{ARCH}_"
    return f"hybrid_{arch}{name}{'_' + part if part else ''}.json"


def report(name):
    if name not in SELECTED:
        pytest.skip(f"{name} is not in DFLASH_HYBRID_RUNS")
    rep = against_ar()[name]
    assert rep["calibration"]["tie_rate"] <= MAX_TIE_RATE, f"the near-tie rule would not decide: {rep['calibration']}"
    return rep


@pytest.mark.parametrize("name", ["plugin", "plugin_window", "plugin_ring", "plugin_switching", "plugin_track_skip",
                                  "plugin_snapshot"])
def test_hybrid_greedy_and_long_prompts_match_ar_up_to_near_ties(name):
    rep = report(name)
    switching = name in ("plugin_switching", "plugin_track_skip", "plugin_snapshot")
    assert rep["off_near_tie"]["greedy"] == 0 and rep["off_near_tie"]["long"] == 0, rep["divergences"]
    assert rep["accept_length"] > (1.2 if switching else 1.5)  # multi-token commits happened
    for loads in (rep["loads_after"], rep["ar_loads_after"]):
        assert loads.get("num_used_tokens") == 0 and loads.get("num_running_reqs") == 0, loads
    assert rep["state_pool_after"] is None or rep["state_pool_after"]["used"] == 0, rep["state_pool_after"]
    if switching:  # every width verified, the recurrent state committed at each
        assert set(rep["widths_used"] or {}) == {"16", "8", "4", "2", "1"}, rep["widths_used"]
    assert rep["gdn_state"] == ("snapshot" if name == "plugin_snapshot" else "commit"), rep["gdn_state"]
    if BACKEND == "triton":  # the target's verify went to the block kernel too, through the hybrid wrapper
        assert (rep["block_attention"] or {}).get("backends", 0) >= 2, rep["block_attention"]
    if name == "plugin_track_skip":  # both kinds of step skipped the track scatter, and both ran it
        for counts in (rep["verify_track"], rep["decode_track"]):
            assert min(counts.get("skipped", 0), counts.get("scattered", counts.get("prepared", 0))) > 0, rep
    if name == "plugin_ring":  # draft memory fixed by the window, far below the target's token pool
        assert rep["draft_kv"]["layout"] == "ring" and rep["draft_kv"]["ring_slots_per_request"] == WINDOW + 16, rep
        budget = rep["draft_kv"].get("budget") or {}  # the memory saved went to the target's KV pool
        assert budget.get("target_tokens", 0) > budget.get("target_tokens_without_ring", 0), rep["draft_kv"]


@pytest.mark.parametrize("name", [
    "plugin", "plugin_window", "plugin_ring", "plugin_switching", "plugin_track_skip", "plugin_snapshot",
    # The built-in skips these checkpoints (upstream 37817), but on this magnet-led target the
    # wrong state rarely shows in the tokens: measured passing. tests/test_worker.py catches it.
    pytest.param("builtin", marks=pytest.mark.xfail(strict=False, reason="upstream 37817: checkpoint skipped")),
])
def test_requests_resumed_from_decode_checkpoints_match_ar(name):
    """Follow-up requests resume from recurrent states that were checkpointed at track boundaries
    crossed by multi-token commits. A checkpoint taken at the wrong step (or skipped, while the
    scheduler records it) hands them a wrong state, and their tokens leave AR's."""
    rep = report(name)
    n = rep["prompts"]["follow_ups"]
    assert n >= 16 and rep["follow_ups_served_from_decode_checkpoints"] >= n // 2, rep
    assert rep["off_near_tie"]["follow_ups"] == 0, rep["divergences"]["follow_ups"]


@pytest.mark.parametrize("name", ["plugin", "plugin_switching", "plugin_snapshot"])
def test_session_turns_match_ar(name):
    """A session's second turn starts from the first turn's prompt and answer, its recurrent state
    from the radix cache's checkpoints (served with the state in the snapshot rows too)."""
    rep = report(name)
    assert rep["prompts"]["sessions"] == SESSIONS and rep["sessions_compared"] >= SESSIONS // 2, rep
    assert rep["off_near_tie"]["sessions"] == 0, rep["divergences"]["sessions"]
