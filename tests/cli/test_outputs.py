"""Faults on the way out: a full disk, a missing or read-only directory, a write that fails halfway.

Each case must end in one line, `mlxllama: error: cannot write PATH: <reason>`, exit code 2, no
traceback, and lose no finished result. The full disk is Linux's /dev/full, written to by a real
process; a write that fails halfway is an injected OSError(ENOSPC) after part of a line reached the
file; a read-only file system is an injected OSError(EROFS), since the tests run as root, whom
permission bits do not stop. A run killed with kill -9 between writes is in tests/unit/test_batch.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mlxllama import files
from mlxllama.cli import main

from conftest import PACKAGE_DATA, REPO

has_dev_full = os.path.exists("/dev/full")
needs_dev_full = pytest.mark.skipif(not has_dev_full, reason="no /dev/full on this system")


def mlxllama(*args: str, stdout=subprocess.PIPE, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxllama", *args], cwd=REPO, stdout=stdout,
                          stderr=subprocess.PIPE, input=input, text=True)


def one_line(result, message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"mlxllama: error: {message}\n"


def write_prompts(path, count: int) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} plus {i}?"}) + "\n"
                            for i in range(count)))


@needs_dev_full
@pytest.mark.parametrize("args", [
    ["generate", "-p", "What is the capital of Japan?", "-n", "4"],
    ["generate", "-p", "What is the capital of Japan?", "-n", "4", "--json"],
    ["generate", "-p", "x", "-n", "2", "--compare-template"],
    ["inspect", str(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")],
    ["trace", "-p", "The capital of Italy is", "--no-template"],
], ids=["generate", "generate-json", "compare-template", "inspect", "trace"])
def test_a_full_disk_on_stdout_is_one_line(args):
    with open("/dev/full", "w") as full:
        one_line(mlxllama(*args, stdout=full), "cannot write <stdout>: No space left on device")


@needs_dev_full
def test_a_full_disk_ends_a_piped_chat_at_once():
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "mlxllama", "chat", "-n", "4"], cwd=REPO, stdout=full,
                                stderr=subprocess.PIPE, input="Hello\nMy name is Zoe.\n", text=True)
    one_line(result, "cannot write <stdout>: No space left on device")


@needs_dev_full
def test_a_full_disk_stops_batch_on_stdout_and_in_a_file(tmp_path):
    write_prompts(tmp_path / "in.jsonl", 2)
    with open("/dev/full", "w") as full:
        one_line(mlxllama("batch", str(tmp_path / "in.jsonl"), "-n", "2", stdout=full),
                 "cannot write <stdout>: No space left on device")
    # A device is written without being read back as results first (reading /dev/full never ends).
    one_line(mlxllama("batch", str(tmp_path / "in.jsonl"), "-n", "2", "-o", "/dev/full"),
             "cannot write /dev/full: No space left on device")


def test_output_paths_are_checked_before_the_model_loads(tmp_path):
    """A missing directory for --out or --dump is reported first: the model named here does not exist."""
    write_prompts(tmp_path / "in.jsonl", 1)
    missing = tmp_path / "no" / "such" / "dir"
    one_line(mlxllama("batch", str(tmp_path / "in.jsonl"), "-m", str(tmp_path / "absent.gguf"),
                      "-o", str(missing / "out.jsonl")), f"cannot write {missing / 'out.jsonl'}: No such file or directory")
    one_line(mlxllama("trace", "-p", "x", "-m", str(tmp_path / "absent.gguf"), "--dump", f"{tmp_path}/in.jsonl/d"),
             f"cannot write {tmp_path}/in.jsonl/d: Not a directory")
    one_line(mlxllama("batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "in.jsonl")),
             f"--out {tmp_path / 'in.jsonl'} is the input file: its prompts would be read as finished results")
    assert not missing.exists()


def test_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "results.jsonl"
    real_open = open

    def read_only(path, *args, **kwargs):
        if str(path) == str(out):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    write_prompts(tmp_path / "in.jsonl", 1)
    monkeypatch.setattr("builtins.open", read_only)
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "in.jsonl"), "-o", str(out)])
    assert (result.exit_code, result.stderr) == (2, f"mlxllama: error: cannot write {out}: Read-only file system\n")


def test_a_batch_stopped_by_a_full_disk_keeps_every_complete_line_and_resumes(tmp_path, monkeypatch):
    """The third result fails halfway through its line: the two before it stay, and the same
    command, run again with space, drops the half line and finishes with every id once, in order."""
    write_prompts(tmp_path / "in.jsonl", 5)
    out = tmp_path / "out.jsonl"
    command = ["batch", str(tmp_path / "in.jsonl"), "-o", str(out), "-n", "4", "-b", "2"]
    real_write, writes = files.CheckedStream.write, []

    def disk_fills(self, text):
        if self.name == str(out) and len(writes) == 2:
            real_write(self, text[: len(text) // 2])
            self.stream.flush()
            raise files.WriteError(self.name, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        writes.append(text)
        return real_write(self, text)

    monkeypatch.setattr(files.CheckedStream, "write", disk_fills)
    result = CliRunner().invoke(main, command)
    assert (result.exit_code, result.stderr) == (2, f"mlxllama: error: cannot write {out}: No space left on device\n")
    kept = out.read_text()
    assert [json.loads(line)["id"] for line in kept.splitlines()[:2]] == ["p0", "p1"]
    assert not kept.endswith("\n")  # the half line the full disk left

    monkeypatch.setattr(files.CheckedStream, "write", real_write)
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"p{i}" for i in range(5)]
    assert re.search(r"^already done +2$", result.stderr, re.M) and re.search(r"^done +3$", result.stderr, re.M)


def test_resume_refuses_what_is_not_a_results_file_reading_a_line_at_a_time(tmp_path, monkeypatch):
    write_prompts(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    out.write_text("some notes\n")
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "in.jsonl"), "-o", str(out)])
    assert (result.exit_code, result.stderr) == (
        2, f"mlxllama: error: {out}:1: not a result line, so this is not a results file to resume\n")
    # A "line" longer than any result is refused before it is read whole.
    monkeypatch.setattr("mlxllama.batch_jobs.MAX_RESULT_LINE", 1 << 10)
    out.write_text("x" * 5000)
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "in.jsonl"), "-o", str(out)])
    assert result.stderr == f"mlxllama: error: {out}:1: a line of over 0 MiB, so this is not a results file to resume\n"


def chat(*lines: str) -> subprocess.CompletedProcess:
    return mlxllama("chat", "-n", "8", input="".join(line + "\n" for line in lines))


def test_save_replaces_a_regular_file_atomically_and_follows_a_link(tmp_path):
    target = tmp_path / "transcripts" / "zoe.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    result = chat("My name is Zoe.", f"/save {link}")
    assert result.returncode == 0 and result.stderr.endswith(f"[saved {link}]\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    saved = json.loads(target.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["zoe.json"]  # no temporary file left


@pytest.mark.parametrize("where, reason", [("directory", "is a directory"), ("device", "not a regular file"),
                                           ("missing", "No such file or directory")])
def test_save_refuses_what_is_not_a_regular_file(tmp_path, where, reason):
    path = {"directory": str(tmp_path), "device": "/dev/null", "missing": f"{tmp_path}/no/t.json"}[where]
    result = chat("Hello", f"/save {path}")
    assert result.returncode == 2
    assert f"mlxllama: error: cannot write {path}: {reason}\n" in result.stderr and "[saved" not in result.stderr
    if where == "device":
        assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


@pytest.mark.parametrize("args, message", [
    (["inspect", str(REPO)], f"Invalid value for 'MODEL': File '{REPO}' is a directory. (see 'mlxllama inspect --help')"),
    (["trace", "--compare", str(REPO), "/missing"],
     "Invalid value for '--compare': Directory '/missing' does not exist. (see 'mlxllama trace --help')"),
    (["generate"], "Missing option '--prompt' / '-p'. (see 'mlxllama generate --help')"),
    (["generate", "-p", "x", "--temperature", "hot"],
     "Invalid value for '--temperature' / '--temp' / '-t': 'hot' is not a valid float range. "
     "(see 'mlxllama generate --help')"),
    (["chat", "--bogus"], "No such option '--bogus'. (see 'mlxllama chat --help')"),
    (["frobnicate"], "No such command 'frobnicate'. (see 'mlxllama --help')"),
    (["generate", "-p", "x", "--no-template", "--template", "chatml"],
     "--no-template and --template exclude each other: give one template source"),
    (["chat", "--template", "chatml", "--template-file", "t.jinja"],
     "--template and --template-file exclude each other: give one template source"),
])
def test_usage_errors_are_one_line_naming_the_option(args, message):
    result = CliRunner().invoke(main, args)
    assert (result.exit_code, result.stderr) == (2, f"mlxllama: error: {message}\n")


def test_counts_agree_with_their_nouns(tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("Hi")
    result = CliRunner().invoke(main, ["perplexity", str(text), "--ctx", "8"])
    assert result.stderr == ("mlxllama: error: the text is 2 tokens; perplexity with --ctx 8 needs at least 16"
                             " (two chunks)\n")
    result = CliRunner().invoke(main, ["trace", "-p", "", "--no-template"])
    assert "prompt of 1 token\n" in result.stdout
