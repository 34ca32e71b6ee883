"""Reading chat messages at a terminal: a line editor with history kept across sessions.

prompt_toolkit (the `chat` extra: `pip install "mlxllama[chat]"`) gives cursor movement, history,
pasted text that keeps its newlines, Alt-Enter for a new line, and a backslash at the end of a
line to continue on the next. Without it the standard library's readline gives cursor movement,
history and the backslash continuation. Either way Ctrl-C at the prompt clears the line
(KeyboardInterrupt) and Ctrl-D ends the chat (EOFError).

History lives in the user's data directory (history_path), one file for every chat.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROMPT, CONTINUATION = ">>> ", "... "
HISTORY_ENV = "MLXLLAMA_HISTORY"  # another history file; empty: keep none


def history_path() -> Path | None:
    """$MLXLLAMA_HISTORY, else chat_history in the user's data directory (XDG on Linux, Application
    Support on macOS); None when the variable is set empty."""
    if HISTORY_ENV in os.environ:
        return Path(os.environ[HISTORY_ENV]) if os.environ[HISTORY_ENV] else None
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "mlxllama" / "chat_history"


def joined_continuations(first: str, read_more) -> str:
    """A message of one line, or of several where each but the last ends in a backslash (removed)."""
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(read_more())
    return "\n".join(lines)


class ToolkitEditor:
    description = "line editor: prompt_toolkit"

    def __init__(self, history: Path | None, **session_options):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _(event):
            event.current_buffer.insert_text("\n")

        @bindings.add("enter")
        def _(event):
            buffer = event.current_buffer
            if buffer.document.text_before_cursor.endswith("\\") and buffer.document.is_cursor_at_the_end:
                buffer.delete_before_cursor(1)
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        self.session = PromptSession(history=FileHistory(str(history)) if history else InMemoryHistory(),
                                     key_bindings=bindings, prompt_continuation=CONTINUATION, **session_options)

    def read(self) -> str:
        return self.session.prompt(PROMPT)


class ReadlineEditor:
    description = "line editor: readline"

    def __init__(self, history: Path | None):
        import readline

        self.readline, self.history = readline, history
        if history and history.is_file():
            readline.read_history_file(history)

    def read(self) -> str:
        message = joined_continuations(input(PROMPT), lambda: input(CONTINUATION))
        if self.history:
            self.readline.write_history_file(self.history)
        return message


class PlainInput:
    description = "no line editor: pip install 'mlxllama[chat]' for one"

    def read(self) -> str:
        return joined_continuations(input(PROMPT), lambda: input(CONTINUATION))


def open_line_editor(history: Path | None = None, **session_options) -> ToolkitEditor | ReadlineEditor | PlainInput:
    """The best editor installed, its history in `history` (default: history_path()), whose
    directory is made if need be; a history that cannot be kept is left out, not an error."""
    history = history_path() if history is None else history
    if history is not None:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            history.touch()
        except OSError:
            history = None
    try:
        return ToolkitEditor(history, **session_options)
    except ImportError:
        pass
    try:
        return ReadlineEditor(history)
    except ImportError:
        return PlainInput()
