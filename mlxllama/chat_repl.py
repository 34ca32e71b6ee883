"""The `mlxllama chat` loop: read a line, run a /command or send it to the ChatSession, print the reply.

Interactive on a terminal (a prompt, Ctrl-C stops the current reply); from a pipe it reads one
message per line and exits 2 if any line failed, so a script learns of it.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

import click

from .chat import ChatSession
from .errors import MlxLlamaError

CHAT_HELP = """commands: /reset (forget the conversation), /system TEXT (set the system message; empty clears it),
/history (show the conversation), /save FILE (write a JSON transcript), /quit (or Ctrl-D).
Ctrl-C stops the current reply."""


def run_chat(session: ChatSession, stdin: TextIO) -> int:
    """Chat until /quit or the end of input; the exit code."""
    interactive = stdin.isatty()
    failed = False
    if interactive:
        click.echo(f"mlxllama chat: {os.path.basename(session.runtime.path)}, template {session.template.label}."
                   f" {CHAT_HELP}", err=True)
    while True:
        try:
            line = input(">>> ") if interactive else stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("", err=True)
            continue
        if not interactive and not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if run_command(session, line):
                    break
                continue
            for piece in session.send(line):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
        except KeyboardInterrupt:
            click.echo("\n[reply stopped]", err=True)
        except MlxLlamaError as e:
            # One bad line or command should not end the conversation, but a script should learn of it.
            click.echo(f"mlxllama: error: {e}", err=True)
            failed = True
    return 2 if failed and not interactive else 0


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
        for message in session.conversation():
            click.echo(f"{message['role']}: {message['content']}")
    elif command == "/save":
        if not argument:
            raise MlxLlamaError("/save needs a file name")
        session.save(argument)
        click.echo(f"[saved {argument}]", err=True)
    else:
        click.echo(f"[unknown command {command}; {CHAT_HELP}]", err=True)
    return False
