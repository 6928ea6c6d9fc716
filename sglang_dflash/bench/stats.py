"""The figures of a sweep: per-level summaries, speedups over AR, and paired-wave ratios."""

from __future__ import annotations

import math
import random
import statistics
from typing import Optional

from .client import RequestResult


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(x):
    return None if x is None else round(1000 * x, 3)


def step_time(r: RequestResult):
    """Seconds per decode step after the first token: a verify step under speculation, a token
    without (then it is the TPOT)."""
    steps = r.spec_verify_ct or r.completion_tokens - 1
    if r.ttft is None or steps < 1:
        return None
    return (r.latency - r.ttft) / steps


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    verify = sum(r.spec_verify_ct for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    steps = [step_time(r) for r in ok]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "accept_length": tokens / verify if verify else None,
        "spec_verify_ct": verify,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "step_p50_ms": _ms(percentile([t for t in steps if t is not None], 50)),
        "first_error": next((r.error for r in results if not r.ok), None),
    }


# Where a request's first token time goes, from the timestamps SGLang adds to the last chunk's
# meta_info under --enable-metrics (wall clock, as the client's send time).
TTFT_PARTS = (
    ("http_in", "the client's send until the tokenizer manager has the request"),
    ("to_batch", "tokenizer, scheduler hand-off and queue, until a prefill batch takes the request"),
    ("prefill", "prefill launch, forward and the next batch's launch, until its result is processed"),
    ("to_tokenizer", "detokenizer hand-off of the first token"),
    ("http_out", "until the client reads the first chunk"),
)


def ttft_parts(r: RequestResult) -> Optional[dict]:
    """One request's first-token time in the parts of ``TTFT_PARTS`` (seconds), or None when the
    server sent no timestamps (started without --enable-metrics) or the request failed."""
    m = r.meta
    keys = ("request_received_ts", "forward_entry_time", "prefill_finished_time", "first_token_latency")
    if not (r.ok and r.ttft is not None and r.sent_at and all(m.get(k) for k in keys)):
        return None
    at_tokenizer = m["request_received_ts"] + m["first_token_latency"]
    marks = (r.sent_at, m["request_received_ts"], m["forward_entry_time"], m["prefill_finished_time"],
             at_tokenizer, r.sent_at + r.ttft)
    return {name: b - a for (name, _), a, b in zip(TTFT_PARTS, marks, marks[1:])}


def ttft_parts_summary(results: list[RequestResult]) -> Optional[dict]:
    """Median of each part over the requests that carry timestamps (ms), with the queue time
    SGLang reports apart (it is inside ``to_batch``)."""
    parts = [(p, r.meta.get("queue_time")) for r in results if (p := ttft_parts(r)) is not None]
    if not parts:
        return None
    out = {name: _ms(percentile([p[name] for p, _ in parts], 50)) for name, _ in TTFT_PARTS}
    queue = [q for _, q in parts if q is not None]
    out["queue"] = _ms(percentile(queue, 50)) if queue else None
    out["requests"] = len(parts)
    return out


def add_speedups(rows: list[dict]) -> None:
    """speedup = tok/s / AR tok/s at the same dataset and concurrency."""
    ar = {(r["dataset"], r["concurrency"]): r["output_tok_s"] for r in rows if r["impl"] == "ar"}
    for r in rows:
        base = ar.get((r["dataset"], r["concurrency"]))
        r["speedup"] = r["output_tok_s"] / base if base else None


# Fewer rotation cycles than this and the waves are resampled one by one: a handful of blocks
# gives no interval worth the name.
MIN_CYCLES = 10


def paired_ratio_stats(ratios: list, resamples: int = 4000, seed: int = 0) -> dict:
    """Geometric mean of paired wave ratios with a 95% bootstrap interval (seeded): whether runs
    this noisy tell the two servers apart at all.

    ``ratios``: one per wave, or lists of them, one per rotation cycle (:func:`paired_wave_cycles`),
    which are then resampled whole. Pinned servers trade CPU slices and places in the order wave
    by wave, and where one slice or place is faster a wave's ratio swings with it, in turn: on the
    H200 host a pair's ratios alternate (lag-1 autocorrelation -0.3 to -0.6 over 100-300 waves,
    2026-11-28), and resampling single waves would count that swing as noise a cycle cancels.
    With fewer than ``MIN_CYCLES`` cycles the waves are resampled one by one."""
    cycles = [[math.log(r) for r in (c if isinstance(c, (list, tuple)) else (c,)) if r > 0] for c in ratios]
    cycles = [c for c in cycles if c]
    if not cycles:
        raise ValueError("no positive ratios to summarise")
    length = max(len(c) for c in cycles)
    if length > 1 and len(cycles) < MIN_CYCLES:
        cycles, length = [[x] for c in cycles for x in c], 1
    logs = [x for c in cycles for x in c]
    rng, n, k = random.Random(seed), len(logs), len(cycles)
    sums, sizes = [sum(c) for c in cycles], [len(c) for c in cycles]
    means = []
    for _ in range(resamples):  # with single waves, the draws of the wave bootstrap this replaced
        picked = rng.choices(range(k), k=k)
        means.append(sum(sums[i] for i in picked) / sum(sizes[i] for i in picked))
    means.sort()
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    resampled = "waves" if length == 1 else f"cycles of {statistics.mode(len(c) for c in cycles)}"
    return {"waves": n, "at_least_1x": sum(x >= 0 for x in logs), "geomean": math.exp(sum(logs) / n),
            "ci95": [math.exp(lo), math.exp(hi)], "resampled": resampled}


def apart_ratio_stats(a_waves: list, b_waves: list, resamples: int = 4000, seed: int = 0) -> dict:
    """Two servers measured in runs of their own (one at a time, where two do not fit one GPU): the
    geometric mean of ``a``'s wave tok/s over ``b``'s, with a 95% bootstrap interval that resamples
    each side's waves on its own. Nothing pairs the waves, so drift between the runs is not
    cancelled; run the servers in both orders and pool the runs."""
    logs_a = [math.log(x) for x in a_waves if x and x > 0]
    logs_b = [math.log(x) for x in b_waves if x and x > 0]
    if not logs_a or not logs_b:
        raise ValueError("each side needs at least one wave with a positive rate")
    rng, means = random.Random(seed), []
    for _ in range(resamples):
        ra, rb = rng.choices(logs_a, k=len(logs_a)), rng.choices(logs_b, k=len(logs_b))
        means.append(sum(ra) / len(ra) - sum(rb) / len(rb))
    means.sort()
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return {"waves": [len(logs_a), len(logs_b)],
            "geomean": math.exp(sum(logs_a) / len(logs_a) - sum(logs_b) / len(logs_b)),
            "ci95": [math.exp(lo), math.exp(hi)], "resampled": "waves of each side apart"}


def paired_wave_cycles(rows: list[dict], a: str = "plugin", b: str = "builtin") -> dict:
    """(dataset, concurrency) -> ``a``/``b`` tok/s ratios of the waves the two ran in turn, in
    rotation cycles: as many waves as servers took turns at that level (each server once on every
    CPU slice and in every place of the order), the last one short where the run stopped inside one."""
    by = {(r["dataset"], r["label"], r["concurrency"]): r for r in rows}
    turns: dict = {}
    for (d, _, c), r in by.items():
        if r.get("wave_tok_s"):
            turns[d, c] = turns.get((d, c), 0) + 1
    out = {}
    for (d, lab, c), ra in by.items():
        rb = by.get((d, b, c))
        if lab == a and rb and ra.get("wave_tok_s") and rb.get("wave_tok_s"):
            pairs = list(zip(ra["wave_tok_s"], rb["wave_tok_s"]))
            n = turns[d, c]
            cycles = [[x / y for x, y in pairs[i:i + n] if x and y] for i in range(0, len(pairs), n)]
            out[(d, c)] = [cycle for cycle in cycles if cycle]
    return out


def _growth_per_call(after: dict, before: Optional[dict], calls: int, scale: float = 1.0, digits: int = 3) -> dict:
    """Each named running total's growth between two reads, per call (``scale`` x, rounded)."""
    before = before or {}
    return {k: round(scale * (v - before.get(k, 0.0)) / calls, digits) for k, v in after.items()}


def wave_host_per_step(row: dict) -> list[dict]:
    """Each wave's mean host time per decode step (us) of a plugin server, from the running totals
    read after every wave (``wave_host_pauses``' ``decode_host``): in the worker call, in the
    scheduler's gap before it, the width policy's own calls (in either), and the worker call's named
    parts (``phases``: draft, verify, accept, state, context) where the server reports them. The
    level's first wave is left out, its totals start from the wave before (of another level, or none)."""
    totals = [w.get("decode_host") for w in row.get("wave_host_pauses") or []]
    out = []
    for before, after in zip(totals, totals[1:]):
        if not before or not after or after["calls"] <= before["calls"]:
            continue
        calls = after["calls"] - before["calls"]
        wave = {k: round(1e3 * (after[f"{k}_ms"] - before[f"{k}_ms"]) / calls, 1) for k in ("call", "gap", "policy")}
        if "phases_ms" in after:
            wave["phases"] = _growth_per_call(after["phases_ms"], before.get("phases_ms"), calls, scale=1e3, digits=1)
        out.append(wave)
    return out


def wave_time_by_mode(row: dict) -> list[dict]:
    """Each wave's scheduler time of a plugin server (or a plain or built-in one with its ledger) by
    mode (decode steps, admissions: ``extend``), in the worker call and in the gap before it, as
    shares of what the calls and gaps add up to, from the running totals read after every wave
    (``wave_host_pauses``' ``by_mode``); and each mode's calls and mean call in ms (``call_ms``: what
    sets one server's admissions beside another's, whose waves last differently). The level's first
    wave is left out, as in :func:`wave_host_per_step`."""
    totals = [w.get("by_mode") for w in row.get("wave_host_pauses") or []]
    out = []
    for before, after in zip(totals, totals[1:]):
        if not before or not after:
            continue
        diff = {mode: {k: after[mode][k] - before.get(mode, {}).get(k, 0) for k in ("calls", "call_ms", "gap_ms")}
                for mode in after}
        wall = sum(d["call_ms"] + d["gap_ms"] for d in diff.values())
        if wall <= 0:
            continue
        out.append({"wall_ms": round(wall, 1), **{
            mode: {"calls": d["calls"], "call": round(d["call_ms"] / wall, 4), "gap": round(d["gap_ms"] / wall, 4),
                   "call_ms": round(d["call_ms"] / d["calls"], 3)}
            for mode, d in sorted(diff.items()) if d["calls"]}})
    return out


def wave_admission_host(row: dict) -> list[dict]:
    """Each wave's mean host time per admission (ms): the worker call, and for a plugin server its
    named parts (``admission_host``: the target's prefill, the draft context written from it; a plain
    server's ledger has none), from the running totals read after every wave: what a draft costs
    outside the decode step. The level's first wave is left out, as in :func:`wave_host_per_step`."""
    reads = row.get("wave_host_pauses") or []
    out = []
    for before, after in zip(reads, reads[1:]):
        if not before or not after or "admission_host" not in after:
            continue
        now, then = (after.get("by_mode") or {}).get("extend"), (before.get("by_mode") or {}).get("extend") or {}
        calls = (now or {}).get("calls", 0) - then.get("calls", 0)
        if calls <= 0:
            continue
        was = (before.get("admission_host") or {}).get("phases_ms")
        out.append({"admissions": calls, "call": round((now["call_ms"] - then.get("call_ms", 0.0)) / calls, 3),
                    "phases": _growth_per_call(after["admission_host"]["phases_ms"], was, calls)})
    return out


def wave_steps_by_what_came_before(row: dict) -> list[dict]:
    """Each wave's decode steps right after an admission (``extend>decode``) and after another
    decode step (``decode>decode``): steps and mean ms a step (the worker call and the gap before
    it), from the running totals read after every wave (``wave_host_pauses``' ``by_transition``).
    The width policy times only the second kind. The level's first wave is left out, as in
    :func:`wave_host_per_step`."""
    totals = [w.get("by_transition") for w in row.get("wave_host_pauses") or []]
    out = []
    for before, after in zip(totals, totals[1:]):
        if not before or not after:
            continue
        wave = {}
        for key in ("extend>decode", "decode>decode"):
            now, then = after.get(key), before.get(key) or {}
            calls = (now or {}).get("calls", 0) - then.get("calls", 0)
            if calls > 0:
                ms = now["call_ms"] + now["gap_ms"] - then.get("call_ms", 0) - then.get("gap_ms", 0)
                wave[key] = {"steps": calls, "ms": round(ms / calls, 3)}
        if wave:
            out.append(wave)
    return out


def wave_tails(row: dict) -> list[dict]:
    """Each wave's decode steps per request, of its slowest request and on average: a wave lasts as
    long as its slowest request, so where requests accept unequally a speculative server's wave is
    longer than its mean accept length says, and plain decoding's is not (every request takes a step
    a token). Steps are a request's verify steps (``spec_verify_ct``), or its tokens after the first
    on a server without them. Only interleaved rows (``wave_tok_s``) keep their requests in waves of
    ``concurrency``, in order; a wave with a failed request is left out."""
    waves, conc = row.get("wave_tok_s"), row["concurrency"]
    requests = row.get("per_request") or []
    if not waves or len(requests) < len(waves) * conc:
        return []
    out = []
    for i in range(len(waves)):
        wave = requests[i * conc:(i + 1) * conc]
        if any(r is None for r in wave):
            continue
        steps = [verified or max(tokens - 1, 0) for tokens, verified in wave]
        mean = sum(steps) / len(steps)
        if mean > 0:
            out.append({"slowest": max(steps), "mean": round(mean, 2), "slowest_over_mean": round(max(steps) / mean, 3)})
    return out


def side_by_side(rows: list[dict]) -> dict:
    """Per concurrency: AR, plugin and built-in tok/s and accept lengths (first dataset measured)."""
    out = {}
    for c in sorted({r["concurrency"] for r in rows}):
        by = {}
        for r in rows:
            if r["concurrency"] == c and r["impl"] not in by:
                by[r["impl"]] = r
        if not {"ar", "plugin", "builtin"} <= set(by):
            continue
        out[f"c{c}"] = {
            "ar_tok_s": round(by["ar"]["output_tok_s"], 1),
            "plugin_tok_s": round(by["plugin"]["output_tok_s"], 1),
            "builtin_tok_s": round(by["builtin"]["output_tok_s"], 1),
            "plugin_accept_len": by["plugin"]["accept_length"],
            "builtin_accept_len": by["builtin"]["accept_length"],
            "plugin_kv_after": by["plugin"].get("kv_after", {}).get("num_used_tokens"),
            "builtin_kv_after": by["builtin"].get("kv_after", {}).get("num_used_tokens"),
        }
    return out


def step_table(rows: list[dict]) -> dict:
    """Per label and concurrency the median step time, and its ratio to AR's at that level."""
    ar = {r["concurrency"]: r["step_p50_ms"] for r in rows if r["impl"] == "ar" and r.get("step_p50_ms")}
    table = {}
    for r in rows:
        if r.get("step_p50_ms") is None:
            continue
        base = ar.get(r["concurrency"])
        table.setdefault(r["label"], {})[str(r["concurrency"])] = {
            "step_ms": round(r["step_p50_ms"], 3), "over_ar": round(r["step_p50_ms"] / base, 3) if base else None}
    return table

