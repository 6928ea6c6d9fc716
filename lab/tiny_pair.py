"""The tiny float32 target/draft pair the lab's GPU checks share, made once per machine.

    python lab/tiny_pair.py [DIR]      (default /tmp/dflash-tiny): makes it if absent, prints its folders

The lab scripts import :func:`ensure_tiny_pair` (this folder is on their path when run as scripts).
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = "/tmp/dflash-tiny"


def ensure_tiny_pair(tiny_dir: str = DEFAULT_DIR) -> tuple[str, str, int]:
    """``(target, draft, vocab_size)`` of the pair in ``tiny_dir``, made by scripts/make_tiny_pair.py if absent."""
    target, draft = os.path.join(tiny_dir, "target"), os.path.join(tiny_dir, "draft")
    if not os.path.exists(os.path.join(draft, "model.safetensors")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_pair.py"), tiny_dir],
                       check=True, capture_output=True)
    with open(os.path.join(draft, "config.json")) as f:
        return target, draft, json.load(f)["vocab_size"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", nargs="?", default=DEFAULT_DIR, help=f"where the pair lives (default {DEFAULT_DIR})")
    target, draft, vocab = ensure_tiny_pair(parser.parse_args().dir)
    print(f"target {target}\ndraft {draft}\nvocab {vocab}")


if __name__ == "__main__":
    main()
