"""Writing a file so that an interruption (Ctrl-C, a crash, a full disk) leaves the old content or the new, not half."""

from __future__ import annotations

import os


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it over `path`.

    The rename is atomic on POSIX and Windows alike, so a reader never sees a partial file; the
    temporary file is removed if anything goes wrong before it.
    """
    temp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
