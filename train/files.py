"""Writing a run's files whole: a reader, or a run killed meanwhile, sees the old file or the new."""
from __future__ import annotations

import os
from pathlib import Path


def writable_folder(folder: str | Path, name: str = "") -> Path:
    """`folder`, made if missing, or an error that names it (and the setting `name`) where files
    cannot be written there: a bad output path fails before the work rather than after it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        reason = None if os.access(folder, os.W_OK) else "not writable"
    except FileExistsError:
        reason = "a file, not a folder"
    except OSError as err:
        reason = err.strerror or str(err)
    if reason:
        raise OSError(f"{name + ': ' if name else ''}{folder}: cannot write files there ({reason})")
    return folder


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file renamed over it. The file gets the
    permissions `write_text` would give it (`tempfile.mkstemp` would make it private)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: leave no temporary file beside the old one
        tmp.unlink(missing_ok=True)
        raise
    return path
