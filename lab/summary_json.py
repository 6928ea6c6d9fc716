"""results/summary.json's layout: keys sorted, one space of indent, small values on one line.

A list or object at most two levels deep, such as ``[1.011, 1.045]`` or
``{"builtin": {"c1": 8.76}, "plugin": {"c1": 8.6}}``, stays on one line while that line is at most
``WIDTH`` characters wide. The file holds one figure per README claim within 30 KiB
(tests/test_docs.py), and a figure spread over one line per number spends that on indentation.

    python -m lab.summary_json results/summary.json    rewrites the file in this layout
    python -m lab.summary_json --check results/summary.json
"""

from __future__ import annotations

import argparse
import json
import sys

WIDTH = 120


def _depth(value) -> int:
    """Levels of lists and objects: 0 for a scalar, 1 for ``[1, 2]``, 2 for ``{"c1": [1, 2]}``."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _dumps(value, indent: int, room: int) -> str:
    if not isinstance(value, (list, dict)) or not value:
        return json.dumps(value, ensure_ascii=True)
    one_line = json.dumps(value, sort_keys=True, ensure_ascii=True)
    if _depth(value) <= 2 and len(one_line) <= room:
        return one_line
    pad = " " * (indent + 1)
    if isinstance(value, list):
        items = [pad + _dumps(v, indent + 1, WIDTH - len(pad) - 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    items = []
    for key in sorted(value):
        head = pad + json.dumps(key, ensure_ascii=True) + ": "
        items.append(head + _dumps(value[key], indent + 1, WIDTH - len(head) - 1))
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def dumps(summary: dict) -> str:
    """The file's text for ``summary``."""
    return _dumps(summary, 0, WIDTH) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="results/summary.json")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not in this layout, changing nothing")
    args = ap.parse_args(argv)
    try:
        with open(args.path) as f:
            text = f.read()
        summary = json.loads(text)
    except (OSError, ValueError) as e:
        ap.error(f"{args.path}: {e}")
    laid_out = dumps(summary)
    if args.check:
        if laid_out != text:
            print(f"{args.path} is not in summary_json's layout: python -m lab.summary_json {args.path}", file=sys.stderr)
            return 1
        return 0
    with open(args.path, "w") as f:
        f.write(laid_out)
    print(f"{args.path}: {len(laid_out.encode())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
