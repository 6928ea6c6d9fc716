"""Progress bars with done/total and an ETA for the slow phases; quiet when tqdm is not installed."""

from __future__ import annotations

import sys


class _Quiet:
    """What the trainer calls on a bar, doing nothing but still printing ``write`` lines."""

    def __init__(self, total: int = 0, initial: int = 0, **_):
        self.total, self.n = total, initial

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *_, **__) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, file=sys.stderr)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress_bar(total: int, desc: str, initial: int = 0, leave: bool = True):
    """A tqdm bar on stderr (done/total, rate and ETA), or a quiet stand-in without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Quiet(total=total, initial=initial)
    return tqdm(total=total, initial=initial, desc=desc, leave=leave, file=sys.stderr, dynamic_ncols=True)
