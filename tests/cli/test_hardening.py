"""A prompt longer than the context, and Ctrl-C during generate and chat (batch's is in test_batch.py)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from functools import lru_cache

import pytest
from click.testing import CliRunner

import mlxllama
from conftest import find_fixture_model
from mlxllama.chat import ChatSession
from mlxllama.cli import main
from mlxllama.generate import truncate_prompt
from mlxllama.prompt import build_prompt, choose_template, messages_for

MODEL = str(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
CONTEXT = 512
# About 5 tokens a sentence: well over the context.
LONG_PROMPT = "The capital of France is Paris. " * 150 + "The capital of Italy is"
# Nearly uniform sampling: replies run to --max-tokens instead of ending early, leaving time to interrupt.
RAMBLING = ["--temperature", "10", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", "3", "-n", "80"]
COMMAND = [sys.executable, "-c", "from mlxllama.cli import main; main()"]


@lru_cache(maxsize=1)
def chat_tiny():
    return mlxllama.load(MODEL)


@pytest.fixture
def cli(monkeypatch):
    runtime = chat_tiny()
    monkeypatch.setattr("mlxllama.cli.load_model", lambda path: runtime)
    return lambda *args: CliRunner().invoke(main, list(args))


def test_truncation_policy():
    ids = [1] + list(range(100, 700))
    kept = truncate_prompt(ids, CONTEXT, 64, bos_id=1)
    assert kept == [1] + ids[-(CONTEXT - 64 - 1):]
    # The reply gets at most half the context; a prompt that leaves room is kept whole.
    assert len(truncate_prompt(ids, CONTEXT, 10_000, bos_id=1)) == CONTEXT // 2
    assert truncate_prompt(ids[:400], CONTEXT, 64, bos_id=1) == ids[:400]
    # Without BOS in front (or a vocabulary without one) only the tail is kept.
    assert truncate_prompt(ids[1:], CONTEXT, 64, bos_id=1) == ids[-(CONTEXT - 64):]
    assert truncate_prompt(ids, CONTEXT, 64, bos_id=None) == ids[-(CONTEXT - 64):]


def test_prompt_longer_than_the_context_is_a_clear_error(cli):
    result = cli("generate", "-p", LONG_PROMPT, "--no-template", "-n", "4")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == ("mlxllama: error: prompt is 1056 tokens, more than the model's context of 512; "
                             "shorten it or pass --truncate to drop its start\n")


def test_truncate_keeps_bos_and_the_end_of_the_prompt(cli):
    runtime = chat_tiny()
    result = cli("generate", "-p", LONG_PROMPT, "--no-template", "-n", "8", "--truncate", "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ("[prompt truncated: dropped 552 of its 1056 tokens from the start, "
                             "kept 504 of the context's 512]\n")
    payload = json.loads(result.stdout)
    full = runtime.tokenize(LONG_PROMPT)
    assert payload["prompt_ids"] == [runtime.tokenizer.bos_id] + full[-(CONTEXT - 8 - 1):]
    assert len(payload["token_ids"]) == 8  # room was left for the whole reply


def test_truncate_with_a_template_keeps_the_generation_prompt():
    runtime = chat_tiny()
    prompt = build_prompt(runtime.tokenizer, choose_template(runtime.chat_template), messages_for(LONG_PROMPT))
    kept = truncate_prompt(prompt.ids, CONTEXT, 8, runtime.tokenizer.bos_id)
    assert len(kept) == CONTEXT - 8 and kept[0] == runtime.tokenizer.bos_id
    # The end of the user's message, its </s>, and "<|assistant|>" after it.
    assert kept[-12:] == prompt.ids[-12:] and 2 in kept[-12:]


def zoe_session() -> ChatSession:
    runtime = chat_tiny()
    return ChatSession(runtime, choose_template(runtime.chat_template), max_tokens=32)


def test_an_interrupted_reply_leaves_the_conversation_as_it_was(tmp_path):
    session = zoe_session()
    first = "".join(session.send("My name is Zoe."))
    before = session.conversation()
    reply = session.send("What is the capital of Japan?")
    next(reply)  # the reply has begun
    with pytest.raises(KeyboardInterrupt):
        reply.throw(KeyboardInterrupt)  # Ctrl-C arriving while the reply streams
    assert session.conversation() == before
    session.save(str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text())["messages"] == before
    # The next turn sees exactly the conversation an uninterrupted session has.
    again = "".join(session.send("What is the capital of Japan?"))
    fresh = zoe_session()
    assert "".join(fresh.send("My name is Zoe.")) == first
    assert "".join(fresh.send("What is the capital of Japan?")) == again == "The capital of Japan is Tokyo."


def test_ctrl_c_while_saving_keeps_the_old_transcript(tmp_path, monkeypatch):
    session = zoe_session()
    path = tmp_path / "t.json"
    session.save(str(path))
    old = path.read_text()
    "".join(session.send("My name is Zoe."))

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr("mlxllama.files.os.fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.save(str(path))
    assert path.read_text() == old
    assert os.listdir(tmp_path) == ["t.json"]  # no temporary file left behind


def wait_for(stream, marker: bytes, timeout: float = 60) -> None:
    """Read the unbuffered `stream` until `marker` has come (and at least one byte), or fail after `timeout` s."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not seen or marker not in seen:
        ready, _, _ = select.select([stream], [], [], max(deadline - time.monotonic(), 0))
        byte = stream.read(1) if ready else b""
        assert byte, f"{marker!r} did not come within {timeout} s; read {seen!r}"
        seen += byte


def start(*args: str, **pipes) -> subprocess.Popen:
    # Unbuffered bytes, so that select() sees exactly what has not been read yet. Ctrl-C as a
    # terminal gives it: a suite started in the background (`pytest &`, where the shell ignores
    # SIGINT and every child inherits that) would otherwise start Python without its handler.
    return subprocess.Popen(COMMAND + list(args), bufsize=0, preexec_fn=default_ctrl_c,
                            **{name: subprocess.PIPE for name in pipes})


def default_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_chat_reply_stops_only_the_reply(tmp_path):
    process = start("chat", "--model", MODEL, *RAMBLING, stdin=True, stdout=True, stderr=True)
    process.stdin.write(b"Tell me a story.\n")
    wait_for(process.stdout, b"")  # the reply has begun to stream
    process.send_signal(signal.SIGINT)
    rest = f"/save {tmp_path / 'a.json'}\nMy name is Zoe.\n/save {tmp_path / 'b.json'}\n"
    stdout, stderr = (out.decode() for out in process.communicate(rest.encode(), timeout=120))
    assert process.returncode == 0, stderr
    assert "[reply stopped]" in stderr
    assert json.loads((tmp_path / "a.json").read_text())["messages"] == []
    messages = json.loads((tmp_path / "b.json").read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "My name is Zoe."
    assert stdout.endswith(messages[1]["content"] + "\n")


def test_ctrl_c_during_generate_json_prints_no_partial_json():
    process = start("generate", "--model", MODEL, "-p", "Tell me a story.", "--json", "--show-prompt", *RAMBLING,
                    stdout=True, stderr=True)
    wait_for(process.stderr, b"token ids ---\n")  # the prompt is ready: generation is next
    # MLX's first computation runs system("g++ --version"), which ignores SIGINT for its few
    # milliseconds; a Ctrl-C lost there is pressed again, as a user would.
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and stdout == b""
    assert stderr.endswith(b"mlxllama: interrupted\n")
