"""Split a light profiler trace (gpu_rig.sh profile with LIGHT=1) into decode steps and tell steady
steps from the ones a request boundary (a prefill, a new batch) falls in.

A light profile's idle total mixes the two: 20 steps caught under load can hold a prefill, and the
GPU then waits 1-70 ms, which says nothing about a steady step. Each step here runs from one launch
of MARKER (a kernel every decode step runs once: the plugin's `_prepare_block_kernel`, the built-in's
`_prepare_dflash_draft_block`) to the next. A step is steady when no single GPU gap in it reaches
--steady-gap-us (a graph's own kernels leave gaps of a few µs, 45 of them a step at c32); for the
others the longest gaps are listed with the kernel that ended each and how late the host launched it.

    python3 lab/trace_steps.py TRACE.json.gz MARKER [--steady-gap-us 50]
"""

import argparse
import gzip
import json
import statistics

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def split_steps(events: list, marker: str, min_gap_us: float = 3.0) -> list:
    """One dict per step: span, GPU idle, kernels, and its gaps over ``min_gap_us`` as
    (gap, kernel that ended it, how late the host's launch call returned, or None)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    marks = [i for i, e in enumerate(gpu) if marker in e["name"]]
    steps = []
    for first, nxt in zip(marks, marks[1:]):
        end, idle, gaps = gpu[first]["ts"], 0.0, []
        for e in gpu[first:nxt]:
            gap = e["ts"] - end
            if gap > min_gap_us:
                idle += gap
                launch = launches.get(e["args"].get("correlation"))
                late = None if launch is None else round(launch["ts"] + launch["dur"] - end, 1)
                gaps.append((round(gap, 1), e["name"][:60], late))
            end = max(end, e["ts"] + e["dur"])
        steps.append({"span_us": round(gpu[nxt]["ts"] - gpu[first]["ts"], 1), "idle_us": round(idle, 1),
                      "kernels": nxt - first, "gaps": sorted(gaps, reverse=True)})
    return steps


def summarize(steps: list, steady_gap_us: float) -> dict:
    is_steady = lambda s: not s["gaps"] or s["gaps"][0][0] < steady_gap_us  # noqa: E731
    steady = [s for s in steps if is_steady(s)]
    med = lambda key, rows: round(statistics.median(r[key] for r in rows), 1) if rows else None  # noqa: E731
    return {
        "steps": len(steps),
        "steady_steps": len(steady),
        "steady_span_us_median": med("span_us", steady),
        "steady_idle_us_median": med("idle_us", steady),
        "steady_kernels_median": med("kernels", steady),
        # how far ahead of the GPU the host launched a steady step's kernels (negative: early)
        "steady_host_lead_us_median": (round(statistics.median(
            -g[2] for s in steady for g in s["gaps"] if g[2] is not None), 1)
            if any(g[2] is not None for s in steady for g in s["gaps"]) else None),
        "boundary_steps": [{**s, "gaps": s["gaps"][:6]} for s in steps if not is_steady(s)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a light trace written by SGLang's profiler (.json or .json.gz)")
    ap.add_argument("marker", help="part of the name of a kernel every decode step runs once")
    ap.add_argument("--steady-gap-us", type=float, default=50.0,
                    help="a step with no GPU gap this long is steady (default 50)")
    args = ap.parse_args(argv)
    steps = split_steps(load_events(args.trace), args.marker)
    if not steps:
        ap.error(f"no two launches of a kernel named like {args.marker!r} in {args.trace}")
    print(json.dumps(summarize(steps, args.steady_gap_us), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
