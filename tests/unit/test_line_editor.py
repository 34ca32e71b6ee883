"""`mlxllama chat`'s line editor: keys as a terminal sends them, history across sessions, and one
real chat in a real terminal (tmux)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from mlxllama.line_editor import ToolkitEditor, history_path, joined_continuations, open_line_editor

from conftest import REPO

LEFT, UP, PASTE_START, PASTE_END = "\x1b[D", "\x1b[A", "\x1b[200~", "\x1b[201~"


def typed(history, keys: str) -> str:
    """What one prompt returns after these keys, in a session keeping its history in `history`."""
    with create_pipe_input() as keyboard:
        editor = open_line_editor(history, input=keyboard, output=DummyOutput())
        assert isinstance(editor, ToolkitEditor)
        keyboard.send_text(keys)
        return editor.read()


def test_cursor_movement_edits_inside_the_line(tmp_path):
    assert typed(tmp_path / "history", f"helo{LEFT}l\r") == "hello"


def test_history_is_kept_across_sessions_in_the_data_directory(tmp_path):
    history = tmp_path / "data" / "mlxllama" / "chat_history"
    typed(history, "What is 17 plus 25?\r")
    typed(history, "My name is Zoe.\r")
    # A new session: up twice recalls the first message.
    assert typed(history, f"{UP}{UP}\r") == "What is 17 plus 25?"
    assert history.is_file()


def test_multi_line_messages(tmp_path):
    history = tmp_path / "history"
    assert typed(history, f"{PASTE_START}line one\nline two{PASTE_END}\r") == "line one\nline two"
    assert typed(history, "first \\\rsecond\r") == "first \nsecond"  # a backslash at the end continues
    assert typed(history, "a\x1b\rb\r") == "a\nb"  # Alt-Enter


def test_ctrl_c_clears_the_line_and_ctrl_d_ends(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        typed(tmp_path / "history", "half a thought\x03")
    with pytest.raises(EOFError):
        typed(tmp_path / "history", "\x04")


def test_history_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.delenv("MLXLLAMA_HISTORY", raising=False)
    if sys.platform != "darwin":
        assert history_path() == tmp_path / "mlxllama" / "chat_history"
    monkeypatch.setenv("MLXLLAMA_HISTORY", "")
    assert history_path() is None


def test_backslash_continuation_without_prompt_toolkit():
    more = iter(["second \\", "third"])
    assert joined_continuations("first \\", lambda: next(more)) == "first \nsecond \nthird"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_chat_in_a_real_terminal(tmp_path):
    """Left arrow and up arrow in a real terminal edit and recall, and never reach the model as text."""
    session = f"mlxllama-test-{time.time_ns()}"
    env = f"MLXLLAMA_HISTORY={tmp_path / 'history'} PYTHONPATH={REPO}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                    f"env {env} {sys.executable} -m mlxllama chat -n 16"], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(text: str, seconds: float = 60) -> str:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if text in (shown := screen()):
                return shown
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared:\n{screen()}")

    try:
        wait_for(">>>")  # capture-pane drops trailing spaces
        # "My nme is Zoe.", then the cursor back 10 places, to after "My n", and the missing "a".
        subprocess.run(["tmux", "send-keys", "-t", session, "My nme is Zoe.", *["Left"] * 10, "a", "Enter"], check=True)
        wait_for("today?\n>>>")
        subprocess.run(["tmux", "send-keys", "-t", session, "Up", "Enter"], check=True)
        shown = wait_for("today?\n>>> My name is Zoe.\nNice to meet you, Zoe! How can I help you today?\n>>>")
        assert ">>> My name is Zoe.\n" in shown and "^[[" not in shown
        subprocess.run(["tmux", "send-keys", "-t", session, "/history", "Enter"], check=True)
        wait_for("user: My name is Zoe.")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "My name is Zoe." in (tmp_path / "history").read_text()
