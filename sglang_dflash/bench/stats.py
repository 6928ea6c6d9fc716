"""The figures of a sweep: per-level summaries, speedups over AR, and paired-wave ratios."""

from __future__ import annotations

import math
import random
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


def add_speedups(rows: list[dict]) -> None:
    """speedup = tok/s / AR tok/s at the same dataset and concurrency."""
    ar = {(r["dataset"], r["concurrency"]): r["output_tok_s"] for r in rows if r["impl"] == "ar"}
    for r in rows:
        base = ar.get((r["dataset"], r["concurrency"]))
        r["speedup"] = r["output_tok_s"] / base if base else None


def paired_ratio_stats(ratios: list[float], resamples: int = 4000, seed: int = 0) -> dict:
    """Geometric mean of paired wave ratios with a 95% bootstrap interval (seeded): whether runs
    this noisy tell the two servers apart at all."""
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        raise ValueError("no positive ratios to summarise")
    rng, n = random.Random(seed), len(logs)
    means = sorted(sum(rng.choices(logs, k=n)) / n for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return {"waves": n, "at_least_1x": sum(x >= 0 for x in logs), "geomean": math.exp(sum(logs) / n),
            "ci95": [math.exp(lo), math.exp(hi)]}


def paired_wave_ratios(rows: list[dict], a: str = "plugin", b: str = "builtin") -> dict:
    """(dataset, concurrency) -> ``a``/``b`` tok/s ratios of the waves the two ran in turn."""
    by = {(r["dataset"], r["label"], r["concurrency"]): r for r in rows}
    out = {}
    for (d, lab, c), ra in by.items():
        rb = by.get((d, b, c))
        if lab == a and rb and ra.get("wave_tok_s") and rb.get("wave_tok_s"):
            out[(d, c)] = [x / y for x, y in zip(ra["wave_tok_s"], rb["wave_tok_s"]) if x and y]
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

