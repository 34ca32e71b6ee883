"""The one exception type the CLI turns into a one-line message and exit code 2, and a parser that raises it."""

from __future__ import annotations

import json


class MlxLlamaError(Exception):
    """A problem with user input (a file, a template, a flag) that the user can fix."""


def count(n: int, noun: str) -> str:
    """"1 token", "2 tokens": a number with its noun, for messages."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def parse_json_object(text: str, source: str = "") -> dict:
    """`text` as a JSON object, else an MlxLlamaError of one line, prefixed with `source: ` when given.

    Used for `--template-kwargs` and for each line of a `batch` input file.
    """
    prefix = f"{source}: " if source else ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise MlxLlamaError(f"{prefix}not valid JSON ({e.msg} at column {e.colno})")
    except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
        raise MlxLlamaError(f"{prefix}not valid JSON ({str(e).splitlines()[0]})")
    if not isinstance(value, dict):
        raise MlxLlamaError(f"{prefix}expected a JSON object")
    return value
