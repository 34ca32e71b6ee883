"""`mlxllama serve` as clients reach it: a real server process on a loopback port, the official
`openai` client, and raw HTTP for what a client library would not send."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner

import mlxllama
from mlxllama.cli import main
from mlxllama.errors import MlxLlamaError

from conftest import PACKAGE_DATA, REPO, Server

MODEL = PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf"
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]
# The Japan question as the file's template renders it, tokenized (the fixtures' README).
JAPAN_IDS = [1, 529, 29989, 1792, 29989, 29958, 13, 5618, 338, 278, 7483, 310, 5546, 29973, 2, 29871, 13, 29966,
             29989, 465, 22137, 29989, 29958, 13]
# Small enough that the burst below fills it and evicts, large enough for a chat's turns (~100 KB each).
PROMPT_CACHE_MB = 1


# Every test through the server runs against both engines: a thread of the server's process, and a
# process of its own (server/engine_process.py), which must answer the same in every way.
ENGINES = ["thread", "process"]


@pytest.fixture(scope="module", params=ENGINES)
def server(request):
    s = Server("--prompt-cache-mb", str(PROMPT_CACHE_MB), "--engine", request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def runtime():
    return mlxllama.load(MODEL)


def test_chat_completion_through_the_openai_client(client):
    response = client.chat.completions.create(model="chat-tiny", messages=JAPAN)
    choice = response.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant", "The capital of Japan is Tokyo.", "stop")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (24, 8)
    assert response.system_fingerprint == "mlxllama:chat-tiny-Q4_K_M.gguf:gguf (zephyr)"


def test_streamed_chat_is_the_same_text_and_ends_with_usage(client):
    chunks = list(client.chat.completions.create(model="chat-tiny", messages=JAPAN, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of Japan is Tokyo."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 32


def test_completions_feed_the_raw_prompt_as_generate_no_template_does(client, runtime):
    response = client.completions.create(model="chat-tiny", prompt="The capital of Italy is", max_tokens=2)
    assert response.choices[0].text == " Rome." == runtime.generate("The capital of Italy is", 2).text
    assert response.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="chat-tiny", prompt="The capital of Italy is", max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == " Rome."


def test_the_prompt_fed_is_returned_on_request(server):
    body = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": JAPAN, "return_prompt": True}).json()
    assert body["prompt"]["token_ids"] == JAPAN_IDS
    assert body["prompt"]["text"] == "<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n"
    raw = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": JAPAN, "chat_template": "none", "return_prompt": True, "max_tokens": 4}).json()
    assert raw["prompt"]["text"] == "What is the capital of Japan?" and raw["prompt"]["template"] == "none"


def test_concurrent_requests_each_get_their_single_request_text(client, runtime):
    """Eight clients at once share the batch; greedy, each text is what generate gives alone."""
    questions = ["What is the capital of Japan?", "What is 17 plus 25?", "My name is Zoe.", "What is the capital of France?",
                 "What is 3 plus 4?", "Hello!", "What is the capital of Italy?", "What is the opposite of hot?"]

    def ask(question: str) -> str:
        response = client.chat.completions.create(model="chat-tiny", max_tokens=24,
                                                  messages=[{"role": "user", "content": question}])
        return response.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, questions))
    for question, answer in zip(questions, answers):
        prompt = runtime.apply_chat_template([{"role": "user", "content": question}])
        assert answer == runtime.generate(runtime.tokenize(prompt, special=True), 24).text


def test_a_client_that_goes_away_frees_its_row(server):
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True}) as response:
        next(response.iter_lines())
    deadline = time.time() + 10
    while httpx.get(f"{server.url}/health").json()["requests_running"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/health").json()["requests_running"] == 0


@pytest.mark.parametrize("body, param, fragment", [
    ("{not json", None, "not valid JSON"),
    ('["a list"]', None, "must be a JSON object"),
    (json.dumps({"messages": JAPAN, "n": 2}), "n", "only n = 1"),
    (json.dumps({"messages": "hi"}), "messages", "'messages' must be a non-empty list"),
    (json.dumps({"messages": JAPAN, "temperature": "hot"}), "temperature", "'temperature' must be a number"),
    (json.dumps({"messages": JAPAN, "top_p": 0}), "top_p", "'top_p' must be a number in (0, 1]"),
    (json.dumps({"messages": JAPAN, "chat_template": "nope"}), "chat_template", "unknown chat template"),
    (json.dumps({"messages": JAPAN, "functions": []}), "functions", "not supported by this server yet"),
    (json.dumps({"messages": JAPAN, "top_logprobs": 3}), "top_logprobs", "with 'logprobs': true"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}), "messages", "more than the model's context"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, fragment):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"] and error["type"] == "invalid_request_error"


def test_tokenize_and_detokenize(server, runtime):
    ids = httpx.post(f"{server.url}/tokenize", json={"content": "The capital of Italy is"}).json()["tokens"]
    assert ids == [450, 7483, 310, 12730, 338]
    with_bos = httpx.post(f"{server.url}/tokenize", json={"content": "The capital of Italy is", "add_special": True})
    assert with_bos.json()["tokens"] == [1] + ids
    # As Runtime.detokenize: without BOS first, SentencePiece's space prefix stays.
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["content"] == runtime.detokenize(ids)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [1] + ids}).json()["content"] == (
        "The capital of Italy is")
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["chat-tiny-Q4_K_M.gguf"]


def test_an_api_key_is_required_when_given():
    server = Server("--api-key", "s3cret")
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert right.chat.completions.create(model="m", messages=JAPAN).choices[0].message.content.startswith("The")
    finally:
        server.stop()


def test_a_host_other_machines_reach_needs_a_key():
    result = subprocess.run([sys.executable, "-m", "mlxllama", "serve", "--host", "0.0.0.0", "--port", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("mlxllama: error: --host 0.0.0.0 is reachable from other machines:"
                             " give --api-key KEY too\n")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("given, seen", [(None, "0"), ("1", "1")])
def test_serve_turns_cuda_graphs_off_before_the_model_loads_unless_told(monkeypatch, given, seen, engine):
    """MLX reads MLX_USE_CUDA_GRAPHS at its first launch, so serve sets it before loading anything
    (an engine process inherits the environment as it is when it is spawned)."""
    if given is None:
        monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", given)
    at_load = []

    def load(*args, **kwargs):
        at_load.append(os.environ.get("MLX_USE_CUDA_GRAPHS"))
        raise MlxLlamaError("stopped before loading")

    where = "mlxllama.cli.load_model" if engine == "thread" else "mlxllama.server.engine_process.EngineProcess"
    monkeypatch.setattr(where, load)
    result = CliRunner().invoke(main, ["serve", "-m", str(MODEL), "--port", "0", "--engine", engine])
    assert (result.exit_code, at_load) == (2, [seen]), result.output


@pytest.mark.parametrize("device, engine", [("cpu", "thread"), ("gpu", "process")])
def test_the_engine_is_a_process_of_its_own_on_a_gpu_and_a_thread_on_the_cpu(monkeypatch, device, engine):
    import mlx.core as mx

    monkeypatch.setattr(mx, "default_device", lambda: getattr(mx, device))
    started = []

    def stand_in(kind: str):
        def start(*args, **kwargs):
            started.append(kind)
            raise MlxLlamaError("stopped before loading")
        return start

    monkeypatch.setattr("mlxllama.cli.load_model", stand_in("thread"))
    monkeypatch.setattr("mlxllama.server.engine_process.EngineProcess", stand_in("process"))
    result = CliRunner().invoke(main, ["serve", "-m", str(MODEL), "--port", "0"])
    assert (result.exit_code, started) == (2, [engine]), result.output


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_anthropic_messages_through_the_anthropic_client(claude):
    message = claude.messages.create(model="chat-tiny", max_tokens=32, messages=JAPAN)
    assert [(block.type, block.text) for block in message.content] == [("text", "The capital of Japan is Tokyo.")]
    assert (message.role, message.stop_reason, message.stop_sequence) == ("assistant", "end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (24, 8)
    cut = claude.messages.create(model="chat-tiny", max_tokens=3, messages=JAPAN)
    assert cut.stop_reason == "max_tokens"
    stopped = claude.messages.create(model="chat-tiny", max_tokens=32, messages=JAPAN, stop_sequences=[" is"])
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        "The capital of Japan", "stop_sequence", " is")


def test_anthropic_stream_has_its_event_types_in_order(claude):
    with claude.messages.stream(model="chat-tiny", max_tokens=32, messages=JAPAN) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == "The capital of Japan is Tokyo." and final.stop_reason == "end_turn"


def test_anthropic_errors_in_its_shape(server, claude):
    response = httpx.post(f"{server.url}/v1/messages", json={"messages": JAPAN})
    assert response.status_code == 400 and response.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required: a positive integer"}}
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="chat-tiny", max_tokens=8, messages=JAPAN, extra_body={"temperature": -1})


def test_logit_bias_and_penalties_are_those_of_generate(client, runtime):
    (rome,) = runtime.tokenize("Rome", add_bos=False)  # "▁Rome", with the SentencePiece space prefix
    response = client.completions.create(model="m", prompt="The capital of Italy is", max_tokens=3,
                                         logit_bias={str(rome): -100}, frequency_penalty=1.5, presence_penalty=0.5)
    alone = runtime.generate("The capital of Italy is", 3, logit_bias=((rome, -100.0),), frequency_penalty=1.5,
                             presence_penalty=0.5)
    assert response.choices[0].text == alone.text and not alone.text.startswith(" Rome")
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="m", prompt="x", logit_bias={"99999": 1})


def test_a_burst_of_32_streaming_clients_is_answered_in_full_and_frees_its_memory(server, runtime):
    """32 clients at once, 4 streamed requests each: every request answered with its single-request
    text, and MLX's memory in the server back to its level before the burst (after a first burst,
    which makes what the server keeps)."""
    questions = ["What is the capital of Japan?", "What is 17 plus 25?", "My name is Zoe.", "What is 3 plus 4?",
                 "What is the capital of France?", "Hello!", "What is the opposite of cold?", "What is 9 plus 9?"]
    expected = {}
    for question in questions:
        prompt = runtime.apply_chat_template([{"role": "user", "content": question}])
        expected[question] = runtime.generate(runtime.tokenize(prompt, special=True), 20).text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def one_client(number: int, requests: int = 4) -> list[tuple[str, str]]:
        answers = []
        for i in range(requests):
            question = questions[(number + i) % len(questions)]
            stream = client.chat.completions.create(model="m", max_tokens=20, stream=True,
                                                    messages=[{"role": "user", "content": question}])
            answers.append((question, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)))
        return answers

    def held(health: dict) -> int:  # MLX's memory less what the prompt cache holds on purpose
        return health["active_memory_bytes"] - health["prompt_cache_bytes"]

    def burst() -> list[tuple[str, str]]:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            return [answer for answers in pool.map(one_client, range(32)) for answer in answers]

    # A first burst makes what the server makes once and keeps (the batch shapes' compiled steps,
    # its allocator's cache): the memory claim is that a burst leaves nothing behind.
    burst()
    before = httpx.get(f"{server.url}/health").json()
    results = burst()
    assert len(results) == 128
    assert [text for _, text in results] == [expected[question] for question, _ in results]
    after = httpx.get(f"{server.url}/health").json()
    assert after["requests_running"] == after["requests_waiting"] == 0
    # One finished row's KV cache here is 786 KB (6 layers of 2 x [2, 256, 32] float32): a leaked
    # row, slot or batch buffer would exceed this margin. Between two bursts the memory moved by
    # -78 to +15 KB (arrays that Python's cyclic garbage holds until it is collected); the first
    # burst alone left up to 271 KB of what is made once.
    assert held(after) <= held(before) + (256 << 10)
    assert after["prompt_cache_bytes"] <= PROMPT_CACHE_MB << 20


def log_softmax(logits):
    import numpy as np

    logits = np.asarray(logits, np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)


def test_chat_logprobs_are_the_models_log_softmax(client, runtime):
    response = client.chat.completions.create(model="m", messages=JAPAN, logprobs=True, top_logprobs=3)
    entries = response.choices[0].logprobs.content
    generated = runtime.generate(JAPAN_IDS, 32).token_ids
    assert len(entries) == response.usage.completion_tokens == len(generated)
    exact = log_softmax(runtime.logits(JAPAN_IDS + generated[:-1]))[len(JAPAN_IDS) - 1:]
    for entry, token, row in zip(entries, generated, exact):
        assert abs(entry.logprob - row[token]) < 1e-4
        assert [alt.logprob for alt in entry.top_logprobs] == sorted((alt.logprob for alt in entry.top_logprobs),
                                                                      reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token was taken
    assert "".join(entry.token for entry in entries) == "The capital of Japan is Tokyo.</s>"


def test_completions_echo_scores_a_text_without_generating(client, runtime):
    """As evaluation harnesses ask for log-likelihoods: echo, logprobs and max_tokens 0."""
    text = "The capital of Italy is Rome."
    response = client.completions.create(model="m", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = response.choices[0]
    ids = runtime.tokenize(text)
    exact = log_softmax(runtime.logits(ids))
    assert choice.text == text and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    for position, (logprob, token) in enumerate(zip(choice.logprobs.token_logprobs[1:], ids[1:])):
        assert abs(logprob - exact[position, token]) < 1e-4
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    # Offsets into the returned text: BOS and the space SentencePiece puts before "The" take none of it.
    assert choice.logprobs.text_offset[:4] == [0, 0, len("The"), len("The capital")]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_memory_budget_makes_requests_wait_then_answers_503(runtime, engine):
    """A budget of 1 MB holds one chat-tiny row of 256 slots (786 KB), not two, nor one of 512: with
    room for one more waiting request, a burst of eight gets some 503s with Retry-After, and every
    other request is answered in full with its single-request text."""
    server = Server("--kv-budget-mb", "1", "--max-queue", "1", "--engine", engine)
    try:
        too_large = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 500})
        assert too_large.status_code == 400 and too_large.json()["error"]["param"] == "max_tokens"

        def ask(_):
            return httpx.post(f"{server.url}/v1/completions", timeout=120,
                              json={"prompt": "Once upon a time", "max_tokens": 200})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(ask, range(8)))
        busy = [r for r in responses if r.status_code == 503]
        done = [r for r in responses if r.status_code == 200]
        assert busy and done and len(busy) + len(done) == 8
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_overloaded" for r in busy)
        alone = runtime.generate("Once upon a time", 200).text
        assert all(r.json()["choices"][0]["text"] == alone for r in done)
    finally:
        server.stop()


def test_a_second_chat_turn_reuses_the_first_from_the_prompt_cache(client, server, runtime):
    zoe = [{"role": "user", "content": "My name is Zoe."}]
    first = client.chat.completions.create(model="m", messages=zoe)
    turn = zoe + [{"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "What is 17 plus 25?"}]
    body = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": turn, "return_prompt": True}).json()
    fed = body["prompt"]
    # The first turn's prompt and reply were kept when it finished; the second turn starts with both.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == fed["cached_tokens"]
    assert fed["cached_tokens"] >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    # Counted by the engine: what it fed through the model is the prompt less what the cache held.
    assert fed["prefilled_tokens"] == len(fed["token_ids"]) - fed["cached_tokens"] > 0
    # The same text as an uncached run of the same prompt.
    assert body["choices"][0]["message"]["content"] == runtime.generate(fed["token_ids"], 256).text == (
        "17 plus 25 is 42.")


def test_an_unforeseen_failure_is_a_500_for_that_request_alone(runtime):
    from starlette.testclient import TestClient

    from mlxllama.prompt import choose_template
    from mlxllama.sampling import SamplingParams
    from mlxllama.server.app import ServerSettings, create_app
    from mlxllama.server.engine import Engine

    engine = Engine(runtime, max_batch=2)
    app = create_app(runtime, engine, ServerSettings(choose_template(runtime.chat_template), SamplingParams(), 16))
    submit, calls = engine.submit, []

    def fails_once(ticket):
        calls.append(ticket)
        if len(calls) == 1:
            raise RuntimeError("/secret/path/engine.py line 12")
        return submit(ticket)

    engine.submit = fails_once
    try:
        with TestClient(app, raise_server_exceptions=False) as http:
            broken = http.post("/v1/chat/completions", json={"messages": JAPAN})
            assert broken.status_code == 500
            assert broken.json() == {"error": {"message": "internal error (RuntimeError)", "type": "server_error",
                                               "param": None, "code": None}}
            after = http.post("/v1/chat/completions", json={"messages": JAPAN})
            assert after.json()["choices"][0]["message"]["content"] == "The capital of Japan is Tokyo."
    finally:
        engine.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_dtype_reaches_the_engine_wherever_it_runs(engine):
    server = Server("--dtype", "bfloat16", "--dequantize", "--engine", engine)
    try:
        assert httpx.get(f"{server.url}/health").json()["dtype"] == "bfloat16"
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": JAPAN}).json()
        assert reply["choices"][0]["message"]["content"] == "The capital of Japan is Tokyo."
    finally:
        server.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_sigterm_ends_the_server_cleanly_with_a_stream_in_flight(engine):
    import signal

    server = Server("--engine", engine)
    engine_pid = httpx.get(f"{server.url}/health").json()["engine_pid"]
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True}) as response:
        next(response.iter_lines())
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
    stderr = server.process.stderr.read()
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert not alive(engine_pid)  # an engine of its own process went with it


HTTP_SIDE = """
import mlx.core as mx
from starlette.testclient import TestClient
from mlxllama.prompt import choose_template
from mlxllama.runtime import read_model_file
from mlxllama.sampling import SamplingParams
from mlxllama.server.app import ServerSettings, create_app
from mlxllama.server.engine_process import EngineProcess, EngineSpec

if __name__ == "__main__":
    model = read_model_file(MODEL)
    engine = EngineProcess(EngineSpec(MODEL, engine={"prompt_cache_bytes": 1 << 20}))
    app = create_app(model, engine, ServerSettings(choose_template(model.chat_template), SamplingParams(), 16))
    hi = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with TestClient(app) as http:
        for route, body in [("chat/completions", {"messages": hi, "logprobs": True, "top_logprobs": 2}),
                            ("chat/completions", {"messages": hi, "response_format": {"type": "json_object"}}),
                            ("chat/completions", {"messages": hi, "tools": [tool], "tool_choice": "required",
                                                  "chat_template": "llama3"}),
                            ("completions", {"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 0}),
                            ("messages", {"messages": hi, "max_tokens": 8, "stream": True})]:
            response = http.post(f"/v1/{route}", json=body)
            assert response.status_code == 200, (route, response.text)
        assert http.get("/health").json()["active_memory_bytes"] > 0
    engine.stop()
    print(mx.get_peak_memory())
"""


def test_the_http_side_of_an_engine_process_never_touches_the_device():
    """With the engine in a process of its own, the server's process reads the file, renders,
    tokenizes, checks constraints and tools and streams, and makes no MLX array: it holds no
    device memory (on a GPU, none beside the engine's)."""
    script = HTTP_SIDE.replace("MODEL", repr(str(MODEL)))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0"]  # MLX's peak memory in that process, in bytes


LEAVES_EARLY = """
from mlxllama.server.engine_process import EngineProcess, EngineSpec

if __name__ == "__main__":
    engine = EngineProcess(EngineSpec(MODEL))
    print(engine.process.pid, flush=True)
    raise SystemExit(3)  # as serve's process would on an error after the engine started
"""


def test_a_server_process_that_leaves_without_stopping_its_engine_takes_it_along():
    result = subprocess.run([sys.executable, "-c", LEAVES_EARLY.replace("MODEL", repr(str(MODEL)))], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert not alive(int(result.stdout))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_engine_process_that_ends_stops_the_server_with_one_line():
    """The engine's process killed mid-stream: the stream ends with its error event, and the server
    leaves with exit code 1 and one line saying why, not serving requests no engine will answer."""
    import signal

    server = Server("--engine", "process")
    engine_pid = httpx.get(f"{server.url}/health").json()["engine_pid"]
    assert engine_pid != server.process.pid
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True}) as response:
        lines = response.iter_lines()
        next(lines)
        os.kill(engine_pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(rest[-1][6:])["error"] == {"message": "generation failed (EngineLost)", "type": "server_error",
                                                 "param": None, "code": None}
    server.process.wait(timeout=30)
    stderr = server.process.stderr.read()
    assert server.process.returncode == 1, stderr
    assert stderr.splitlines()[-1] == "mlxllama serve: the engine's process ended (exit code -9); stopped"
    assert "Traceback" not in stderr


def test_a_long_prompt_joins_in_chunks_without_stalling_a_running_stream():
    """While a 2,048-token prompt is prefilled in chunks of 256, a running stream gets a token
    after every chunk: its largest gap stays within about one chunk and one step, not the prompt's."""
    chunk, model = 256, REPO / "tests" / "fixtures" / "mistral-tiny-Q4_K_M.gguf"  # a 32k context
    server = Server("-m", str(model), "-c", "4096", "--prefill-chunk", str(chunk))
    try:
        sentence = "The old harbour town wakes before the sun, and the boats come back with the tide. "
        text = sentence * 80
        length = len(httpx.post(f"{server.url}/tokenize", json={"content": text}).json()["tokens"])
        assert 2048 <= length <= 3000
        arrivals: list[tuple[float, int]] = []  # (time, tokens) of each piece of the running stream
        joined = []

        def run_stream():
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                              json={"prompt": "Once upon a time", "max_tokens": 1000, "stream": True, "logprobs": 0}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        tokens = json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                        arrivals.append((time.perf_counter(), len(tokens)))
                    if joined and len(arrivals) > 20 and arrivals[-1][0] > joined[-1] + 0.2:
                        return

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(run_stream)
            while len(arrivals) < 20:
                time.sleep(0.01)
            start = time.perf_counter()
            body = httpx.post(f"{server.url}/v1/completions", timeout=120,
                              json={"prompt": text, "max_tokens": 1, "return_prompt": True}).json()
            joined.append(time.perf_counter())
            stream.result()
        assert body["prompt"]["prefilled_tokens"] == length
        during = [i for i, (t, _) in enumerate(arrivals) if start < t < joined[0]]
        chunks = -(-length // chunk)
        # The engine runs one chunk, then one step of the running rows: a token after every chunk but the last.
        assert sum(arrivals[i][1] for i in during) >= chunks - 1
        gaps = [arrivals[i][0] - arrivals[i - 1][0] for i in during[1:]]
        # The join took `chunks` chunks and steps; one gap is about one of them, all of it unchunked.
        assert max(gaps) < 2 * (joined[0] - start) / chunks
    finally:
        server.stop()
