"""Writing output so that no failure is confusing and nothing finished is lost.

Every write failure — a missing directory, a permission, a read-only file system, a full disk —
becomes one WriteError, `cannot write PATH: <reason>`, which the CLI prints as one line with exit
code 2. Output paths are checked before anything is computed for them, and a file replaced as a
whole (a chat transcript) is written beside it and renamed over it, so an interruption leaves the
old content or the new, never half.
"""

from __future__ import annotations

import os
import stat
from typing import IO, Any, Callable

from .errors import MlxLlamaError


class WriteError(MlxLlamaError):
    def __init__(self, path: str | os.PathLike, error: OSError | str):
        reason = error if isinstance(error, str) else error.strerror or str(error)
        self.path = os.fspath(path)
        super().__init__(f"cannot write {self.path}: {reason}")


STDOUT = "<stdout>"


class CheckedStream:
    """A text stream whose write and flush failures are WriteErrors naming `name`.

    A reader that went away (BrokenPipeError, as `| head` does) is left as it is: the CLI ends
    quietly then.
    """

    def __init__(self, stream: IO[str], name: str):
        self.stream, self.name = stream, name

    def write(self, text: str) -> int:
        return self._checked(self.stream.write, text)

    def flush(self) -> None:
        self._checked(self.stream.flush)

    def close(self) -> None:
        self._checked(self.stream.close)

    def _checked(self, operation, *args):
        try:
            return operation(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise WriteError(self.name, e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def open_for_append(path: str) -> CheckedStream:
    """`path` opened to append text lines, before any work is done for it; a WriteError if it cannot be."""
    if os.path.isdir(path):
        raise WriteError(path, "is a directory")
    try:
        return CheckedStream(open(path, "a", encoding="utf-8"), path)
    except OSError as e:
        raise WriteError(path, e) from None


def check_output_dir(path: str) -> None:
    """Make directory `path` (and its parents) and prove a file can be created in it."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".mlxllama-write-check-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except FileExistsError:
        raise WriteError(path, "is not a directory") from None
    except OSError as e:
        raise WriteError(path, e) from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace the regular file at `path` (following a symbolic link to its target) with `text`,
    atomically (replace_atomically)."""

    def write(temp: str) -> None:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    replace_atomically(path, write)


def replace_atomically(path: str | os.PathLike, write: Callable[[str], None], suffix: str = "") -> None:
    """Replace the regular file at `path` (following a symbolic link to its target) with what
    `write(temp)` writes to a temporary path (ending in `suffix`).

    The temporary file is beside the target and renamed over it: the rename is atomic, so a reader
    never sees a partial file, and the temporary file is removed if anything fails before it. A
    directory or a device at `path` is refused, never replaced.
    """
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise WriteError(path, e) from None
    if mode is not None and not stat.S_ISREG(mode):
        raise WriteError(path, "is a directory" if stat.S_ISDIR(mode) else "not a regular file")
    temp = f"{target}.{os.getpid()}.tmp{suffix}"
    try:
        write(temp)
        if mode is not None:
            os.chmod(temp, stat.S_IMODE(mode))
        os.replace(temp, target)
    except OSError as e:
        raise WriteError(path, e) from None
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
