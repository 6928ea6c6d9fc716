"""Split a light profiler trace (gpu_rig.sh profile with LIGHT=1) into decode steps and tell steady
steps from the ones a request boundary (a prefill, a new request) falls in.

A light profile's idle total mixes the two: 20 steps caught under load can hold a prefill, and the
GPU then waits 1-70 ms, which says nothing about a steady step. `profile_step.json` carries the split
(`step_kinds`) since 2026-11-27; this reads it from a raw trace kept from an earlier run. Each step
runs from one launch of MARKER (a kernel every decode step runs once: the plugin's
`_prepare_block_kernel`, the built-in's `_prepare_dflash_draft_block`) to the next. A step is steady
when no single GPU gap in it reaches --steady-gap-us (a graph's own kernels leave gaps of a few µs,
45 of them a step at c32); for the others the longest gaps are listed with the kernel that ended each
and how late the host launched it.

    python3 lab/trace_steps.py TRACE.json.gz MARKER [--steady-gap-us 50]
"""

import argparse
import json

from sglang_dflash.bench.profile_step import gpu_work, load_trace, split_steps, steady_and_boundary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a light trace written by SGLang's profiler (.json or .json.gz)")
    ap.add_argument("marker", help="part of the name of a kernel every decode step runs once")
    ap.add_argument("--steady-gap-us", type=float, default=50.0,
                    help="a step with no GPU gap this long is steady (default 50)")
    args = ap.parse_args(argv)
    steps = split_steps(*gpu_work(load_trace(args.trace)), args.marker)
    if not steps:
        ap.error(f"no two launches of a kernel named like {args.marker!r} in {args.trace}")
    print(json.dumps(steady_and_boundary(steps, args.steady_gap_us), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
