"""Two traced steps, kernel for kernel: where one spends GPU time the other does not.

Reads the per-step kernel tables that ``profile_step`` writes (``kernels_us_per_step`` and
``kernel_calls_per_step`` of a server at a level) and prints them side by side, the largest
difference first, with each step's GPU busy and idle time. Either side may come from another
file, so a server can be set beside the built-in, itself on another backend, or an earlier run.

    python -m sglang_dflash.bench.kernel_diff OUT/profile_step.json:plugin:c1 OUT/profile_step.json:builtin:c1
    python -m sglang_dflash.bench.kernel_diff A/profile_step.json:plugin:c1-light B/profile_step.json:plugin:c1-light

A side is ``FILE[:SERVER[:LEVEL]]``: the server defaults to the file's first, the level to its first.
"""

from __future__ import annotations

import json
import os
import sys

from .cli import parser

TOTALS = ("gpu_busy_us_per_step", "gpu_idle_us_per_step", "gpu_kernel_us_per_step", "kernel_launches_per_step")


def load_side(spec: str) -> tuple[str, dict]:
    """``FILE[:SERVER[:LEVEL]]`` -> (its label, that level of that server's profile)."""
    path, _, rest = spec.partition(":")
    if not os.path.isfile(path):
        raise SystemExit(f"kernel_diff: no such file: {path}")
    with open(path) as f:
        report = json.load(f)
    servers = [k for k, v in report.items() if k != "settings" and isinstance(v, dict)]
    server, _, level = rest.partition(":")
    server = server or (servers[0] if servers else "")
    if server not in servers:
        raise SystemExit(f"kernel_diff: {path} has no server {server!r} (it has {', '.join(servers) or 'none'})")
    levels = report[server]
    level = level or next(iter(levels), "")
    if level not in levels or "kernels_us_per_step" not in levels[level]:
        raise SystemExit(f"kernel_diff: {path}:{server} has no kernel table at level {level!r} "
                         f"(it has {', '.join(levels) or 'none'})")
    return f"{server}:{level}", levels[level]


def diff(a: dict, b: dict, top: int = 40) -> list[tuple[str, float, float, float, float]]:
    """(kernel, µs a step in a, in b, calls a step in a, in b), the largest difference first."""
    ka, kb = a["kernels_us_per_step"], b["kernels_us_per_step"]
    ca, cb = a.get("kernel_calls_per_step", {}), b.get("kernel_calls_per_step", {})
    names = sorted(set(ka) | set(kb), key=lambda n: (-abs(ka.get(n, 0.0) - kb.get(n, 0.0)), n))
    return [(n, ka.get(n, 0.0), kb.get(n, 0.0), ca.get(n, 0.0), cb.get(n, 0.0)) for n in names[:top]]


def markdown(label_a: str, a: dict, label_b: str, b: dict, top: int = 40) -> str:
    lines = [f"# {label_a} against {label_b}, per step", "", "| | " + label_a + " | " + label_b + " | difference |",
             "|---|---|---|---|"]
    for key in TOTALS:
        if key in a or key in b:
            x, y = a.get(key), b.get(key)
            delta = f"{x - y:+.1f}" if x is not None and y is not None else "-"
            lines.append(f"| {key} | {'-' if x is None else f'{x:.1f}'} | {'-' if y is None else f'{y:.1f}'} | {delta} |")
    listed = sum(a["kernels_us_per_step"].values()), sum(b["kernels_us_per_step"].values())
    lines += [f"| kernels listed, µs | {listed[0]:.1f} | {listed[1]:.1f} | {listed[0] - listed[1]:+.1f} |", "",
              f"| kernel | µs {label_a} | µs {label_b} | difference | calls {label_a} | calls {label_b} |",
              "|---|---|---|---|---|---|"]
    for name, x, y, cx, cy in diff(a, b, top):
        lines.append(f"| `{name[:100]}` | {x:.1f} | {y:.1f} | {x - y:+.1f} | {cx:g} | {cy:g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.bench.kernel_diff")
    ap.add_argument("a", help="FILE[:SERVER[:LEVEL]] of a profile_step.json")
    ap.add_argument("b", help="the side to set it against, the same way")
    ap.add_argument("--top", type=int, default=40, help="kernels listed, the largest difference first")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error("--top is at least 1")
    (label_a, a), (label_b, b) = load_side(args.a), load_side(args.b)
    if label_a == label_b:
        label_a, label_b = f"A {label_a}", f"B {label_b}"
    print(markdown(label_a, a, label_b, b, args.top), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
