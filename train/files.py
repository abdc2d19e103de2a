"""Output files: their folder checked before the work, each file written whole (a reader, or a
run killed meanwhile, sees the old file or the new)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


def check_writable(folder: str | Path, name: str = "") -> Path:
    """`folder` where files can be written into it (once the part of it that is missing is made),
    else an error that names it and the setting `name`: a bad output path fails before the work,
    not after it. It makes nothing, so a command refused for another reason leaves no empty folder."""
    folder = Path(folder)
    there = folder
    while not there.exists() and there.parent != there:  # the folder as far as it exists
        there = there.parent
    if not there.is_dir():
        reason = "a file, not a folder" if there == folder else f"{there} is a file"
    elif not os.access(there, os.W_OK):
        reason = "not writable" if there == folder else f"{there} is not writable"
    else:
        return folder
    raise OSError(f"{name + ': ' if name else ''}{folder}: cannot write files there ({reason})")


@contextmanager
def open_atomic(path: str | Path, newline: str | None = None) -> Iterator[TextIO]:
    """A text file to write `path` through, making its folder: a temporary file beside it, renamed
    over it once the block ends, removed if the block fails. The file gets the permissions
    `write_text` would give it (`tempfile.mkstemp` would make it private)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w", newline=newline) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: leave no temporary file beside the old one
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` whole (`open_atomic`)."""
    with open_atomic(path) as f:
        f.write(text)
    return Path(path)
