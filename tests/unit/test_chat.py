"""`mlxllama chat` and the KV-cache-backed chat session."""

import json
from functools import lru_cache

from click.testing import CliRunner

import mlxllama
from mlxllama.chat import ChatSession
from mlxllama.cli import main
from mlxllama.prompt import choose_template
from conftest import find_fixture_model


@lru_cache(maxsize=1)
def chat_tiny():
    return mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))


def session(**kwargs) -> ChatSession:
    m = chat_tiny()
    return ChatSession(m, choose_template(m.chat_template), **kwargs)


def test_two_turns_through_a_pipe():
    result = CliRunner().invoke(main, ["chat"], input="What is the capital of Japan?\nWhat is 17 plus 25?\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "The capital of Japan is Tokyo.\n17 plus 25 is 42.\n"


def held(chat: ChatSession) -> list[int]:
    """The token ids of the conversation's entry in the prompt cache: what its KV cache holds."""
    [entry] = chat.prompt_cache.entries
    return list(entry.ids)


def test_second_turn_feeds_only_the_new_suffix():
    chat = session()
    first = "".join(chat.send("What is the capital of Japan?"))
    assert first == "The capital of Japan is Tokyo."
    after_first = held(chat)
    buffers = [keys for keys, _ in chat.prompt_cache.entries[0].layers]
    second = "".join(chat.send("What is 17 plus 25?"))
    assert second == "17 plus 25 is 42."
    prompt_ids = held(chat)[: len(held(chat)) - len(chat.last_result.token_ids)]
    # The whole first turn (prompt, answer and its EOS) is reused from the cache...
    assert prompt_ids[: len(after_first)] == after_first and chat.last_cached == len(after_first)
    # ...so turn two feeds only its new prompt suffix plus its reply,
    assert chat.last_fed == len(prompt_ids) - len(after_first) + len(chat.last_result.token_ids)
    # into the same buffers (no copy between turns: both turns fit the first 256 slots).
    assert [keys.shape for keys, _ in chat.prompt_cache.entries[0].layers] == [b.shape for b in buffers]
    assert chat.prompt_cache.nbytes == sum(k.nbytes + v.nbytes for k, v in chat.prompt_cache.entries[0].layers)


def test_a_reset_chat_reuses_its_system_prompt_from_the_prompt_cache():
    chat = session(system="You answer questions.")
    "".join(chat.send("What is the capital of Japan?"))
    chat.reset()
    second = "".join(chat.send("What is 17 plus 25?"))
    # The 22 tokens both conversations start with (BOS, the system turn, "<|user|>\nWhat is") come
    # from the cache; the rest of the question on is fed.
    assert chat.last_cached == len(held(chat)) - chat.last_fed == 22
    fresh = session(system="You answer questions.")
    assert "".join(fresh.send("What is 17 plus 25?")) == second and fresh.last_cached == 0


def test_changed_history_re_prefills_from_the_first_difference():
    chat = session()
    "".join(chat.send("What is the capital of Japan?"))
    chat.set_system("Be brief.")
    assert "".join(chat.send("What is 17 plus 25?")) == "17 plus 25 is 42."
    # A system message changes the rendering near its start: only BOS, "▁<" and "|" (shared by
    # "<|system|>" and "<|user|>") are kept, the rest is fed again.
    assert held(chat)[:4] == [1, 529, 29989, 5205]
    assert chat.last_cached == 3 and chat.last_fed == len(held(chat)) - 3


def test_commands_history_system_save_reset(tmp_path):
    transcript = tmp_path / "t.json"
    lines = [
        "/system You answer questions.",
        "What is the capital of Japan?",
        "/history",
        f"/save {transcript}",
        "/reset",
        "/history",
        "/quit",
        "never read",
    ]
    result = CliRunner().invoke(main, ["chat"], input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "The capital of Japan is Tokyo.\n"
        "system: You answer questions.\n"
        "user: What is the capital of Japan?\n"
        "assistant: The capital of Japan is Tokyo.\n"
        "system: You answer questions.\n"
    )
    saved = json.loads(transcript.read_text())
    assert saved["template"] == "gguf (zephyr)"
    assert saved["messages"][1:] == [
        {"role": "user", "content": "What is the capital of Japan?"},
        {"role": "assistant", "content": "The capital of Japan is Tokyo."},
    ]


def test_full_context_drops_the_oldest_turns():
    notices = []
    chat = session(max_tokens=16, notify=notices.append)
    question = "What is the capital of Japan? " * 20
    for _ in range(4):
        "".join(chat.send(question.strip()))
    assert notices and notices[0].startswith("context full: dropped the oldest")
    assert len(held(chat)) < chat_tiny().config.context_length


def test_a_failing_line_is_reported_and_the_chat_goes_on(tmp_path):
    result = CliRunner().invoke(main, ["chat"], input=f"/save {tmp_path}/no/such/dir/t.json\nMy name is Zoe.\n")
    assert result.stdout == "Nice to meet you, Zoe! How can I help you today?\n"
    assert result.stderr == f"mlxllama: error: cannot write {tmp_path}/no/such/dir/t.json: No such file or directory\n"
    assert result.exit_code == 2


def test_a_rejected_message_leaves_the_conversation_as_it_was():
    chat = session()
    "".join(chat.send("What is the capital of Japan?"))
    before = list(chat.messages)
    try:
        "".join(chat.send("Japan " * 2000))
    except mlxllama.MlxLlamaError as e:
        assert "too long for the model's context of 512" in str(e)
    else:
        raise AssertionError("an over-long message was accepted")
    assert chat.messages == before
    assert "".join(chat.send("What is 17 plus 25?")) == "17 plus 25 is 42."
