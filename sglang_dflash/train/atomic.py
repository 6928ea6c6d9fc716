"""Files that are either the old version or the complete new one, never half written.

A kill or a full disk during a checkpoint write must not cost the previous checkpoint: the new
bytes go to a temporary file in the same folder (``os.replace`` is atomic only within one file
system), are fsynced, and only then replace the old file; the folder is fsynced so the rename
itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` fills a temporary file beside ``path``, which replaces ``path`` once complete."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened and synced
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_text_atomically(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    write_atomically(path, write)
