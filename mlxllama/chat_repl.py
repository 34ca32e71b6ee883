"""The `mlxllama chat` loop: read a message, run a /command or send it to the ChatSession, print the reply.

At a terminal, messages are read with a line editor (line_editor.py): cursor movement, history
kept across sessions, multi-line messages; Ctrl-C clears the line at the prompt and stops a reply
while it streams. From a pipe it reads one message per line and exits 2 if any line failed, so a
script learns of it.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TextIO

import click

from .chat import ChatSession
from .distributed import launched, share, world
from .errors import MlxLlamaError
from .files import STDOUT, WriteError
from .line_editor import open_line_editor
from .speculative import acceptance_note

CHAT_HELP = """commands: /reset (forget the conversation), /system TEXT (set the system message; empty clears it),
/history (show the conversation), /save FILE (write a JSON transcript), /quit (or Ctrl-D).
A line ending in \\ continues on the next (so does Alt-Enter, with the line editor); pasted text
keeps its newlines. Ctrl-C clears the line, or stops the current reply."""


def run_chat(session: ChatSession, stdin: TextIO) -> int:
    """Chat until /quit or the end of input; the exit code."""
    interactive = stdin.isatty()
    if interactive:
        editor = open_line_editor()
        click.echo(f"mlxllama chat: {os.path.basename(session.runtime.path)}, template {session.template.label}"
                   f" ({editor.description}). {CHAT_HELP}", err=True)
    read = editor.read if interactive else piped_reader(stdin)
    if launched():
        read = rank0_reader(read)
    failed = False
    while True:
        try:
            line = read()
        except EOFError:
            click.echo("", err=True)  # Ctrl-D: end the prompt's line before the shell's
            break
        except KeyboardInterrupt:
            continue  # the line is cleared; a new prompt follows
        if line is None:
            break
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if run_command(session, line):
                    break
                continue
            drafts = session.speculation and (session.speculation.drafted, session.speculation.accepted)
            for piece in session.send(line):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            if drafts and session.speculation.drafted > drafts[0]:
                click.echo(acceptance_note(session.speculation.drafted - drafts[0],
                                           session.speculation.accepted - drafts[1]), err=True)
        except KeyboardInterrupt:
            click.echo("\n[reply stopped]", err=True)
        except MlxLlamaError as e:
            if isinstance(e, WriteError) and e.path == STDOUT:
                raise  # the replies have nowhere to go
            # One bad line or command should not end the conversation, but a script should learn of it.
            click.echo(f"mlxllama: error: {e}", err=True)
            failed = True
    return 2 if failed and not interactive else 0


def piped_reader(stdin: TextIO) -> Callable[[], str | None]:
    """One message a line of a pipe; None at its end."""

    def read() -> str | None:
        line = stdin.readline()
        return line.removesuffix("\n") if line else None

    return read


def rank0_reader(read: Callable[[], str | None]) -> Callable[[], str | None]:
    """Under mlx.launch: rank 0 reads each message and every rank gets it (None at the end)."""

    def read_shared() -> str | None:
        line = None
        if world().is_root:
            try:
                line = read()
            except EOFError:
                pass
        return share(line)

    return read_shared


def run_command(session: ChatSession, line: str) -> bool:
    """Carry out a /command; True means quit."""
    command, _, argument = line.partition(" ")
    argument = argument.strip()
    if command in ("/quit", "/exit"):
        return True
    if command == "/reset":
        session.reset()
        click.echo("[conversation reset]", err=True)
    elif command == "/system":
        session.set_system(argument)
        click.echo(f"[system message {'set' if argument else 'cleared'}]", err=True)
    elif command == "/history":
        conversation = session.conversation()
        if not conversation:
            click.echo("[no messages yet]", err=True)
        for message in conversation:
            click.echo(f"{message['role']}: {message['content']}")
    elif command == "/save":
        if not argument:
            raise MlxLlamaError("/save needs a file name")
        if world().is_root:
            session.save(argument)
        click.echo(f"[saved {argument}]", err=True)
    else:
        click.echo(f"[unknown command {command}; the commands are /reset, /system, /history, /save, /quit]", err=True)
    return False
